"""`make bench-quick`'s assertions: traffic counted by intercepting torch.distributed,
and DMuon's packed-buffer bytes after forward counted from its runtime.

Oracle: the per-step communication formulas for Muon-target matrices, in units of
(N-1)/N x P_M (DESIGN.md): DMuon Z2 = 2, Z3 = 2k + 1, naive FSDP2 + Muon (Z3) = 2k + 2 for k
micro-batches. The counts come from wrapping the collectives of torch.distributed and its
functional collectives (benchmarks/traffic.py), not from any library's own audit. Timing is
printed by the benchmark but never asserted.
"""

from __future__ import annotations

import pytest
from bench_modules import import_benchmark
from dist_harness import spawn_ranks


@pytest.fixture(scope="module")
def quick_result() -> dict:
    bench = import_benchmark("bench")
    # DMuon's own contenders only: the peers' traffic is checked by `make bench-quick`.
    return bench.run(bench.parse_args(["--quick", "--contenders", *bench.OWN]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--accum", "1", "0"], "argument --accum: 0 is less than 1"),
        (["--nproc", "-2"], "argument --nproc: -2 is less than 1"),
        (["--steps", "0"], "argument --steps: 0 is less than 1"),
        (["--micro-batch", "two"], "argument --micro-batch: 'two' is not a whole number"),
    ],
)
def test_a_count_below_one_is_refused_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = import_benchmark("bench")
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_counted_traffic_matches_the_formulas(quick_result: dict) -> None:
    expected = {
        ("dmuon-z2", 1): 2,
        ("dmuon-z3", 1): 3,
        ("naive-z3", 1): 4,
        ("dmuon-z2", 2): 2,
        ("dmuon-z3", 2): 5,
        ("naive-z3", 2): 6,
    }
    got = {
        (r["contender"], r["accum"]): r["muon_units"]
        for r in quick_result["rows"]
        if r["muon_units"] is not None
    }
    assert set(got) == set(expected)
    for key, units in expected.items():
        # tiny's matrices split evenly over 2 ranks: no padding, so the count is exact.
        assert got[key] == pytest.approx(units, abs=1e-9), key


def test_adamw_traffic_is_fsdp2s_only(quick_result: dict) -> None:
    for r in quick_result["rows"]:
        if r["contender"].startswith("adamw"):
            assert r["elements_per_rank"]["dmuon"] == 0
            assert r["elements_per_rank"]["peer"] == 0
            assert r["elements_per_rank"]["torch"] > 0


def test_steps_to_reach_interpolates_between_evaluations() -> None:
    steps_to_reach = import_benchmark("quality").steps_to_reach
    curve = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5)]
    # 3.5 lies halfway between the evaluations at steps 10 (4.0) and 20 (3.0).
    assert steps_to_reach(curve, 3.5) == pytest.approx(15.0)
    assert steps_to_reach(curve, 3.0) == pytest.approx(20.0)
    assert steps_to_reach(curve, 2.0) is None


def test_dedicated_bytes_after_forward_match_the_formula(quick_result: dict) -> None:
    # Oracle: docs/z2-vs-z3.md#memory. Z2 keeps every packed buffer resident after forward,
    # all P_M elements in the broadcast dtype (float32 here: 4 bytes); Z3 frees each hook
    # boundary's buffers when its forward ends. P_M comes from dedicate_params' plan, the
    # counted bytes from the runtime's buffers.
    checked = 0
    for r in quick_result["rows"]:
        if not r["contender"].startswith("dmuon"):
            assert r["dedicated_bytes_after_forward"] is None
            continue
        expected = r["muon_elements"] * 4 if r["contender"] == "dmuon-z2" else 0
        assert r["muon_elements"] > 0
        assert r["dedicated_bytes_after_forward"] == expected, r["contender"]
        assert r["dedicated_bytes_formula"] == expected
        # Z2's resident buffers are part of what a rank holds during its step.
        assert r["peak_memory_bytes"] > r["dedicated_bytes_after_forward"]
        checked += 1
    assert checked == 4


def test_peak_memory_is_recorded_for_every_contender(quick_result: dict) -> None:
    for r in quick_result["rows"]:
        assert r["peak_memory_bytes"] > 0, r["contender"]


def _count_with_the_replicate_group_ignored(rank: int, world: int) -> dict[str, int]:
    import torch
    import torch.distributed as dist

    traffic = import_benchmark("traffic")
    shard = dist.new_group([0, 1]), dist.new_group([2, 3])
    replicate = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = shard[rank // 2], replicate[rank % 2]
    with traffic.TrafficCounter(ignored_group=(rank % 2, rank % 2 + 2)) as counter:
        dist.broadcast(torch.ones(5), src=2 * (rank // 2), group=mine[0])
        dist.all_reduce(torch.ones(7), group=mine[1])
        dist.all_reduce(torch.ones(3))  # the whole world: counted
    return dict(counter.elements)


def test_the_replicate_groups_collectives_are_left_out_under_hsdp() -> None:
    """`bench.py --hsdp` counts the shard dimension only: the oracle is the elements each
    call moves, written out here (a broadcast of 5, an all-reduce of 3 counted twice)."""
    for counted in spawn_ranks(4, _count_with_the_replicate_group_ignored):
        assert counted == {("torch", "broadcast"): 5, ("torch", "all_reduce"): 6}


def test_the_naive_contender_runs_under_hsdp_at_its_traffic_formula() -> None:
    """``--hsdp 2`` on 4 ranks: the naive baseline (which cut its update by one placement
    and failed on the 2-D mesh) runs, and its counted traffic matches its formula."""
    bench = import_benchmark("bench")
    flags = ["--quick", "--nproc", "4", "--hsdp", "2", "--accum", "1"]
    result = bench.run(bench.parse_args([*flags, "--contenders", "naive-z3", "dmuon-z3"]))
    assert [r["contender"] for r in result["rows"]].count("naive-z3") == 1, result["not_run"]
    assert bench.check(result) == []
