"""The benchmarks page's start-up figures are the committed measurement, in both languages.

Oracle: ``benchmarks/results/recipe_startup.json`` (written by
``benchmarks/recipe_startup.py --json``), read here directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from docs_md import DOCS, REPO, ZH

RESULT = REPO / "benchmarks" / "results" / "recipe_startup.json"


def _section(page: str) -> str:
    text = page.split("{#startup}", 1)[1]
    return text.split("\n## ", 1)[0]


@pytest.mark.parametrize("docs", [DOCS, ZH], ids=["en", "zh"])
def test_startup_figures_are_the_committed_measurement(docs: Path) -> None:
    result = json.loads(RESULT.read_text(encoding="utf-8"))
    section = _section((docs / "benchmarks.md").read_text(encoding="utf-8"))
    cpu = result["median_cpu_s"]
    for figure in (
        f"{cpu['kept']:.2f}",
        f"{cpu['plain']:.2f}",
        f"{result['median_cpu_ratio_kept_over_plain']:.2f}",
        f"{result['steps']}",
        f"`{result['model']}`",
        "benchmarks/results/recipe_startup.json",
    ):
        assert figure in section, f"{docs}: {figure} not in the start-up section"
    assert f"--rounds {len(result['rounds'])}" in section
    assert cpu["kept"] < cpu["plain"]  # what the section says the change does
