"""The naive FSDP2 + Muon baseline on HSDP's 2-D mesh, as ``bench.py --hsdp`` runs it
(``test_bench_quick`` runs the benchmark itself).

Oracle: the single-process run on the global batch (`dist_harness.reference_run`, tolerance
1e-5 as in the other distributed tests).
"""

from __future__ import annotations

from dist_harness import Scenario, make_model, reference_run, run_distributed

NAIVE_HSDP = Scenario("naive-hsdp-2x2", "z3", 1, naive=True, mesh_shape=(2, 2))


def test_the_naive_baseline_trains_as_one_process_on_hsdp() -> None:
    results = run_distributed(4, [NAIVE_HSDP])
    reference = reference_run(NAIVE_HSDP, 4)
    initial = dict(make_model(NAIVE_HSDP).named_parameters())
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        got = result[NAIVE_HSDP.name]
        assert "error" not in got, got.get("error")
        worst = max((got["params"][n] - p).abs().max().item() for n, p in reference.items())
        assert worst <= 1e-5, f"rank {rank}: {worst:.2e}"
    assert max((reference[n] - p).abs().max().item() for n, p in initial.items()) > 1e-3
