"""A real torchrun run of the recipe stopped by SIGTERM resumes exactly, on 2 gloo ranks.

Oracle: the same flags run uninterrupted for all steps in one torchrun launch. The run
under test gets SIGTERM (sent to torchrun's process group, as a job service cancelling it
does; torchrun forwards it to the workers) a few steps in, saves a checkpoint, writes the
``stopped`` metrics line, and is resumed by a second launch with the same flags
(``--resume auto``). Its final checkpoint must equal the oracle's bit for bit (model and
optimizer state), and its metrics file must hold every step once with the oracle's losses.
Gradient accumulation (2 micro-batches, the last one synchronizing) is on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from recipe_launch import recipe_env
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dmuon.train.checkpoints.folder import find_checkpoints, is_complete
from dmuon.train.data import load_corpus

STEPS = 30
COMMON = [
    "--model", "tiny", "--steps", str(STEPS), "--seq-len", "32", "--micro-batch-size", "2",
    "--accum-steps", "2", "--warmup-steps", "2", "--seed", "5", "--eval-every", "0",
    "--progress", "plain", "--device", "cpu", "--checkpoint-every", "10",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(cache_dir: str) -> Path:
    # The shared corpus cache (conftest.py), filled here once so that the two launches
    # below do not both tokenize the corpus.
    path = Path(cache_dir)
    load_corpus(None, cache_dir=path)
    return path


def _launch(cache: Path, run_dir: Path, extra: list[str]) -> subprocess.Popen[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = recipe_env(cache, run_dir)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "dmuon.train", *COMMON, *extra,
        "--checkpoint-dir", str(run_dir / "ckpt"), "--metrics-file", str(run_dir / "m.jsonl"),
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, to signal torchrun as a whole
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "m.jsonl").read_text().splitlines()]


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300
    path = run_dir / "m.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and any(
            r.get("step", 0) >= step for r in map(json.loads, path.read_text().splitlines())
        ):
            return
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 300 s")


def _final_state(path: Path, tmp: Path) -> dict[str, Any]:
    """A DCP checkpoint as one plain dict, read without a process group."""
    out = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _assert_bitwise_equal(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_bitwise_equal(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_bitwise_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    else:
        assert got == want, where


def test_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path: Path, cache_dir: Path) -> None:
    # DMuon in Z2 (dedicated matrices, Muon momentum, AdamW on the rest, FSDP2 shards);
    # the AdamW baseline's resume is checked in one process (test_recipe_checkpoint.py).
    flags = ["--optimizer", "dmuon", "--mode", "z2", "--keep-checkpoints", "2"]
    oracle_dir, run_dir = tmp_path / "oracle", tmp_path / "run"
    # Both launches at once: the oracle's setup overlaps the run's.
    oracle = _launch(cache_dir, oracle_dir, flags)
    run = _launch(cache_dir, run_dir, flags)
    _wait_for_step(run_dir, 3, run)
    os.killpg(run.pid, signal.SIGTERM)
    run.communicate(timeout=300)  # torchrun itself exits non-zero: it was signalled
    _finish(oracle)

    stopped = _metrics(run_dir)[-1]
    assert stopped["event"] == "stopped" and stopped["signal"] == "SIGTERM", stopped
    k = stopped["step"]
    assert 3 <= k < STEPS, stopped
    checkpoint = Path(stopped["checkpoint"])
    assert checkpoint.name == f"step_{k:08d}" and is_complete(checkpoint)
    assert all(r["step"] <= k for r in _metrics(run_dir))
    # The periodic checkpoint of step 10 is kept only if k > 10 (keep 2).
    assert [s for s, _ in find_checkpoints(run_dir / "ckpt")][-1] == k

    out = _finish(_launch(cache_dir, run_dir, flags))  # --resume auto (the default)
    assert f"resumed from {checkpoint}" in out, out[-4000:]

    records = _metrics(run_dir)
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == list(range(1, STEPS + 1))
    assert [r for r in records if "event" in r] == [stopped]
    want = {r["step"]: r for r in _metrics(oracle_dir)}
    for r in records:
        if "event" not in r:
            assert (r["loss"], r["grad_norm"], r["lr"]) == (
                want[r["step"]]["loss"],
                want[r["step"]]["grad_norm"],
                want[r["step"]]["lr"],
            ), r["step"]
    times = [r["time"] for r in records if "event" not in r]
    assert times == sorted(times)  # the resumed run continues the clock

    # keep 2: the newest two complete checkpoints, the final one last.
    assert [s for s, _ in find_checkpoints(run_dir / "ckpt")] == [20, 30]
    final = _final_state(run_dir / "ckpt" / f"step_{STEPS:08d}", tmp_path)
    oracle_final = _final_state(oracle_dir / "ckpt" / f"step_{STEPS:08d}", tmp_path)
    _assert_bitwise_equal(final["model"], oracle_final["model"], "model")
    _assert_bitwise_equal(final["optim"], oracle_final["optim"], "optim")
