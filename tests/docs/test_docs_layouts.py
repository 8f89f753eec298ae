"""The parallel-layouts results the benchmarks page states, against the committed JSON.

The tables come from the results (the benchmarks hook); the prose claims are checked here:
DMuon's counted traffic equals its formula in every layout (Z2 2 units, Z3 3 at one
micro-batch; under tensor parallelism the tp traffic of rank 0's dp rank is 2 units of the
matrices it owns, about 1 with two dp ranks), DDP moves the matrices in 2 units under both
baselines, and the page shows both runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _rows(name: str) -> dict[str, dict]:
    return {r["contender"]: r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"]}


def test_ddp_traffic_is_the_formula() -> None:
    rows = _rows("layouts-ddp")
    assert rows["ddp-adamw"]["matrix_units"] == pytest.approx(2.0)
    assert rows["ddp-torch-muon"]["matrix_units"] == pytest.approx(2.0)
    assert rows["ddp-dmuon-z2"]["matrix_units"] == pytest.approx(2.0)
    assert rows["ddp-dmuon-z3"]["matrix_units"] == pytest.approx(3.0)


def test_tp_traffic_is_the_formula() -> None:
    rows = _rows("layouts-tp")
    assert rows["tp-dmuon-z2"]["matrix_units"] == pytest.approx(2.0)
    assert rows["tp-dmuon-z3"]["matrix_units"] == pytest.approx(3.0)
    for name in ("tp-dmuon-z2", "tp-dmuon-z3"):
        assert rows[name]["tp_units"] == pytest.approx(1.0, abs=0.2)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_page_shows_both_runs(lang: str) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    page = (docs if lang == "en" else docs / "zh") / "benchmarks.md"
    text = page.read_text(encoding="utf-8")
    for name in ("layouts-ddp", "layouts-tp"):
        assert f"<!-- benchmark: layouts {name} -->" in text
        assert f"<!-- benchmark: machine {name} -->" in text
