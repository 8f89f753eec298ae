"""The CUDA / NCCL transport: the same scenarios on GPUs (skipped without CUDA).

Oracle: the single-process CPU run on the global batch (`dist_harness.reference_run`).
GPU kernels sum in other orders than the CPU ones, so the tolerance is 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import Scenario, reference_run, run_distributed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with NCCL"),
]

SCENARIOS = [
    Scenario("cuda-z2-accum4", "z2", 4),
    Scenario("cuda-z3-accum4", "z3", 4),
    Scenario("cuda-z3-checkpoint", "z3", 2, checkpoint=True),
]


@pytest.fixture(scope="module")
def cuda_results():
    world = min(2, torch.cuda.device_count())
    return world, run_distributed(world, SCENARIOS, device_type="cuda")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_nccl_matches_single_process(cuda_results, scenario: Scenario) -> None:
    world, results = cuda_results
    reference = reference_run(scenario, world)
    for rank, per_rank in enumerate(results):
        result = per_rank[scenario.name]
        assert "error" not in result, result.get("error")
        for fqn, expected in reference.items():
            diff = (result["params"][fqn] - expected).abs().max().item()
            assert diff <= 1e-4, f"rank {rank} {fqn}: {diff}"
        units = [step["units"] for step in result["comm"]]
        if world > 1:
            expected_units = 2.0 if scenario.mode == "z2" else 2 * scenario.accum + 1.0
            assert units == [pytest.approx(expected_units)] * scenario.steps
