"""MkDocs hook: fill the benchmark pages from the committed results in benchmarks/results/.

A page asks for a table with a marker on a line of its own:

``<!-- benchmark: optimizer-step -->``
    ``benchmarks/results/optimizer_step.json``: the optimizer step alone, single process.
``<!-- benchmark: distributed NAME -->``
    ``benchmarks/results/NAME.json``: step time and counted traffic per contender.
``<!-- benchmark: checkpoint-io -->``
    ``benchmarks/results/checkpoint_io.json``: DCP save, load, size and export per contender.
``<!-- benchmark: machine NAME -->``
    One line: the machine, torch version and load average a result was taken under.

Numbers are never typed into the pages. A missing or unreadable file logs a warning, which
fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

log = get_plugin_logger("dmuon-benchmarks")

MARKER = re.compile(
    r"^<!-- benchmark: (?P<kind>[a-z-]+)(?: (?P<name>[A-Za-z0-9_.-]+))? -->[ \t]*$", re.MULTILINE
)
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

LABELS: dict[str, dict[str, str]] = {
    "en": {
        "matrices": "Matrices",
        "torch": "torch.optim.Muon + AdamW (ms)",
        "all": "all",
        "contender": "Contender",
        "accum": "Accumulation",
        "step": "Step (s)",
        "vs": "vs AdamW (same FSDP2 mode)",
        "units": "Muon traffic, counted (units)",
        "formula": "Formula (units)",
        "machine": "Machine",
        "threads": "threads",
        "load": "load average",
        "not_run": "Not run",
        "save": "Save (s)",
        "load_s": "Load (s)",
        "on_disk": "On disk (MiB)",
        "model_part": "Model part (MiB)",
        "optim_part": "Optimizer part (MiB)",
        "copies": "State-dict copies per rank (MiB)",
        "save_rss": "Save, extra RSS (MiB)",
        "load_rss": "Load, extra RSS (MiB)",
        "export": "Export: command / in process (s)",
        "ratio": "DMuon / AdamW",
    },
    "zh": {
        "matrices": "矩阵",
        "torch": "torch.optim.Muon + AdamW（毫秒）",
        "all": "全部",
        "contender": "参与者",
        "accum": "梯度累积",
        "step": "步时（秒）",
        "vs": "相对 AdamW（同一 FSDP2 模式）",
        "units": "Muon 通信量，实测（单位）",
        "formula": "公式（单位）",
        "machine": "机器",
        "threads": "线程",
        "load": "负载均值",
        "not_run": "未运行",
        "save": "保存（秒）",
        "load_s": "加载（秒）",
        "on_disk": "磁盘占用（MiB）",
        "model_part": "模型部分（MiB）",
        "optim_part": "优化器部分（MiB）",
        "copies": "每个 rank 的 state dict 副本（MiB）",
        "save_rss": "保存时额外 RSS（MiB）",
        "load_rss": "加载时额外 RSS（MiB）",
        "export": "导出：命令 / 进程内（秒）",
        "ratio": "DMuon / AdamW",
    },
}


def _load(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def _optimizer_step(labels: dict[str, str]) -> str:
    result = _load("optimizer_step")[0]
    names = list(next(iter(result["rows"].values()))["speedup_vs_torch"])
    lines = [
        f"| {labels['matrices']} | {labels['torch']} | "
        + " | ".join(f"`{n}`" for n in names)
        + " |",
        "|" + "---|" * (2 + len(names)),
    ]
    for label, row in result["rows"].items():
        shown = labels["all"] if label == "all" else label
        cells = [f"{row['median_s']['torch'] * 1e3:.0f}"] + [
            f"{row['median_s'][n] * 1e3:.0f} ms, **{row['speedup_vs_torch'][n]:.2f}x**"
            for n in names
        ]
        lines.append(f"| {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _distributed(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    lines = [
        f"| {labels['contender']} | {labels['accum']} | {labels['step']} | {labels['vs']} | "
        f"{labels['units']} | {labels['formula']} |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        units = "-" if r["muon_units"] is None else f"{r['muon_units']:.2f}"
        formula = "-" if r["formula_units"] is None else f"{r['formula_units']:.0f}"
        lines.append(
            f"| `{r['contender']}` | {r['accum']} | {r['median_step_s']:.3f} | "
            f"{r['vs_adamw_same_mode']:.2f}x | {units} | {formula} |"
        )
    for peer, why in result.get("peers", {}).items():
        lines.append(f"| `{peer}` | - | - | - | - | {labels['not_run']}: {why} |")
    return "\n".join(lines)


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _checkpoint_io(labels: dict[str, str]) -> str:
    result = _load("checkpoint_io")
    keys = (
        "save",
        "load_s",
        "on_disk",
        "model_part",
        "optim_part",
        "copies",
        "save_rss",
        "load_rss",
    )
    lines = [
        f"| {labels['contender']} | " + " | ".join(labels[k] for k in (*keys, "export")) + " |",
        "|" + "---|" * (2 + len(keys)),
    ]
    for name, r in result["rows"].items():
        b = r["bytes"]
        cells = [
            f"{r['median_save_s']:.2f}",
            f"{r['median_load_s']:.2f}",
            f"{_mib(b['on_disk'])}<br>({b['on_disk']:,} B)",
            _mib(b["model_tensors"]),
            _mib(b["optim_tensors"]),
            _mib(r["max_state_dict_copied_bytes"]),
            _mib(r["max_save_extra_rss"]),
            _mib(r["max_load_extra_rss"]),
            f"{r['median_export_s']:.1f} / {r['median_export_in_process_s']:.1f}",
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    q = result["dmuon_over_adamw"]
    ratios = [
        q["save_time"],
        q["load_time"],
        q["bytes_on_disk"],
        None,
        q["optim_bytes"],
        None,
        None,
        None,
        None,
    ]
    cells = ["-" if v is None else f"**{v:.2f}x**" for v in ratios]
    cells[-1] = f"**{q['export_time']:.2f}x** / **{q['export_in_process_time']:.2f}x**"
    lines.append(f"| {labels['ratio']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _machine(name: str, labels: dict[str, str]) -> str:
    data = _load(name)
    if isinstance(data, list):  # optimizer_step.json holds one record per preset
        data = data[0]
    m = data.get("machine", {})
    load = data.get("load_average") or m.get("load_average") or []
    parts = [m.get("cpu", ""), f"{m.get('cores', '?')} cores" if m else ""]
    parts += [f"torch {m['torch']}" if "torch" in m else ""]
    if "threads" in data:
        parts.append(f"{data['threads']} {labels['threads']}")
    if load:
        parts.append(f"{labels['load']} {load[0]:.1f}")
    return f"*{labels['machine']}:* " + ", ".join(p for p in parts if p)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace every benchmark marker of the page with its table or line."""
    if "<!-- benchmark:" not in markdown:
        return markdown
    lang = "zh" if page.file.src_uri.startswith("zh/") else "en"
    labels = LABELS[lang]

    def render(match: re.Match[str]) -> str:
        kind, name = match["kind"], match["name"]
        try:
            if kind == "optimizer-step":
                return _optimizer_step(labels)
            if kind == "distributed" and name:
                return _distributed(name, labels)
            if kind == "checkpoint-io":
                return _checkpoint_io(labels)
            if kind == "machine" and name:
                return _machine(name, labels)
        except (OSError, ValueError, KeyError, IndexError) as e:
            log.warning("%s: cannot render %r: %s", page.file.src_uri, match[0], e)
            return match[0]
        log.warning("%s: unknown benchmark marker %r", page.file.src_uri, match[0])
        return match[0]

    return MARKER.sub(render, markdown)
