"""Experiment trackers of the recipe: TensorBoard, MLflow and Weights & Biases.

``--report-to`` takes the names and the comma list Hugging Face's ``report_to`` takes:
``none`` (the default), ``all`` (every tracker installed) or any of ``tensorboard``,
``mlflow`` and ``wandb``. Rank 0 reports; each tracker gets:

* every numeric value of each metrics line, under its metrics-file key, at the line's
  step (a list such as ``peak_memory_bytes`` as ``key/0``, ``key/1``, ... by rank);
* the run's configuration (every flag) as hyperparameters;
* text (the samples) as text: TensorBoard's text plugin, an MLflow text artifact, a W&B
  table;
* the exported Hugging Face directory as an artifact, where the tracker keeps artifacts
  (MLflow and W&B).

Each tracker honours its usual environment variables (``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME``, ``WANDB_PROJECT``, ``WANDB_MODE``, ``WANDB_DIR``, ...).
``--tracking-dir`` is where what they keep locally goes: TensorBoard's event files, the
MLflow store when ``MLFLOW_TRACKING_URI`` is not set (SQLite, ``mlflow.db``), W&B's run
folders.

A resumed run continues the same tracker runs: their ids are in the checkpoint (the
`TrainState`'s ``trackers``), and steps a tracker already holds (logged after the
checkpoint by the attempt that died) are not logged twice: TensorBoard purges them when
it reads the files, MLflow and W&B skip them.

The trackers are optional (``pip install tensorboard mlflow wandb``, or from a checkout
``pip install -e 'packages/dmuon-core[tracking]'``); asking for one that is not
installed is an error at start-up naming the extra.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import dmuon_recipe_contract as contract

from dmuon.train.reporting.metrics_file import point_step

__all__ = [
    "EXTRA",
    "TRACKERS",
    "Tracker",
    "open_trackers",
    "resolve_report_to",
]

#: The trackers ``--report-to`` knows, and the package each needs.
TRACKERS: dict[str, str] = {name: name for name in contract.TRACKER_NAMES}
#: The extra that installs them all.
EXTRA = "tracking"
DEFAULT_EXPERIMENT = "dmuon"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKERS[name]) is not None


def resolve_report_to(value: str) -> tuple[str, ...]:
    """The trackers ``--report-to VALUE`` names, in the order given.

    Raises:
        ValueError: an unknown name, ``none`` or ``all`` mixed with names, or a tracker
            that is not installed (naming the extra that installs it).
    """
    names = [part.strip() for part in value.split(",") if part.strip()]
    if names in ([], ["none"]):
        return ()
    if names == ["all"]:
        return tuple(name for name in TRACKERS if _installed(name))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"unknown tracker {', '.join(unknown)}: choose from none, all, "
            f"{', '.join(TRACKERS)} (a comma-separated list)"
        )
    missing = [n for n in names if not _installed(n)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} is not installed: pip install "
            f"{' '.join(TRACKERS[n] for n in missing)} (or dmuon's {EXTRA} extra: from a "
            f"checkout, pip install -e 'packages/dmuon-core[{EXTRA}]')"
        )
    return tuple(dict.fromkeys(names))


class Tracker(Protocol):
    """What the recipe's reporting calls on each tracker (rank 0 only)."""

    name: str

    def write(self, record: Mapping[str, Any]) -> None:
        """Log the numbers of one metrics line (an event line is ignored)."""

    def text(self, step: int, key: str, text: str) -> None:
        """Log ``text`` under ``key`` at ``step``."""

    def artifact(self, path: Path, name: str) -> None:
        """Keep the folder ``path`` with the run, as ``name`` (where the tracker can)."""

    def ids(self) -> dict[str, str]:
        """What a resumed run needs to continue this tracker's run."""

    def close(self) -> None:
        """Flush and end the run."""


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line, lists flattened as ``key/index``; ``step`` left out."""
    values: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, list):
            for index, item in enumerate(value):
                if _number(item):
                    values[f"{key}/{index}"] = float(item)
        elif _number(value):
            values[key] = float(value)
    return values


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _flat_config(config: Mapping[str, Any]) -> dict[str, str]:
    return {
        key: json.dumps(value) if not isinstance(value, str) else value
        for key, value in config.items()
    }


class TensorBoardTracker:
    """Event files under ``DIR/tensorboard/RUN`` (torch's ``SummaryWriter``)."""

    name = "tensorboard"

    def __init__(
        self, directory: Path, run_name: str, config: Mapping[str, Any], resume: Mapping[str, str],
        start_step: int,
    ) -> None:  # fmt: skip
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = resume.get("logdir") or str(directory / "tensorboard" / run_name)
        # Steps after the checkpoint that an earlier attempt wrote are dropped by readers.
        purge = start_step + 1 if resume else None
        self.writer = SummaryWriter(log_dir=self.logdir, purge_step=purge)
        if not resume:
            table = "\n".join(f"| {k} | {v} |" for k, v in _flat_config(config).items())
            self.writer.add_text("config", "| flag | value |\n|---|---|\n" + table, 0)

    def write(self, record: Mapping[str, Any]) -> None:
        step = point_step(record)
        if step is None:
            return
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def text(self, step: int, key: str, text: str) -> None:
        self.writer.add_text(key, text, step)

    def artifact(self, path: Path, name: str) -> None:
        """TensorBoard keeps no artifacts."""

    def ids(self) -> dict[str, str]:
        return {"logdir": self.logdir}

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run, through ``MlflowClient`` (no global active run)."""

    name = "mlflow"

    def __init__(
        self, directory: Path, run_name: str, config: Mapping[str, Any], resume: Mapping[str, str],
        start_step: int,
    ) -> None:  # fmt: skip
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:  # a store of its own in the tracking folder, artifacts beside it
            directory.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(directory / 'mlflow.db').resolve()}"
            artifacts = (directory / "mlartifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        if resume.get("run_id"):
            self.run_id = resume["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            history = self.client.get_metric_history(self.run_id, "loss")
            self.logged_through = max((m.step for m in history), default=start_step)
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment, artifact_location=artifacts)
            )
            run = self.client.create_run(experiment_id, run_name=run_name)
            self.run_id = run.info.run_id
            self.logged_through = -1
            for key, value in _flat_config(config).items():
                self.client.log_param(self.run_id, key, value[:6000])
        self.experiment_id = self.client.get_run(self.run_id).info.experiment_id

    def write(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        step = point_step(record)
        if step is None or step <= self.logged_through:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def text(self, step: int, key: str, text: str) -> None:
        if step > self.logged_through:
            self.client.log_text(self.run_id, text, f"{key}/step_{step:08d}.txt")

    def artifact(self, path: Path, name: str) -> None:
        self.client.log_artifacts(self.run_id, str(path), name)

    def ids(self) -> dict[str, str]:
        return {
            "run_id": self.run_id,
            "experiment_id": self.experiment_id,
            "tracking_uri": self.uri,
        }

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """One Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk)."""

    name = "wandb"

    def __init__(
        self, directory: Path, run_name: str, config: Mapping[str, Any], resume: Mapping[str, str],
        start_step: int,
    ) -> None:  # fmt: skip
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_EXPERIMENT),
            name=run_name,
            id=resume.get("run_id") or None,
            resume="allow",
            dir=os.environ.get("WANDB_DIR", str(directory)),
            config=dict(config),
            reinit="create_new",
        )
        # Steps of an earlier attempt past the checkpoint: W&B keeps only increasing steps.
        self.logged_through = max(int(self.run.step) - 1, start_step) if resume else -1
        self.rows: list[list[Any]] = []

    def write(self, record: Mapping[str, Any]) -> None:
        step = point_step(record)
        if step is None or step <= self.logged_through:
            return
        values = {k: v for k, v in scalars(record).items() if math.isfinite(v)}
        self.run.log(values, step=step)

    def text(self, step: int, key: str, text: str) -> None:
        import wandb

        if step <= self.logged_through:
            return
        self.rows.append([step, text])
        self.run.log({key: wandb.Table(columns=["step", "text"], data=list(self.rows))}, step=step)

    def artifact(self, path: Path, name: str) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.id}-{name}", type="model")
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact)

    def ids(self) -> dict[str, str]:
        return {
            "run_id": self.run.id,
            "path": "/".join(self.run.path)
            if isinstance(self.run.path, list)
            else str(self.run.path),
        }

    def close(self) -> None:
        self.run.finish()


_KINDS: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}


def open_trackers(
    names: tuple[str, ...],
    directory: Path,
    run_name: str,
    config: Mapping[str, Any],
    resume: Mapping[str, Mapping[str, str]],
    start_step: int,
) -> list[Tracker]:
    """Start (or, with ``resume``'s ids, continue) a run in each tracker of ``names``; one
    that cannot start is reported on stderr and left out."""
    trackers: list[Tracker] = []
    for name in names:
        try:
            trackers.append(
                _KINDS[name](directory, run_name, config, resume.get(name, {}), start_step)
            )
        except Exception as error:  # a tracking server that is down must not stop training
            print(
                f"dmuon.train: {name} could not start ({type(error).__name__}: {error}); "
                "training goes on without it (the metrics file has every step)",
                file=sys.stderr,
            )
    return trackers
