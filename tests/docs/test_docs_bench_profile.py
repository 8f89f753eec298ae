"""The step-time breakdown and the memory columns on the built pages are the committed
results, in both languages.

Oracle: ``benchmarks/results/profile_small-n2.json`` and ``quick.json``, read here directly;
the pages get them through the docs build (``docs_hooks/benchmarks.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from docs_md import built_page, html_tables

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _tables_with_first_cells(site: Path, lang: str, first: list[str]) -> list[list[list[str]]]:
    tables = html_tables(built_page(site, "benchmarks.md", lang))
    return [t for t in tables if t and [row[0] for row in t[1:]] == first]


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_where_the_time_goes_is_the_committed_profile(lang: str, site: Path) -> None:
    result = json.loads((RESULTS / "profile_small-n2.json").read_text())
    names = [r["contender"] for r in result["rows"]]
    breakdown, _inside = _tables_with_first_cells(site, lang, names)
    for row, measured in zip(breakdown[1:], result["rows"], strict=True):
        assert int(row[1]) == measured["accum"]
        assert float(row[5]) == pytest.approx(measured["mean"]["ns"], abs=5e-4)
        assert float(row[8]) == pytest.approx(measured["mean"]["total"], abs=5e-4)
    dmuon = [r for r in result["rows"] if r["contender"].startswith("dmuon")]
    (limit,) = _tables_with_first_cells(site, lang, [r["contender"] for r in dmuon])
    for row, measured in zip(limit[1:], dmuon, strict=True):
        for rank, cell in enumerate(row[3:5]):
            assert float(cell) == pytest.approx(measured["per_rank"][rank]["ns_cpu"], abs=5e-4)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_memory_columns_are_the_committed_quick_run(lang: str, site: Path) -> None:
    result = json.loads((RESULTS / "quick.json").read_text())
    ran = [[r["contender"], str(r["accum"])] for r in result["rows"]]
    tables = html_tables(built_page(site, "benchmarks.md", lang))
    (table,) = [t for t in tables if t and [row[:2] for row in t[1 : 1 + len(ran)]] == ran]
    for row, measured in zip(table[1:], result["rows"], strict=False):
        assert float(row[8]) == pytest.approx(measured["peak_memory_bytes"] / 2**20, abs=0.05)
        if measured["dedicated_bytes_formula"] is None:
            assert row[9] == "-"
            continue
        counted, formula = (float(x) for x in row[9].split(" / "))
        assert counted == pytest.approx(measured["dedicated_bytes_after_forward"] / 2**20, abs=5e-3)
        assert formula == pytest.approx(measured["dedicated_bytes_formula"] / 2**20, abs=5e-3)


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("name", ["cuda-small-n1", "cuda-base-n1"])
def test_gpu_tables_are_the_committed_cuda_runs(lang: str, name: str, site: Path) -> None:
    result = json.loads((RESULTS / name).with_suffix(".json").read_text())
    assert result["device"] == "cuda" and "gpu" in result["machine"]
    ran = [[f"{r['contender']}", str(r["accum"])] for r in result["rows"]]
    tables = html_tables(built_page(site, "benchmarks.md", lang))
    (table,) = [t for t in tables if t and [row[:2] for row in t[1:]] == ran]
    for row, measured in zip(table[1:], result["rows"], strict=True):
        assert float(row[2]) == pytest.approx(measured["median_step_s"], rel=5e-3)
        assert row[3] == f"{measured['vs_adamw_same_mode']:.2f}x"
        assert row[6] == row[7] == "-"  # one rank: no traffic unit to count in
        peak = measured["peak_memory_bytes"]
        assert row[8] == ("-" if peak < 0 else f"{peak / 2**20:.1f}")


def _shows(table: list[list[str]], result: dict) -> bool:
    """Whether an optimizer-step table shows this result: torch's time and every speedup."""
    for row, measured in zip(table[1:], result["rows"].values(), strict=True):
        if float(row[1]) != pytest.approx(measured["median_s"]["torch"] * 1e3, rel=6e-3):
            return False
        speedups = measured["speedup_vs_torch"].values()
        if any(not c.endswith(f"{x:.2f}x") for c, x in zip(row[2:], speedups, strict=True)):
            return False
    return True


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("name", ["optimizer_step", "optimizer_step_cuda"])
def test_optimizer_step_tables_are_the_committed_runs(lang: str, name: str, site: Path) -> None:
    results = json.loads((RESULTS / f"{name}.json").read_text())
    tables = html_tables(built_page(site, "benchmarks.md", lang))
    for result in results:
        # The CPU and GPU runs share `small`'s buckets: exactly one table shows this run.
        buckets = [label for label in result["rows"] if label != "all"]
        candidates = [t for t in tables if t and [row[0] for row in t[2:]] == buckets]
        assert sum(_shows(t, result) for t in candidates) == 1, result["preset"]


GPU_CHECK = RESULTS.parents[1] / "benchmarks" / "gpu_check.sh"
DOCS = RESULTS.parents[1] / "docs"


@pytest.mark.parametrize(
    ("page", "limits", "tests"),
    [
        ("benchmarks.md", "({} minutes in all)", "The {} CUDA tests passed"),
        ("zh/benchmarks.md", "（合计 {} 分钟）", "{} 个 CUDA 测试全部通过"),
    ],
)
def test_gpu_section_numbers_come_from_the_script_and_its_log(
    page: str, limits: str, tests: str
) -> None:
    text = (DOCS / page).read_text()
    stage_limits = [
        int(m.group(1)) for m in re.finditer(r"^stage \S+ (\d+) ", GPU_CHECK.read_text(), re.M)
    ]
    assert len(stage_limits) == 4 and sum(stage_limits) <= 8 * 60  # the 8 minutes
    assert limits.format(f"{sum(stage_limits) / 60:g}") in text
    summary = (RESULTS / "cuda-tests.log").read_text().strip().splitlines()[-1]
    passed = re.fullmatch(r"(\d+) passed in [\d.]+s", summary)
    assert passed, f"the committed CUDA test log ends in {summary!r}, not all passed"
    assert tests.format(passed.group(1)) in text


def test_base_section_claims_hold_in_the_committed_run() -> None:
    """The `base` section says DMuon's optimizer step stays under 0.6x naive's and that its
    step-time ratio to AdamW falls as the accumulation grows."""
    rows = json.loads((RESULTS / "base-n2.json").read_text())["rows"]
    naive = {r["accum"]: r["median_optim_step_s"] for r in rows if r["contender"] == "naive-z3"}
    for mode in ("dmuon-z2", "dmuon-z3"):
        ours = sorted((r["accum"], r) for r in rows if r["contender"] == mode)
        assert [accum for accum, _ in ours] == [1, 4, 8]
        assert all(r["median_optim_step_s"] < 0.6 * naive[accum] for accum, r in ours)
        ratios = [r["vs_adamw_same_mode"] for _, r in ours]
        assert ratios == sorted(ratios, reverse=True), (mode, ratios)


def test_small_n4_section_claim_holds_in_the_committed_run() -> None:
    """The four-rank section says both DMuon modes beat AdamW at the same mode at
    accumulation 8."""
    rows = json.loads((RESULTS / "small-n4.json").read_text())["rows"]
    at_8 = {r["contender"]: r["vs_adamw_same_mode"] for r in rows if r["accum"] == 8}
    assert at_8["dmuon-z2"] < 1.0 and at_8["dmuon-z3"] < 1.0, at_8


def test_quality_section_claims_hold_in_the_committed_sweep() -> None:
    """The quality section says each sweep is centred on the recipe's current defaults and
    that each optimizer's best rate is its default, the middle one."""
    from dmuon.train.cli import TrainConfig

    result = json.loads((RESULTS / "quality.json").read_text())
    defaults = {"dmuon": TrainConfig().lr, "adamw": TrainConfig(optimizer="adamw").adamw_rate}
    assert result["defaults"] == defaults
    for optimizer, default in defaults.items():
        rates = [r["lr"] for r in result["runs"] if r["optimizer"] == optimizer]
        assert rates == [default / 2, default, default * 2], optimizer
    assert result["best_lr"] == defaults


def test_cpu_optimizer_step_section_claims_hold_in_the_committed_run() -> None:
    """The CPU optimizer-step section says the run covers `small` and `base` on a CPU that
    multiplies bfloat16 natively, so that `dmuon-default` iterates in bfloat16."""
    results = json.loads((RESULTS / "optimizer_step.json").read_text())
    assert [r["preset"] for r in results] == ["small", "base"]
    for result in results:
        assert result["device"] == "cpu" and result["machine"]["native_bf16"] is True
        assert result["default_ns_dtype"] == "torch.bfloat16"
    # "faster than torch's on small but not by 1.5x, and about even on base"
    small, base = (r["rows"]["all"]["speedup_vs_torch"]["dmuon-default"] for r in results)
    assert 1.0 < small < 1.5
    assert 0.9 < base < 1.1


def test_amx_section_claim_holds_in_the_committed_run() -> None:
    """The native-bfloat16 section says every step-time target that could run is met, with
    DMuon's Newton-Schulz in bfloat16 on a CPU that multiplies it natively."""
    result = json.loads((RESULTS / "small-n2-amx.json").read_text())
    assert result["machine"]["native_bf16"] is True
    rows = {(r["contender"], r["accum"]): r for r in result["rows"]}
    for mode in ("dmuon-z2", "dmuon-z3"):
        assert rows[(mode, 1)]["vs_adamw_same_mode"] <= 1.0
        assert rows[(mode, 8)]["vs_adamw_same_mode"] <= 0.95
        for accum in (1, 4, 8):
            ours, peer = rows[(mode, accum)], rows[("muon-fsdp2-z3", accum)]
            assert ours["optim_vs_naive"] <= 0.5
            assert ours["median_step_s"] < peer["median_step_s"]
            assert ours["muon_units"] < peer["muon_units"]
    assert set(result["peers"]["dtensor-muon-z3"]["not_run"]) == {"1", "4", "8"}  # no Triton


@pytest.mark.parametrize(
    ("page", "phrase"),
    [
        ("docs/newton-schulz.md", r"short side is (\d+) or more"),
        ("docs/benchmarks.md", r"short side is (\d+) or more"),
        ("docs/zh/newton-schulz.md", r"短边不小于 (\d+) 的矩阵"),
        ("docs/zh/benchmarks.md", r"短边不小于 (\d+) 的矩阵"),
    ],
)
def test_one_at_a_time_threshold_is_the_code_constant(page: str, phrase: str) -> None:
    from dmuon.optim._orthogonalize import CPU_ONE_AT_A_TIME_MIN_SIDE

    text = (RESULTS.parents[1] / page).read_text(encoding="utf-8")
    stated = re.findall(phrase, " ".join(text.split()))
    assert stated and all(int(n) == CPU_ONE_AT_A_TIME_MIN_SIDE for n in stated), page
