"""The mixture-of-experts figures on the built pages are the committed results, in both languages.

Oracle: the JSON files in ``benchmarks/results/``, read here directly; the pages get them
through the docs build (``docs_hooks/benchmarks.py``). The curves image is in the site for
both languages, byte for byte the committed PNG of that language (``moe_quality.png``,
``moe_quality.zh.png``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from docs_md import built_page, html_tables

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _table_starting(site: Path, page: str, lang: str, first_cells: list[str]) -> list[list[str]]:
    for table in html_tables(built_page(site, page, lang)):
        if table and [row[0] for row in table[1:]] == first_cells:
            return table
    raise AssertionError(f"{lang} {page}: no table whose rows start with {first_cells}")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_split_table_is_the_committed_measurement(lang: str, site: Path) -> None:
    result = json.loads((RESULTS / "moe_split.json").read_text())
    lrs = result["settings"]["lrs"]
    table = _table_starting(site, "compatibility.md", lang, [f"{lr:g}" for lr in lrs])
    runs = {(r["split"], r["lr"]): r for r in result["runs"]}
    for row, lr in zip(table[1:], lrs, strict=True):
        whole, split = runs[("whole", lr)], runs[("split", lr)]
        assert float(row[1]) == pytest.approx(whole["val"], abs=5e-4)
        assert float(row[2]) == pytest.approx(split["val"], abs=5e-4)
        assert float(row[3].replace("−", "-")) == pytest.approx(
            split["val"] - whole["val"], abs=5e-4
        )
    text = built_page(site, "compatibility.md", lang).read_text(encoding="utf-8")
    assert f"{result['settings']['steps']} " in text


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_quality_table_and_curves_are_the_committed_results(lang: str, site: Path) -> None:
    result = json.loads((RESULTS / "moe_quality.json").read_text())
    names = [f"{name}" for name in result["best"]]
    table = _table_starting(site, "benchmarks.md", lang, names)
    for row, (name, best) in zip(table[1:], result["best"].items(), strict=True):
        assert float(row[4]) == pytest.approx(best["lr"])
        assert float(row[5]) == pytest.approx(best["final_val_loss"], abs=5e-4)
        for lr, value in result["sweep"][name].items():
            assert f"{float(lr):g}: {value:.3f}" in row[3]
    page = built_page(site, "benchmarks.md", lang)
    assert "moe_quality.png" in page.read_text(encoding="utf-8")
    prefix = "zh/" if lang == "zh" else ""
    image = site / f"{prefix}assets/benchmarks/moe_quality.png"
    committed = RESULTS / ("moe_quality.zh.png" if lang == "zh" else "moe_quality.png")
    assert image.read_bytes() == committed.read_bytes()
