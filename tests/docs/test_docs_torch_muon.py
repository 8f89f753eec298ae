"""What the docs say about dmuon.Muon against torch.optim.Muon comes from both signatures.

Oracle: ``inspect.signature`` of ``torch.optim.Muon``, ``torch.optim.AdamW`` and
``dmuon.Muon``, read here; what torch does with a float32 matrix in its Newton-Schulz
iteration; and ``dmuon.optim.default_ns_dtype`` on a CPU with and without native bfloat16.
The migration page's script then checks the reproducing arguments against torch's update
(it runs with the other docs examples).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from docs_md import DOCS, built_page, code_blocks, html_tables, parse_html

import dmuon
from dmuon.optim import _orthogonalize as orthogonalize

PAGE = "from-torch-muon.md"


def _defaults(fn: object) -> dict[str, object]:
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()  # type: ignore[arg-type]
        if p.default is not inspect.Parameter.empty
    }


TORCH, OURS, ADAMW = (
    _defaults(torch.optim.Muon),
    _defaults(dmuon.Muon),
    _defaults(torch.optim.AdamW),
)
DIFFERING = [name for name, value in TORCH.items() if OURS[name] != value]
SAME = [name for name, value in TORCH.items() if OURS[name] == value]


def _code(cell: str) -> str:
    return cell.replace("'", '"')


def test_the_defaults_that_differ_are_the_ones_the_signatures_give() -> None:
    """A sanity check of the oracle itself: lr, weight_decay, the coefficients and the
    learning-rate adjustment differ; the Newton-Schulz dtype has no torch argument."""
    assert {"lr", "weight_decay", "ns_coefficients", "adjust_lr_fn"} <= set(DIFFERING)
    assert "ns_dtype" not in TORCH and OURS["ns_dtype"] is None


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_migration_table_lists_every_differing_default(site: Path, lang: str) -> None:
    path = built_page(site, PAGE, lang)
    table = next(t for t in html_tables(path) if t[0][1] == "torch.optim.Muon")
    rows = {row[0].split()[0]: row for row in table[1:]}
    assert list(rows) == [*DIFFERING, "ns_dtype"]
    for name in DIFFERING:
        _, theirs, ours, argument = rows[name]
        assert _code(theirs) == _code(repr(TORCH[name]))
        assert _code(ours) == _code(repr(OURS[name]))
        assert argument.startswith(f"{name}=")
    text = parse_html(path).text
    for name in SAME:  # the arguments that agree are named with their common default
        assert f"{name}={TORCH[name]!r}" in text


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_faq_lists_the_same_differences(site: Path, lang: str) -> None:
    html = built_page(site, "faq.md", lang).read_text(encoding="utf-8")
    section = html.split('id="same-as-torch"', 1)[1].split("<h2", 1)[0]
    listed = re.findall(r"<li><code>(\w+)</code>", section)
    assert listed == DIFFERING
    assert "Newton-Schulz" in re.sub(r"<[^>]+>", "", section)


def test_the_newton_schulz_dtype_rows_hold() -> None:
    """torch always iterates in bfloat16; dmuon.Muon picks float32 on a CPU without native
    bfloat16, bfloat16 on one with it and on CUDA."""
    a, b, c = TORCH["ns_coefficients"]  # type: ignore[misc]
    out = torch.optim._muon._zeropower_via_newtonschulz(torch.randn(4, 4), (a, b, c), 5, 1e-7)
    assert out.dtype == torch.bfloat16
    for native, expected in ((False, torch.float32), (True, torch.bfloat16)):
        with mock.patch.object(orthogonalize, "cpu_has_native_bf16", lambda n=native: n):
            assert orthogonalize.default_ns_dtype(torch.device("cpu")) == expected
    assert orthogonalize.default_ns_dtype(torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_adamw_table_compares_with_torch_adamw(site: Path, lang: str) -> None:
    table = next(
        t for t in html_tables(built_page(site, PAGE, lang)) if t[0][1] == "torch.optim.AdamW"
    )
    names = [name for name in OURS if name.startswith("adamw_")]
    assert [row[0] for row in table[1:]] == names
    for row in table[1:]:
        theirs = ADAMW[row[0].removeprefix("adamw_")]
        assert _code(row[1]) == _code(repr(theirs)) and _code(row[2]) == _code(repr(OURS[row[0]]))


def _muon_call_arguments(code: str) -> set[str]:
    """``name=value`` of the first ``dmuon.Muon(model, ...)`` call with keyword arguments."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "dmuon.Muon" and node.keywords:
            return {f"{k.arg}={ast.unparse(k.value)}" for k in node.keywords}
    raise AssertionError("no dmuon.Muon(...) call with arguments")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_script_uses_the_generated_arguments(site: Path, lang: str) -> None:
    """The arguments shown (generated) are the ones the checking script passes, and they
    set every differing default to torch's value."""
    html = built_page(site, PAGE, lang).read_text(encoding="utf-8")
    shown = re.sub(r"<[^>]+>", "", html.split('id="reproduce"', 1)[1].split("</pre>", 1)[0])
    generated = set(re.findall(r"^\s+(\w+=[^,\n]+),$", shown.replace("&quot;", '"'), re.M))
    script = next(
        b.code for b in code_blocks(DOCS / PAGE) if "torch.optim.Muon(" in b.code and b.lang
    )

    def canonical(args: set[str]) -> dict[str, str]:
        pairs = (arg.split("=", 1) for arg in args)
        return {k: ast.dump(ast.parse(v, mode="eval")) for k, v in pairs}

    assert canonical(generated) == canonical(_muon_call_arguments(script))
    assert {arg.split("=")[0] for arg in generated} == {*DIFFERING, "ns_dtype"}
    values = {k: v for k, v in (arg.split("=", 1) for arg in generated)}
    assert float(values["lr"]) == TORCH["lr"]
    assert float(values["weight_decay"]) == TORCH["weight_decay"]
    assert values["ns_dtype"] == "torch.bfloat16"
    name = ast.literal_eval(values["ns_coefficients"])
    triples = [tuple(t) for t in orthogonalize.resolve_coefficients(name, 5)]
    assert triples == [tuple(TORCH["ns_coefficients"])] * 5  # type: ignore[arg-type]
    # torch's adjust_lr_fn default scales like the name passed to dmuon.Muon.
    adjust = ast.literal_eval(values["adjust_lr_fn"])
    for shape in ((64, 16), (16, 64)):
        theirs = torch.optim._muon._adjust_lr(1.0, TORCH["adjust_lr_fn"], torch.Size(shape))
        assert theirs == pytest.approx(dmuon.optim.adjust_lr_ratio(adjust, *shape))
