"""``--report-to``: the recipe's runs read back through each tracker's own reader.

Oracle: the run's metrics file. TensorBoard's event files through TensorBoard's
``EventAccumulator``; MLflow's SQLite store through ``mlflow.search_runs`` and
``MlflowClient``; Weights & Biases offline run files (``WANDB_MODE=offline``) through a
reader of their record log written here. Each holds every step and metric once, with the
values of the metrics file, also across a resume from an earlier checkpoint (the same
tracker run, no step twice).
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from dmuon.train import TrainConfig, parse_args, run

# Found, not imported: each tracker is imported by the test that reads it (mlflow takes
# 1.6 s, which every pytest worker would pay at collection).
_MISSING = [name for name in ("tensorboard", "mlflow", "wandb") if find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {_MISSING}")


@pytest.fixture
def base(cache_dir: str, tmp_path: Path) -> TrainConfig:
    return TrainConfig(
        model="tiny", seq_len=32, micro_batch_size=2, steps=4, eval_every=2, eval_sequences=4,
        warmup_steps=1, lr_schedule="constant", progress="plain", log_every=100,
        cache_dir=cache_dir, threads=1,
        tracking_dir=str(tmp_path / "runs"), run_name="tiny-run",
        metrics_file=str(tmp_path / "metrics.jsonl"), checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=2, keep_checkpoints=0,
    )  # fmt: skip


def metric_lines(cfg: TrainConfig) -> dict[int, dict[str, Any]]:
    lines = [json.loads(x) for x in Path(cfg.metrics_file).read_text().splitlines()]
    return {r["step"]: r for r in lines if "event" not in r}


def expected_series(cfg: TrainConfig) -> dict[str, dict[int, float]]:
    """``{key: {step: value}}`` of the metrics file's numbers, lists as ``key/rank``."""
    series: dict[str, dict[int, float]] = {}
    for step, record in metric_lines(cfg).items():
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for index, item in items:
                name = key if index is None else f"{key}/{index}"
                series.setdefault(name, {})[step] = float(item)
    return series


#: Metrics that a rerun of a step reproduces exactly (the others are timings and memory).
DETERMINISTIC = {"loss", "lr", "adamw_lr", "grad_norm", "val_loss"}


def resume_from_step_2(cfg: TrainConfig) -> TrainConfig:
    """The run again from its step-2 checkpoint, one step further: steps 3 and 4 were
    reported already by the first attempt (the schedule is constant: the rate of a step
    does not depend on --steps)."""
    return replace(cfg, resume=str(Path(cfg.checkpoint_dir) / "step_00000002"), steps=5)


def test_tensorboard_events_hold_every_step_once(base: TrainConfig, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = replace(base, report_to="tensorboard", sample_every=2, sample_tokens=4)
    run(cfg)
    run(resume_from_step_2(cfg))
    folders = list((tmp_path / "runs" / "tensorboard").iterdir())
    assert [f.name for f in folders] == ["tiny-run"]  # the resumed run writes to the same one
    events = EventAccumulator(str(folders[0]), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected = expected_series(cfg)
    # Both rates: Muon's as lr, AdamW's (embeddings, norms, head) under the same schedule.
    lines = metric_lines(resume_from_step_2(cfg))
    for step in range(1, 6):
        ratio = lines[step]["adamw_lr"] / lines[step]["lr"]
        assert ratio == pytest.approx(cfg.adamw_rate / cfg.lr), step
    assert "adamw_lr" in expected
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, values in expected.items():
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == sorted(values), tag  # each step once, in order
        assert [v for _, v in logged] == pytest.approx(
            [values[s] for s in sorted(values)], rel=1e-6
        )
    assert {"config/text_summary", "sample/text_summary"} <= set(events.Tags()["tensors"])
    samples = {e.step for e in events.Tensors("sample/text_summary")}
    assert samples == {2, 4, 5}  # every second step and the last, each once


def test_mlflow_run_continues_after_resume_with_every_step_once(
    base: TrainConfig, tmp_path: Path
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    cfg = replace(base, report_to="mlflow", export_hf=str(tmp_path / "export"))
    run(replace(cfg, export_hf=None))
    run(resume_from_step_2(cfg))
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["dmuon"], output_format="list")
    assert [r.info.run_name for r in runs] == ["tiny-run"]  # one run, continued
    client = MlflowClient(uri)
    run_id = runs[0].info.run_id
    for key, values in expected_series(cfg).items():
        history = dict(sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)))
        assert list(history) == sorted(values), key  # each step once
        # Steps 3 and 4 keep the first attempt's values: the same but for timings.
        same = (
            values if key in DETERMINISTIC else {s: v for s, v in values.items() if s not in (3, 4)}
        )
        assert {s: history[s] for s in same} == pytest.approx(same), key
    params = runs[0].data.params
    assert params["model"] == "tiny" and float(params["lr"]) == cfg.lr
    artifacts = {a.path for a in client.list_artifacts(run_id, "model")}
    assert "model/config.json" in artifacts and runs[0].info.status == "FINISHED"


# ----- Weights & Biases: its offline record log, read here -----------------------------------
_BLOCK = 32768
_HEADER = 7  # ":W&B", magic 0xBEE1, version


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` file: 32 KiB blocks of chunks, each a CRC,
    a length and a type (full, first, middle, last), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", _HEADER
    while offset + 7 <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < 7:  # the block's tail is padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0 and length == 0:
            offset += room
            continue
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_holds_the_metrics_and_config(
    base: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "dmuon-tests")
    cfg = replace(base, report_to="wandb")
    import wandb

    try:
        run(cfg)
    finally:
        # The run started W&B's service process; end it here, not in an exit handler
        # after the suite has ended every process its tests started.
        wandb.teardown()
    files = list((tmp_path / "runs").rglob("*.wandb"))
    assert len(files) == 1
    records = wandb_records(files[0])
    logged: dict[str, dict[int, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
        }
        step = int(items.pop("_step"))
        for key, value in items.items():
            if not key.startswith("_"):
                logged.setdefault(key, {})[step] = value
    expected = expected_series(cfg)
    assert set(logged) == set(expected)
    for key, values in expected.items():
        assert logged[key] == pytest.approx(values), key
    run_records = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_records[0].project == "dmuon-tests" and run_records[0].display_name == "tiny-run"
    config = {u.key: json.loads(u.value_json) for u in run_records[0].config.update}
    assert config["model"] == "tiny" and config["lr"] == cfg.lr


# ----- errors --------------------------------------------------------------------------------
def test_a_tracker_that_is_not_installed_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(SystemExit):
        parse_args(["--report-to", "tensorboard,mlflow"])
    err = capsys.readouterr().err
    assert "mlflow is not installed: pip install mlflow" in err
    assert "pip install -e 'packages/dmuon-core[tracking]'" in err
    assert parse_args(["--report-to", "all"]).report_to == "all"  # all: whatever is installed


def test_a_failing_tracker_is_dropped_and_training_goes_on(
    base: TrainConfig, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dmuon.train.reporting import trackers

    def broken(self: Any, record: Any) -> None:
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(trackers.MlflowTracker, "write", broken)
    summary = run(replace(base, report_to="mlflow"))
    assert summary["steps"] == 4 and sorted(metric_lines(base)) == [0, 1, 2, 3, 4]
    assert "mlflow failed (ConnectionError: tracking server went away)" in capsys.readouterr().err


def test_a_tracker_that_cannot_start_is_left_out(
    base: TrainConfig, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tracking server that cannot be reached at start-up.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    summary = run(replace(base, report_to="mlflow,tensorboard"))
    assert summary["steps"] == 4 and sorted(metric_lines(base)) == [0, 1, 2, 3, 4]
    assert "mlflow could not start" in capsys.readouterr().err
    assert list((Path(base.tracking_dir) / "tensorboard").iterdir())  # the other one ran
