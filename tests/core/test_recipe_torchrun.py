"""The recipe under torchrun: 2 gloo ranks give the loss curve of one process.

Oracle: `python -m dmuon.train` in one process on the same global batch (micro-batch 2m
instead of m on each of 2 ranks). Tolerance 1e-4 per step on the logged loss, validation
loss and gradient norm. Only rank 0 prints its summary and writes metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 20
COMMON = [
    "--model", "tiny", "--steps", str(STEPS), "--seq-len", "32", "--accum-steps", "2",
    "--lr", "0.02", "--adamw-lr", "0.003", "--warmup-steps", "2", "--seed", "3",
    "--progress", "plain", "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")  # the corpus is tokenized once


def _run(tmp_path: Path, cache: Path, name: str, nproc: int, extra: list[str]) -> list[dict]:
    metrics = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", DMUON_CACHE_DIR=str(cache))
    if nproc == 1:
        launcher = [sys.executable, "-m", "dmuon.train"]
    else:
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), "-m", "dmuon.train",
        ]  # fmt: skip
    done = subprocess.run(
        [*launcher, *COMMON, *extra, "--metrics-file", str(metrics)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("done:") == 1  # one summary: rank 0 alone reports
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [line for line in lines if line["step"] >= 1]


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_two_ranks_match_one_process_on_the_global_batch(
    tmp_path: Path, cache_dir: Path, mode: str
) -> None:
    args = ["--optimizer", "dmuon", "--mode", mode, "--eval-every", "10"]
    single = _run(tmp_path, cache_dir, "single", 1, [*args, "--micro-batch-size", "4"])
    double = _run(tmp_path, cache_dir, "double", 2, [*args, "--micro-batch-size", "2"])
    assert [m["step"] for m in double] == list(range(1, STEPS + 1))
    assert [m["step"] for m in single] == list(range(1, STEPS + 1))
    for one, two in zip(single, double, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if one.get(key) is not None or two.get(key) is not None:
                assert abs(one[key] - two[key]) <= 1e-4, (key, one, two)
    assert double[-1]["loss"] < double[0]["loss"] - 0.3  # it trained
