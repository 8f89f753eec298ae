"""How `dmuon.Muon`'s defaults compare with `torch.optim.Muon`'s and `torch.optim.AdamW`'s.

Read from the signatures of the three optimizers when the docs are built, and from what
torch does with a value where a signature alone does not say (``adjust_lr_fn=None``, the
Newton-Schulz dtype), so the migration page and the FAQ cannot drift from the code.

``<!-- generated: torch-muon-defaults -->``
    Table: every argument whose default differs, with the argument that gives torch's
    behaviour; the arguments that agree are listed below it.
``<!-- generated: torch-muon-differences -->``
    The same differences as a short list (the FAQ).
``<!-- generated: torch-muon-arguments -->``
    The ``dmuon.Muon(...)`` call with every argument that reproduces ``torch.optim.Muon``.
``<!-- generated: torch-adamw-defaults -->``
    Table: ``dmuon.Muon``'s ``adamw_*`` defaults against ``torch.optim.AdamW``'s.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

#: Matrix shapes on which two learning-rate adjustments are compared (tall, wide, square).
SHAPES = ((64, 16), (16, 64), (32, 32))

TEXT: dict[str, dict[str, str]] = {
    "en": {
        "argument": "Argument",
        "theirs": "`torch.optim.Muon`",
        "ours": "`dmuon.Muon`",
        "reproduce": "To get torch's behaviour, pass",
        "same_args": "The other arguments of `torch.optim.Muon` have the same defaults in "
        "`dmuon.Muon`: {same}.",
        "ns_theirs": "always {dtype}",
        "ns_ours": "`None`: {rule}",
        "ns_rule": "{cuda} on CUDA, {bf16} on CPUs with native bfloat16, {other} on other CPUs",
        "no_argument": "(no argument)",
        "none_note": "`adjust_lr_fn=None` means {ours} in `dmuon.Muon` but {theirs} in "
        "`torch.optim.Muon`.",
        "ratio_none": "no adjustment",
        "item": "`{name}`: {theirs} in `torch.optim.Muon`, {ours} in `dmuon.Muon`",
        "ns_item": "the Newton-Schulz dtype: always {dtype} in `torch.optim.Muon`, which has "
        "no argument for it; in `dmuon.Muon` `ns_dtype=None` picks {rule}",
        "compared": "Compared",
        "adamw_theirs": "`torch.optim.AdamW`",
        "same": "same",
        "differs": "differs: pass `{arg}`",
    },
    "zh": {
        "argument": "参数",
        "theirs": "`torch.optim.Muon`",
        "ours": "`dmuon.Muon`",
        "reproduce": "要得到 torch 的行为，传入",
        "same_args": "`torch.optim.Muon` 的其余参数在 `dmuon.Muon` 中默认值相同：{same}。",
        "ns_theirs": "总是 {dtype}",
        "ns_ours": "`None`：{rule}",
        "ns_rule": "CUDA 上为 {cuda}，原生支持 bfloat16 的 CPU 上为 {bf16}，其他 CPU 上为 {other}",
        "no_argument": "（无此参数）",
        "none_note": "`adjust_lr_fn=None` 在 `dmuon.Muon` 中表示{ours}，在 `torch.optim.Muon` "
        "中却表示 {theirs}。",
        "ratio_none": "不做调整",
        "item": "`{name}`：`torch.optim.Muon` 中为 {theirs}，`dmuon.Muon` 中为 {ours}",
        "ns_item": "Newton-Schulz 的计算精度：`torch.optim.Muon` 总是用 {dtype}，"
        "且没有参数可以改变；`dmuon.Muon` 的 `ns_dtype=None` 则选择：{rule}",
        "compared": "比较",
        "adamw_theirs": "`torch.optim.AdamW`",
        "same": "相同",
        "differs": "不同：传入 `{arg}`",
    },
}


@dataclass(frozen=True)
class Default:
    """One argument's default in torch's optimizer and in `dmuon.Muon`."""

    name: str
    theirs: Any
    ours: Any
    same: bool
    argument: str
    """What to pass to `dmuon.Muon` for torch's behaviour, e.g. ``lr=0.001``."""


def _defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def python(value: Any) -> str:
    """``value`` as Python source, strings in double quotes as the docs write them."""
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "(" + ", ".join(python(v) for v in value) + ")"
    return repr(value)


def _show(value: Any) -> str:
    return f"`{python(value)}`"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _coefficient_name(value: Any, steps: int) -> tuple[str | None, list[tuple[float, ...]]]:
    """The built-in name whose triples equal ``value``'s, and the triples themselves."""
    ns = importlib.import_module("dmuon.optim._orthogonalize")
    triples = [tuple(map(float, t)) for t in ns.resolve_coefficients(value, steps)]
    for name in ns.COEFFICIENT_SETS:
        named = [tuple(map(float, t)) for t in ns.resolve_coefficients(name, steps)]
        if named == triples:
            return name, triples
    return None, triples


def torch_adjust_lr_name(value: Any) -> str | None:
    """The `dmuon.Muon` ``adjust_lr_fn`` that scales like torch's ``value`` on every shape."""
    torch_muon = importlib.import_module("torch.optim._muon")
    muon = importlib.import_module("dmuon.optim._muon")
    for name in muon.ADJUST_LR_FNS:
        if all(
            abs(torch_muon._adjust_lr(1.0, value, shape) - muon.adjust_lr_ratio(name, *shape))
            < 1e-12
            for shape in SHAPES
        ):
            return name
    raise ValueError(f"no dmuon adjust_lr_fn scales like torch's {value!r}")


def torch_ns_dtype() -> Any:
    """The dtype torch.optim.Muon's Newton-Schulz iteration returns for a float32 input."""
    torch = importlib.import_module("torch")
    torch_muon = importlib.import_module("torch.optim._muon")
    a, b, c = _defaults(torch.optim.Muon)["ns_coefficients"]
    return torch_muon._zeropower_via_newtonschulz(torch.eye(2), (a, b, c), 1, 1e-7).dtype


def dmuon_ns_dtypes() -> dict[str, Any]:
    """`dmuon.Muon`'s default iteration dtype on CUDA, on CPUs with and without bfloat16."""
    torch = importlib.import_module("torch")
    ns = importlib.import_module("dmuon.optim._orthogonalize")
    out = {"cuda": ns.default_ns_dtype(torch.device("cuda"))}
    for key, native in (("bf16", True), ("other", False)):
        with mock.patch.object(ns, "cpu_has_native_bf16", lambda native=native: native):
            out[key] = ns.default_ns_dtype(torch.device("cpu"))
    return out


def muon_defaults() -> list[Default]:
    """Every defaulted argument of `torch.optim.Muon`, against `dmuon.Muon`'s."""
    torch = importlib.import_module("torch")
    dmuon = importlib.import_module("dmuon")
    theirs, ours = _defaults(torch.optim.Muon), _defaults(dmuon.Muon)
    steps = int(theirs.get("ns_steps", 5))
    rows = []
    for name, value in theirs.items():
        mine = ours[name]  # a torch argument dmuon.Muon lacks fails the build here
        if name == "ns_coefficients":
            their_name, their_triples = _coefficient_name(value, steps)
            _, our_triples = _coefficient_name(mine, steps)
            same = their_triples == our_triples
            argument = f"{name}={python(their_name or value)}"
        elif name == "adjust_lr_fn":
            equivalent = torch_adjust_lr_name(value)
            same = equivalent == mine
            argument = f"{name}={python(equivalent)}"
        else:
            same = value == mine
            argument = f"{name}={python(value)}"
        rows.append(Default(name, value, mine, same, argument))
    return rows


def ns_dtype_default() -> Default:
    """The Newton-Schulz dtype: fixed in torch, chosen per device by `dmuon.Muon`."""
    theirs = torch_ns_dtype()
    ours = dmuon_ns_dtypes()
    same = all(dtype == theirs for dtype in ours.values())
    return Default("ns_dtype", theirs, ours, same, f"ns_dtype=torch.{_dtype_name(theirs)}")


def adamw_defaults() -> list[Default]:
    """`dmuon.Muon`'s ``adamw_*`` defaults against `torch.optim.AdamW`'s."""
    torch = importlib.import_module("torch")
    dmuon = importlib.import_module("dmuon")
    theirs, ours = _defaults(torch.optim.AdamW), _defaults(dmuon.Muon)
    rows = []
    for name, mine in ours.items():
        if not name.startswith("adamw_"):
            continue
        value = theirs[name.removeprefix("adamw_")]
        rows.append(Default(name, value, mine, value == mine, f"{name}={python(value)}"))
    return rows


def reproducing_arguments() -> list[str]:
    """The arguments of `dmuon.Muon` that give `torch.optim.Muon`'s update."""
    rows = [*muon_defaults(), ns_dtype_default()]
    return [row.argument for row in rows if not row.same]


# --------------------------------------------------------------------------- rendering


def _ns_cells(t: dict[str, str], row: Default) -> tuple[str, str]:
    ours = {key: _dtype_name(dtype) for key, dtype in row.ours.items()}
    return (
        t["ns_theirs"].format(dtype=_dtype_name(row.theirs)),
        t["ns_ours"].format(rule=t["ns_rule"].format(**ours)),
    )


def render_defaults(lang: str) -> str:
    """The table of differing defaults, then the agreeing ones and the ``None`` note."""
    t = TEXT[lang]
    rows = muon_defaults()
    out = [
        f"| {t['argument']} | {t['theirs']} | {t['ours']} | {t['reproduce']} |",
        "|---|---|---|---|",
    ]
    for row in rows:
        if not row.same:
            out.append(
                f"| `{row.name}` | {_show(row.theirs)} | {_show(row.ours)} | `{row.argument}` |"
            )
    ns = ns_dtype_default()
    if not ns.same:
        theirs, ours = _ns_cells(t, ns)
        out.append(f"| `{ns.name}` {t['no_argument']} | {theirs} | {ours} | `{ns.argument}` |")
    same = ", ".join(f"`{row.name}={python(row.theirs)}`" for row in rows if row.same)
    out += ["", t["same_args"].format(same=same)]
    theirs_none = torch_adjust_lr_name(None)
    if theirs_none is not None:  # torch's None is a named scaling; dmuon's None is not
        muon = importlib.import_module("dmuon.optim._muon")
        unscaled = all(muon.adjust_lr_ratio(None, *shape) == 1.0 for shape in SHAPES)
        ours_none = t["ratio_none"] if unscaled else "`None`"
        out += ["", t["none_note"].format(ours=ours_none, theirs=f'`"{theirs_none}"`')]
    return "\n".join(out)


def render_differences(lang: str) -> str:
    """The differing defaults as a list, the Newton-Schulz dtype last."""
    t = TEXT[lang]
    out = []
    for row in muon_defaults():
        if not row.same:
            item = t["item"].format(name=row.name, theirs=_show(row.theirs), ours=_show(row.ours))
            out.append(f"- {item}")
    ns = ns_dtype_default()
    if not ns.same:
        rule = t["ns_rule"].format(**{k: _dtype_name(v) for k, v in ns.ours.items()})
        out.append("- " + t["ns_item"].format(dtype=_dtype_name(ns.theirs), rule=rule))
    return "\n".join(out)


def render_arguments(lang: str) -> str:
    """The call that reproduces torch.optim.Muon, one argument per line."""
    args = "".join(f"    {arg},\n" for arg in reproducing_arguments())
    return f"```python\ndmuon.Muon(\n    model,\n{args})\n```"


def render_adamw(lang: str) -> str:
    """``adamw_*`` against torch.optim.AdamW, one row per argument."""
    t = TEXT[lang]
    out = [
        f"| {t['argument']} | {t['adamw_theirs']} | {t['ours']} | {t['compared']} |",
        "|---|---|---|---|",
    ]
    for row in adamw_defaults():
        verdict = t["same"] if row.same else t["differs"].format(arg=row.argument)
        out.append(f"| `{row.name}` | {_show(row.theirs)} | {_show(row.ours)} | {verdict} |")
    return "\n".join(out)


RENDERERS: dict[str, Callable[[str], str]] = {
    "torch-muon-defaults": render_defaults,
    "torch-muon-differences": render_differences,
    "torch-muon-arguments": render_arguments,
    "torch-adamw-defaults": render_adamw,
}
