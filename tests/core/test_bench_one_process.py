"""`benchmarks/one_process_overhead.py` compares like with like: the dedicated model it
times computes the plain model's gradients (every matrix's average equals the plain
``.grad`` after the same micro-batches, with and without ``no_sync``), and the ratio it
reports is the median of its rounds' ratios."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from bench_modules import import_benchmark

import dmuon
from dmuon._ownership import gradients
from dmuon.train import build_model


@pytest.mark.parametrize("accum", [1, 3])
def test_the_timed_models_compute_the_same_gradients(accum: int) -> None:
    bench = import_benchmark("one_process_overhead")
    plain = build_model("tiny", max_seq_len=16)
    dedicated = build_model("tiny", max_seq_len=16)
    dedicated.load_state_dict(plain.state_dict())
    dmuon.dedicate_params(dedicated)
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 17), generator=generator) for _ in range(accum)]
    cpu = torch.device("cpu")
    assert bench._forward_backward(plain, batches, False, cpu) > 0
    assert bench._forward_backward(dedicated, batches, True, cpu) > 0
    owned = {id(p) for p in dmuon.dedicated_parameters(dedicated).parameters()}
    assert owned
    for (name, ours), theirs in zip(dedicated.named_parameters(), plain.parameters(), strict=True):
        grad = gradients.reduced(ours) if id(ours) in owned else ours.grad
        assert grad is not None, name
        torch.testing.assert_close(grad, theirs.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_reported_ratio_is_the_median_of_the_rounds(tmp_path: Path) -> None:
    bench = import_benchmark("one_process_overhead")
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--rounds", "3", "--warmup", "1", "--seq-len", "16",
            "--batch", "2", "--accum", "2", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 3 and result["accum"] == 2
    ratios = [r["dedicated"] / r["plain"] for r in result["rounds"]]
    assert result["median_ratio"] == statistics.median(ratios)
    assert result["min_ratio"] <= result["median_ratio"] <= result["max_ratio"]
