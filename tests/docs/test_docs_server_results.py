"""The job service's figures in the changelog (EN + ZH) are those of the committed views
benchmark (``benchmarks/results/server_views.json``)."""

from __future__ import annotations

import json

import pytest
from docs_md import DOCS, ZH

RESULTS = DOCS.parent / "benchmarks" / "results" / "server_views.json"


def _views(run: dict, points: int) -> dict:
    return next(r for r in run["views"] if r["points"] == points)["views"]


@pytest.mark.parametrize("root", [DOCS, ZH], ids=["en", "zh"])
def test_the_changelog_states_the_benchmarks_figures(root) -> None:
    res = json.loads(RESULTS.read_text())
    text = (root / "changelog.md").read_text(encoding="utf-8")
    before, small = _views(res["before"], 500_000), _views(res["before"], 1_000)
    one, listing = "GET /v1/jobs/{id}", "GET /v1/jobs"
    assert f"{before[one]['median_s']:.2f}" in text and f"{before[listing]['median_s']:.2f}" in text
    for name in (one, listing):
        assert str(round(before[name]["median_s"] / small[name]["median_s"])) in text
    after, base = _views(res["after"], 500_000), _views(res["after"], 1_000)
    assert all(after[n]["median_s"] <= 2 * base[n]["median_s"] for n in (one, listing))
    assert all(after[n]["median_s"] < 0.01 for n in (one, listing))  # "a few milliseconds"
    wide = next(s for s in res["after"]["sizes"] if s["line_bytes"] > 900)["ratio"]
    wide_before = next(s for s in res["before"]["sizes"] if s["line_bytes"] > 900)["ratio"]
    assert f"{wide:.1f}" in text and f"{wide_before:.1f}" in text
