"""The half-precision communication results on the built pages, and the claims made of them.

Oracle: ``benchmarks/results/comm_dtype.json``, read here directly; the pages get it through
the docs build (``docs_hooks/benchmarks.py``). The page claims that a bfloat16 collective
moves exactly half the bytes of its float32 form with the same units, that the final
validation loss stays within 1.5 % of the float32 run's and the mean training loss of the
last 10 steps within 1 %: each is checked against the committed numbers, and the table and
the figure on both languages' pages against the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from docs_md import built_page, html_tables

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RESULT = json.loads((RESULTS / "comm_dtype.json").read_text())


def test_the_stated_claims_hold_for_the_committed_result() -> None:
    runs, summary = RESULT["runs"], RESULT["summary"]
    assert set(runs) == {"float32", "bf16-reduce", "bf16-reduce-broadcast"}
    for name, run in runs.items():
        halved = {"reduce"} if run["reduce_dtype"] == "bfloat16" else set()
        if run["broadcast_dtype"] == "bfloat16":
            halved.add("broadcast")
        s = summary[name]
        assert s["bytes_vs_float32"] == {
            kind: 0.5 if kind in halved else 1.0 for kind in ("broadcast", "reduce")
        }
        assert s["units"] == summary["float32"]["units"]
        assert s["final_val_loss_rel_diff"] <= 0.015
        assert s["last10_train_loss_rel_diff"] <= 0.01
        assert len(run["train_loss"]) == RESULT["settings"]["steps"] == 50
    for lang in ("en", "zh"):
        page = (Path(__file__).resolve().parents[2] / "docs").joinpath(
            *(["zh"] if lang == "zh" else []), "benchmarks.md"
        )
        text = page.read_text(encoding="utf-8")
        assert "1.5 %" in text and "1 %" in text, lang


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_table_and_the_figure_are_the_committed_result(lang: str, site: Path) -> None:
    page = built_page(site, "benchmarks.md", lang)
    names = [f"{name}" for name in RESULT["runs"]]
    table = next((t for t in html_tables(page) if [row[0] for row in t[1:]] == names), None)
    assert table is not None, f"{lang}: no table with the rows {names}"
    for row, name in zip(table[1:], names, strict=True):
        s = RESULT["summary"][name]
        assert (
            row[3] == f"{s['bytes']['reduce'] / 2**20:.1f} / {s['bytes']['broadcast'] / 2**20:.1f}"
        )
        assert float(row[5]) == pytest.approx(s["final_val_loss"], abs=5e-5)
    prefix = "zh/" if lang == "zh" else ""
    image = site / f"{prefix}assets/benchmarks/comm_dtype.png"
    committed = RESULTS / ("comm_dtype.zh.png" if lang == "zh" else "comm_dtype.png")
    assert image.read_bytes() == committed.read_bytes()
    assert "comm_dtype.png" in page.read_text(encoding="utf-8")
