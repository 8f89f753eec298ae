"""The recipe across two torchrun agents (c10d rendezvous over loopback) as HSDP.

Two ``torchrun --nnodes 2 --nproc-per-node P --rdzv-backend c10d`` agents on this machine
stand for two nodes; ``--hsdp 2`` makes each one a replica: a 2x1 mesh with one process
per agent and a 2x2 mesh with two. Oracle: the recipe in one process (this one) on the
same global batch of 4 (micro-batch 4 instead of 4 / (2P) on each of 2P ranks). Its final
checkpoint's weights must match within 1e-5 per parameter. The runs are Z2
(``test_recipe_torchrun.py`` runs Z3 under ``torchrun --standalone``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from recipe_launch import recipe_env

from dmuon.checkpoint._export import load_full_weights
from dmuon.train.__main__ import main
from dmuon.train.models.preset import build_model

STEPS = 4
COMMON = [
    "--model", "tiny", "--steps", str(STEPS), "--seq-len", "32", "--accum-steps", "2",
    "--lr", "0.02", "--adamw-lr", "0.003", "--warmup-steps", "2", "--seed", "3",
    "--ns-dtype", "float32",
    "--progress", "plain", "--device", "cpu", "--eval-every", "0", "--mode", "z2",
]  # fmt: skip
TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _final_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    (final,) = [p for p in checkpoint_dir.iterdir() if p.name == f"step_{STEPS:08d}"]
    return load_full_weights(final)


@pytest.fixture(scope="module")
def one_process_weights(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: str
) -> dict[str, torch.Tensor]:
    """The oracle: the recipe in this process (torch is imported already), global batch 4."""
    checkpoints = tmp_path_factory.mktemp("single")
    single = [*COMMON, "--micro-batch-size", "4", "--checkpoint-dir", str(checkpoints)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DMUON_CACHE_DIR", cache_dir)
        assert main([*single, "--threads", "1"]) == 0
    return _final_weights(checkpoints)


@pytest.mark.parametrize("per_agent", [1, 2], ids=["2x1", "2x2"])
def test_two_torchrun_agents_as_hsdp_match_one_process(
    tmp_path: Path, cache_dir: str, one_process_weights: dict[str, torch.Tensor], per_agent: int
) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    agent = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
        "--nproc-per-node", str(per_agent), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", f"hsdp-test-{per_agent}",
        "--max-restarts", "0", "-m", "dmuon.train", *COMMON,
        "--micro-batch-size", str(4 // (2 * per_agent)),
        "--hsdp", "2", "--checkpoint-dir", str(tmp_path / "hsdp"),
    ]  # fmt: skip
    started = time.monotonic()
    agents = [
        subprocess.Popen(
            agent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=recipe_env(cache_dir, tmp_path),
        )
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=TIMEOUT) for a in agents]
    wall = time.monotonic() - started
    for a, (_, err) in zip(agents, outputs, strict=True):
        assert a.returncode == 0, err[-4000:]
    print(f"two torchrun agents, HSDP 2x{per_agent}, {STEPS} steps: {wall:.1f} s wall")
    assert sum(out.count("done:") for out, _ in outputs) == 1  # rank 0 alone reports

    expected = one_process_weights
    got = _final_weights(tmp_path / "hsdp")
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, worst
    start = build_model("tiny", seed=3, max_seq_len=32, device=torch.device("cpu"))
    moved = max((p.detach() - expected[k]).abs().max().item() for k, p in start.named_parameters())
    assert moved > 1e-3  # the runs trained


def test_hsdp_degree_that_does_not_divide_the_processes_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--model", "tiny", "--steps", "1", "--hsdp", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--hsdp 2 needs a number of processes divisible by 2, but this run has 1" in err
    assert "--hsdp 1 for a 1-D mesh" in err
