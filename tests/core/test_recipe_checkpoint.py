"""Recipe checkpoints in one process: folder rules, resume, init-from, stop, flag errors.

Oracles: an uninterrupted run of the same flags (final checkpoint compared bit for bit,
read back with torch's own ``dcp_to_torch_save``), the folder contents written by hand
for the naming rules, and the process exit status for the second signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dmuon.checkpoint import write_manifest
from dmuon.train import TrainConfig, Trainer, parse_args, run
from dmuon.train.__main__ import main
from dmuon.train.checkpoints import folder as ckpt
from dmuon.train.checkpoints.stateful import RNGState
from dmuon.train.reporting.metrics_file import truncate_after
from dmuon.train.stopping import StopRequest


@pytest.fixture(scope="module")
def base(cache_dir: str) -> TrainConfig:
    # min_lr_ratio 1: after warmup the rate is constant, so a run of 3 steps continued
    # to 5 has the schedule of a 5-step run (the cosine depends on --steps).
    return TrainConfig(
        model="tiny",
        seq_len=32,
        micro_batch_size=2,
        accum_steps=2,
        steps=5,
        optimizer="adamw",
        warmup_steps=2,
        min_lr_ratio=1.0,
        eval_every=0,
        progress="plain",
        cache_dir=cache_dir,
        threads=1,
    )


def _fake_checkpoint(path: Path, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    if complete:
        (path / ckpt.TRAINER_STATE_FILE).write_bytes(b"x")
        write_manifest(path)
    return path


def _as_dict(path: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_only_complete_step_folders_are_checkpoints(tmp_path: Path) -> None:
    for step in (3, 12, 7):
        _fake_checkpoint(tmp_path / f"step_{step:08d}")
    _fake_checkpoint(tmp_path / "step_00000020", complete=False)  # no trainer state
    _fake_checkpoint(tmp_path / ".tmp_step_00000030")  # a save cut short
    _fake_checkpoint(tmp_path / "step_40")  # not 8 digits
    _fake_checkpoint(tmp_path / "xstep_00000050")
    assert [s for s, _ in ckpt.find_checkpoints(tmp_path)] == [3, 7, 12]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_00000012"
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None
    assert ckpt.remove_incomplete(tmp_path) == [tmp_path / ".tmp_step_00000030"]
    assert not (tmp_path / ".tmp_step_00000030").exists()
    # keep 2, but never the one just written (here the oldest)
    removed = ckpt.rotate_checkpoints(tmp_path, 2, protect=tmp_path / "step_00000003")
    assert removed == []
    assert ckpt.rotate_checkpoints(tmp_path, 2) == [tmp_path / "step_00000003"]
    assert ckpt.rotate_checkpoints(tmp_path, 0) == []  # 0 keeps all
    assert [s for s, _ in ckpt.find_checkpoints(tmp_path)] == [7, 12]


@pytest.mark.parametrize("optimizer", ["adamw", "dmuon"])
def test_resume_continues_bit_for_bit_and_the_metrics_file_once_per_step(
    base: TrainConfig, tmp_path: Path, optimizer: str
) -> None:
    base = replace(base, optimizer=optimizer)
    whole = run(replace(base, checkpoint_dir=str(tmp_path / "whole")))
    assert whole["checkpoint"] == str(tmp_path / "whole" / "step_00000005")
    metrics = tmp_path / "m.jsonl"
    cfg = replace(base, checkpoint_dir=str(tmp_path / "parts"), metrics_file=str(metrics))
    first = run(replace(cfg, steps=3, checkpoint_every=2))
    assert (first["steps"], first["resumed_from"]) == (3, None)
    # A later line of a run that died before its next checkpoint, cut short mid-write.
    with metrics.open("a") as f:
        f.write('{"step": 4, "loss": 1.0}\n{"step": 5, "lo')
    second = run(cfg)  # --resume auto
    assert second["resumed_from"] == str(tmp_path / "parts" / "step_00000003")
    assert (second["start_step"], second["steps"], second["tokens"]) == (3, 5, 2 * 4 * 32)
    assert [r["step"] for r in _lines(metrics)] == [1, 2, 3, 4, 5]
    got = _as_dict(tmp_path / "parts" / "step_00000005", tmp_path)
    want = _as_dict(tmp_path / "whole" / "step_00000005", tmp_path)
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for name, moments in want["optim"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(got["optim"]["state"][name][key], tensor), (name, key)
    assert second["final_loss"] == whole["final_loss"]
    # Resuming a finished run trains nothing and writes nothing new.
    again = run(cfg)
    assert (again["start_step"], again["steps"], again["tokens"]) == (5, 5, 0)
    assert [s for s, _ in ckpt.find_checkpoints(tmp_path / "parts")] == [2, 3, 5]


def test_a_save_cut_short_leaves_the_previous_checkpoint_latest(
    base: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = replace(base, steps=4, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    real_state_dict = RNGState.state_dict
    saves = []

    def dies_on_second_save(self: RNGState) -> dict[str, Any]:
        saves.append(1)
        if len(saves) == 2:  # after DCP wrote the folder, before the trainer state
            raise KeyboardInterrupt("killed during the save")
        return real_state_dict(self)

    monkeypatch.setattr(RNGState, "state_dict", dies_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    monkeypatch.setattr(RNGState, "state_dict", real_state_dict)
    leftover = tmp_path / ".tmp_step_00000004"
    assert (leftover / ".metadata").is_file()  # DCP finished, the checkpoint did not
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    resumed = run(cfg)
    assert resumed["resumed_from"] == str(tmp_path / "step_00000002")
    assert not leftover.exists()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_00000004"


class _SignalledAt(Trainer):
    """Sends itself SIGTERM during step ``at`` (the real handler catches it)."""

    at = 2

    def train_step(self, step: int) -> dict[str, float]:
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(step)


def test_sigterm_finishes_the_step_saves_and_says_so(base: TrainConfig, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    cfg = replace(base, checkpoint_dir=str(tmp_path / "c"), metrics_file=str(metrics))
    before = signal.getsignal(signal.SIGTERM)
    trainer = _SignalledAt(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] == 2
    lines = _lines(metrics)
    assert [r["step"] for r in lines] == [1, 2, 2]
    assert lines[-1] == {
        "step": 2, "loss": None, "lr": None, "tokens_per_s": None, "grad_norm": None,
        "time": None, "event": "stopped", "signal": "SIGTERM",
        "checkpoint": str(tmp_path / "c" / "step_00000002"),
    }  # fmt: skip
    assert ckpt.is_complete(tmp_path / "c" / "step_00000002")


def test_a_second_signal_ends_the_process_at_once(tmp_path: Path) -> None:
    # The stopping module alone (no torch import), in a child process that signals itself.
    module = Path(ckpt.__file__).parent.parent / "stopping.py"
    script = f"""
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("stopping", {str(module)!r})
stopping = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stopping)
with stopping.StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    while not stop.requested:
        time.sleep(0.01)
    print("first:", stop.signal_name, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
print("not reached", flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout == "first: SIGTERM\n", done.stderr
    assert done.returncode == -signal.SIGINT


def test_stop_request_outside_a_signal() -> None:
    stop = StopRequest()
    assert not stop.requested
    stop.request("SIGINT")
    stop.request("SIGTERM")
    assert stop.signal_name == "SIGINT"  # the first one counts


def test_init_from_loads_weights_only(base: TrainConfig, tmp_path: Path) -> None:
    source = run(replace(base, steps=2, checkpoint_dir=str(tmp_path / "src")))
    path = Path(source["checkpoint"])
    want = _as_dict(path, tmp_path)["model"]
    trainer = Trainer(replace(base, steps=2, init_from=str(path)))
    try:
        got = trainer.model.state_dict()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        assert trainer.start_step == 0 and trainer.resumed_from is None
        assert len(trainer.optimizer.state) == 0  # the optimizer starts fresh
        assert trainer.scheduler.last_epoch == 0
    finally:
        trainer.close()


def test_init_from_and_a_found_checkpoint_is_an_error(
    base: TrainConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = run(replace(base, steps=2, checkpoint_dir=str(tmp_path / "src")))
    capsys.readouterr()
    argv = ["--model", "tiny", "--seq-len", "32", "--steps", "3", "--threads", "1"]
    argv += ["--cache-dir", base.cache_dir or "", "--progress", "plain", "--eval-every", "0"]
    argv += ["--checkpoint-dir", str(tmp_path / "src"), "--init-from", source["checkpoint"]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--resume auto found checkpoint" in err and "--resume never" in err, err
    # With --resume never it starts from the weights.
    assert main([*argv, "--resume", "never", "--optimizer", "adamw"]) == 0


def test_resume_with_another_optimizer_or_past_the_end_is_an_error(
    base: TrainConfig, tmp_path: Path
) -> None:
    cfg = replace(base, steps=2, checkpoint_dir=str(tmp_path))
    run(cfg)
    with pytest.raises(ValueError, match=r"written with --optimizer adamw.*--init-from"):
        Trainer(replace(cfg, optimizer="dmuon"))
    with pytest.raises(ValueError, match="at step 2, past --steps 1"):
        Trainer(replace(cfg, steps=1))
    muon = replace(cfg, optimizer="dmuon", checkpoint_dir=str(tmp_path / "muon"))
    run(muon)
    with pytest.raises(ValueError, match=r"written with --muon-variant muon.*--init-from"):
        Trainer(replace(muon, muon_variant="normuon"))


def test_truncate_after_keeps_earlier_lines_and_events(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [{"step": 0}, {"step": 1}, {"event": "stopped", "step": 1}, {"step": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert truncate_after(path, 1) == 2
    assert _lines(path) == rows[:3]
    assert truncate_after(path, 1) == 0
    assert truncate_after(tmp_path / "missing.jsonl", 1) == 0


@pytest.mark.parametrize(
    ("make", "argv", "message"),
    [
        (None, ["--resume", "{d}/nope"], "argument --resume: {d}/nope: no such directory"),
        ("folder", ["--resume", "{d}"], "it is a checkpoint folder; pass one of its"),
        ("tmp", ["--resume", "{d}/.tmp_step_00000002"], "a save that did not finish"),
        (None, ["--resume", "{d}"], "no complete checkpoint"),
        (None, ["--init-from", "{d}/nope"], "argument --init-from: {d}/nope: no such"),
        (None, ["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (None, ["--keep-checkpoints", "-1"], "--keep-checkpoints: must be >= 0"),
        ("folder", ["--resume", "{d}/step_00000002", "--init-from", "{d}/step_00000002"],
         "--init-from and --resume PATH both give a starting point"),
    ],
)  # fmt: skip
def test_bad_checkpoint_flags_are_clear_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: str | None,
    argv: list[str],
    message: str,
) -> None:
    if make == "folder":
        _fake_checkpoint(tmp_path / "step_00000002")
    elif make == "tmp":
        _fake_checkpoint(tmp_path / ".tmp_step_00000002")
    with pytest.raises(SystemExit) as exc:
        parse_args([a.format(d=tmp_path) for a in argv])
    assert exc.value.code == 2
    assert message.format(d=tmp_path) in capsys.readouterr().err


def test_checkpoint_flags_map_to_the_config(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path / "step_00000001")
    cfg = parse_args(["--checkpoint-dir", "c", "--checkpoint-every", "5",
                      "--keep-checkpoints", "0", "--resume", str(path)])  # fmt: skip
    assert (cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_checkpoints) == ("c", 5, 0)
    assert cfg.resume == str(path)
    assert parse_args(["--init-from", str(path)]).init_from == str(path)
    defaults = TrainConfig()
    assert (defaults.resume, defaults.keep_checkpoints, defaults.checkpoint_every) == (
        "auto",
        3,
        0,
    )
