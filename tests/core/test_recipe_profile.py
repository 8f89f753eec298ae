"""``--profile-steps A:B``: a torch.profiler trace of the steps asked for.

Oracle: the trace file itself, read back as JSON (Chrome's trace format, which TensorBoard's
profiler and Perfetto open): it holds the step's operators, and the run's metrics are
those of a run without the profiler.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dmuon.train import TrainConfig, parse_args, run


def test_a_profiled_run_leaves_a_trace_of_its_steps(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace holds the steps' operators, and the run prints where it went, its size
    and what opens it."""
    base = TrainConfig(
        model="tiny", seq_len=32, micro_batch_size=2, steps=3, eval_every=0,
        progress="plain", cache_dir=cache_dir, threads=1, tracking_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    plain = run(replace(base, metrics_file=str(tmp_path / "plain.jsonl")))
    profiled = run(
        replace(base, profile_steps="2:3", metrics_file=str(tmp_path / "profiled.jsonl"))
    )
    trace = tmp_path / "runs" / "tensorboard" / "profile" / "step_2-3" / "rank0.pt.trace.json"
    size = trace.stat().st_size / 2**20
    assert (
        f"profiler: steps 2-3 traced to {trace} ({size:.1f} MiB on this rank; every rank "
        f"writes its own): open it in ui.perfetto.dev, or run tensorboard --logdir "
        f"{tmp_path / 'runs' / 'tensorboard'} and choose the profile run"
    ) in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::mm") for n in names) and len(events) > 100
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("plain", "profiled")
    ]
    assert losses[0] == losses[1]  # recording changes nothing of the run
    assert plain["steps"] == profiled["steps"] == 3


@pytest.mark.parametrize("given", ["3:2", "0:1", "2", "a:b"])
def test_a_range_that_is_no_range_is_refused(
    capsys: pytest.CaptureFixture[str], given: str
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--profile-steps", given])
    assert "argument --profile-steps" in capsys.readouterr().err


def test_a_memory_snapshot_on_cpu_gives_each_phase_s_peak(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--memory-snapshot`` without ``--profile-steps`` records step 1: the optimizer step
    creates the optimizer's state there (a float32 momentum per Muon element, two moments
    per AdamW one), so its peak holds at least 4 bytes per parameter; the run's losses are
    those of a run without it."""
    from dmuon.train.models import build_model

    base = TrainConfig(
        model="tiny", seq_len=32, micro_batch_size=2, steps=2, eval_every=0,
        progress="plain", cache_dir=cache_dir, threads=1, tracking_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    run(replace(base, metrics_file=str(tmp_path / "plain.jsonl")))
    capsys.readouterr()
    run(replace(base, memory_snapshot=True, metrics_file=str(tmp_path / "snapshot.jsonl")))
    written = tmp_path / "runs" / "memory" / "step_1-1" / "rank0.json"
    assert f"memory snapshot written to {written} (JSON: the peak bytes of each phase)" in (
        capsys.readouterr().out
    )
    record = json.loads(written.read_text())
    assert record["steps"] == [1, 1] and record["rank"] == 0
    peaks = record["peak_bytes"]
    parameters = sum(p.numel() for p in build_model("tiny").parameters())
    assert peaks["optimizer_step"] >= 4 * parameters
    assert peaks["forward_backward"] > 0
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("plain", "snapshot")
    ]
    assert losses[0] == losses[1]
