"""The recipe under faults: damaged checkpoints and full disks.

Oracles: the same flags run without the fault (the losses of a run resumed past a damaged
or unwritable checkpoint equal an undisturbed run's bit for bit), the manifest's own
verification of the folders left behind, and a real full disk: a tmpfs a few MiB large,
mounted by the test (skipped where mounting is not permitted).
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import psutil
import pytest
from recipe_launch import recipe_env

from dmuon.checkpoint import verify_checkpoint
from dmuon.train import TrainConfig, run
from dmuon.train.__main__ import main
from dmuon.train.checkpoints import folder as ckpt
from dmuon.train.data import load_corpus
from dmuon.train.loop import StepFailed, Trainer


@pytest.fixture(scope="module")
def base(cache_dir: str) -> TrainConfig:
    return TrainConfig(
        model="tiny",
        seq_len=32,
        micro_batch_size=2,
        accum_steps=2,
        steps=4,
        optimizer="dmuon",
        warmup_steps=2,
        min_lr_ratio=1.0,
        eval_every=0,
        progress="plain",
        cache_dir=cache_dir,
        threads=1,
    )


@pytest.fixture(scope="module")
def undisturbed(base: TrainConfig) -> dict[str, Any]:
    """The oracle: the same 4 steps with no checkpoint at all."""
    return run(base)


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r.get(contract.EVENT_KEY) == name]


def _losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if contract.EVENT_KEY not in r}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: room for two checkpoints of the tiny preset (1.4 MiB each), not three."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_resume_auto_skips_a_damaged_checkpoint_and_names_it(
    base: TrainConfig,
    undisturbed: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    metrics = tmp_path / "m.jsonl"
    cfg = replace(base, checkpoint_dir=str(tmp_path / "c"), metrics_file=str(metrics))
    run(replace(cfg, steps=3, checkpoint_every=2))  # checkpoints at steps 2 and 3
    newest = tmp_path / "c" / "step_00000003"
    shard = newest / "__0_0.distcp"
    with shard.open("r+b") as f:  # what a full disk or a bad copy leaves
        f.truncate(shard.stat().st_size // 2)
    capfd.readouterr()

    resumed = run(cfg)  # --resume auto

    assert resumed["resumed_from"] == str(tmp_path / "c" / "step_00000002")
    warning = capfd.readouterr().err
    assert "skipping damaged checkpoint" in warning and str(newest) in warning
    assert "__0_0.distcp" in warning
    [event] = _events(metrics, contract.CHECKPOINT_SKIPPED_EVENT)
    assert event["checkpoint"] == str(newest) and event["step"] == 2
    assert any("__0_0.distcp" in problem for problem in event["problems"])
    # Steps 3 and 4 are trained again from step 2 exactly as the undisturbed run did.
    assert resumed["final_loss"] == undisturbed["final_loss"]
    assert sorted(_losses(metrics)) == [1, 2, 3, 4]
    # The damaged folder was passed over, not deleted: it is the operator's evidence.
    assert newest.is_dir() and verify_checkpoint(newest)


def test_an_explicit_damaged_checkpoint_is_an_error_naming_the_file(
    base: TrainConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(replace(base, steps=1, checkpoint_dir=str(tmp_path / "c")))
    path = tmp_path / "c" / "step_00000001"
    (path / ckpt.TRAINER_STATE_FILE).write_bytes(b"not the trainer state")
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "tiny", "--resume", str(path), "--cache-dir", base.cache_dir or ""])
    assert exit_.value.code == contract.EXIT_USAGE
    err = capsys.readouterr().err
    assert "damaged" in err and str(path) in err and ckpt.TRAINER_STATE_FILE in err


def test_a_full_disk_stops_the_run_or_warns_and_the_earlier_checkpoints_stay_intact(
    base: TrainConfig,
    undisturbed: dict[str, Any],
    small_disk: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    folder = small_disk / "c"
    cfg = replace(base, checkpoint_dir=str(folder), checkpoint_every=1, keep_checkpoints=0)

    # --on-checkpoint-error warn: steps 3 and 4 find no room; the run says so each time
    # and trains on, unchanged.
    metrics = tmp_path / "warn.jsonl"
    warned = run(replace(cfg, on_checkpoint_error="warn", metrics_file=str(metrics)))
    err = capfd.readouterr().err
    assert err.count("could not be written") == 2
    failed = _events(metrics, contract.CHECKPOINT_FAILED_EVENT)
    assert [e["step"] for e in failed] == [3, 4]
    assert str(folder) in failed[0]["message"] and "MiB" in failed[0]["message"]
    assert warned["final_loss"] == undisturbed["final_loss"]
    assert warned["checkpoint"] == str(folder / "step_00000002")
    assert [s for s, _ in ckpt.find_checkpoints(folder)] == [1, 2]
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000001", "step_00000002"]

    # The default, stop: the run ends with an error naming the folder and the space.
    for path in folder.iterdir():
        shutil.rmtree(path)
    with pytest.raises(ckpt.CheckpointWriteError) as error:
        run(cfg)
    assert error.value.errno == errno.ENOSPC
    message = error.value.strerror
    assert f"step 3 could not be written to {folder}" in message
    assert "MiB are free" in message and "needs about" in message
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000001", "step_00000002"]
    for _, path in ckpt.find_checkpoints(folder):
        assert verify_checkpoint(path) == []

    # What was kept loads: resumed elsewhere it trains steps 3 and 4 as the oracle did.
    resumed = run(replace(base, resume=str(folder / "step_00000002")))
    assert resumed["start_step"] == 2
    assert resumed["final_loss"] == undisturbed["final_loss"]


def test_a_full_disk_under_torchrun_fails_every_rank_alike_with_exit_4(
    base: TrainConfig, small_disk: Path, tmp_path: Path
) -> None:
    """Two ranks write their shards to one full disk: no rank hangs in the save's
    collectives, both stop with the recipe's exit status, and the kept checkpoints verify."""
    assert base.cache_dir is not None
    load_corpus(None, cache_dir=Path(base.cache_dir))
    folder = small_disk / "c"
    env = recipe_env(base.cache_dir, tmp_path)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "dmuon.train", "--model", "tiny", "--steps", "4", "--seq-len", "32",
        "--micro-batch-size", "2", "--eval-every", "0", "--progress", "plain",
        "--device", "cpu", "--checkpoint-dir", str(folder), "--checkpoint-every", "1",
        "--keep-checkpoints", "0",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    # Both ranks report the same failure (torchrun names the first failed rank's exit code).
    assert out.count("dmuon-train: error: the checkpoint of step") == 2, out[-3000:]
    assert f"exitcode  : {contract.EXIT_CHECKPOINT_WRITE}" in out, out[-3000:]
    kept = ckpt.find_checkpoints(folder)
    assert kept and all(verify_checkpoint(path) == [] for _, path in kept)
    assert not [p for p in folder.iterdir() if p.name.startswith(contract.TEMPORARY_PREFIX)]


def _worker_of_rank(launcher: psutil.Process, rank: int) -> psutil.Process:
    """The torchrun worker process that has ``RANK=rank`` in its environment."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for child in launcher.children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} under torchrun")


#: Each phase after an optimizer step that runs collectives: the settings that run it at
#: step 2 (the export: after the last step), the name the error gives it, and the steps
#: the metrics file holds (a step's line is written after its evaluation, before the rest).
PHASES = {
    "evaluate": ({"eval_every": 2}, "the evaluation of step 2", [1]),
    "sample": ({"sample_every": 2}, "the sample of step 2", [1, 2]),
    "save_checkpoint": ({"checkpoint_every": 2}, "the checkpoint of step 2", [1, 2]),
    "export_hf": ({}, "the export after step 4", [1, 2, 3, 4]),
}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_failure_after_the_step_names_its_phase_step_and_rank(
    base: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """A collective that fails in an evaluation, a sample, a checkpoint or the export (a
    rank that stalled there, say) ends the run as one in the optimizer step does: a
    `StepFailed` naming the phase, its step and the rank, the backend's error after it."""
    settings, name, written = PHASES[phase]
    original = getattr(Trainer, phase)
    calls: list[int] = []

    def failing_at_step_2(self: Trainer, *args: Any) -> Any:
        calls.append(1)
        if phase == "evaluate" and len(calls) == 1:  # the evaluation of step 0 passes
            return original(self, *args)
        raise RuntimeError("Application timeout caused pair closure")

    monkeypatch.setattr(Trainer, phase, failing_at_step_2)
    metrics = tmp_path / "m.jsonl"
    cfg = replace(
        base,
        metrics_file=str(metrics),
        checkpoint_dir=str(tmp_path / "ckpt"),
        export_hf=str(tmp_path / "hf"),
        **settings,
    )
    with pytest.raises(StepFailed) as error:
        run(cfg)
    assert str(error.value) == (
        f"{name} failed on rank 0 of 1: RuntimeError: Application timeout caused pair closure"
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r.get("grad_norm") is not None] == written


def test_a_stalled_rank_fails_the_run_within_the_collective_timeout(
    base: TrainConfig, tmp_path: Path
) -> None:
    """Rank 1 is stopped (SIGSTOP) mid-run: rank 0 fails within --collective-timeout
    instead of waiting forever, and says which collective timed out."""
    assert base.cache_dir is not None
    load_corpus(None, cache_dir=Path(base.cache_dir))
    timeout_s = 5
    metrics = tmp_path / "m.jsonl"
    env = recipe_env(base.cache_dir, tmp_path)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "dmuon.train", "--model", "tiny", "--steps", "100000", "--seq-len", "32",
        "--micro-batch-size", "2", "--eval-every", "0", "--progress", "plain",
        "--device", "cpu", "--metrics-file", str(metrics),
        "--collective-timeout", str(timeout_s),
    ]  # fmt: skip
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        launcher = psutil.Process(proc.pid)
        rank1 = _worker_of_rank(launcher, 1)
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        rank1.suspend()  # SIGSTOP
        stopped_at = time.monotonic()
        while "failed on rank 0 of 2" not in log.read_text():
            assert time.monotonic() - stopped_at < timeout_s + 60, log.read_text()[-3000:]
            time.sleep(0.1)
        detected_s = time.monotonic() - stopped_at
        rank1.kill()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    text = log.read_text()
    print(f"stalled rank detected after {detected_s:.1f} s (timeout {timeout_s} s)")
    assert proc.returncode != 0
    assert timeout_s - 1 <= detected_s < timeout_s + 60, text[-3000:]
    # The error names the step, the rank and the timeout setting, after the backend's own.
    error = next(line for line in text.splitlines() if "StepFailed: step" in line)
    assert "failed on rank 0 of 2" in error and f"--collective-timeout {timeout_s} s" in error
