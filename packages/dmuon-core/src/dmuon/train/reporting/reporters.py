"""Where the recipe reports: the metrics file, the console and the experiment trackers,
behind one object.

`Reporting` takes each metrics line (``write``), text such as samples (``text``) and the
exported model folder (``artifact``) and hands them to every reporter: the metrics file
(`MetricsWriter`), the progress display (`ProgressReporter`) and every tracker of
``--report-to`` (`dmuon.train.reporting.trackers`), each of which implements ``write(record)``
(trackers also ``text`` and ``artifact``). Only rank 0 has trackers. A tracker that fails
to start or later (a tracking server that went away) is reported once on stderr and
dropped, so that a tracking problem never ends the training run (nor leaves the other
ranks waiting for rank 0); the metrics file stays the record.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dmuon.train import config_file
from dmuon.train.cli import TrainConfig
from dmuon.train.reporting.console import ProgressReporter
from dmuon.train.reporting.metrics_file import MetricsWriter
from dmuon.train.reporting.trackers import Tracker, open_trackers, resolve_report_to

__all__ = ["DEFAULT_TRACKING_DIR", "Reporting", "default_run_name"]

#: ``--tracking-dir`` when not given, relative to the working directory.
DEFAULT_TRACKING_DIR = "runs"


def default_run_name(config: TrainConfig) -> str:
    """``--run-name`` when not given: the model's name, the optimizer and the start time."""
    model = Path(config.model).name or config.model
    return f"{model}-{config.optimizer}-{time.strftime('%Y%m%d-%H%M%S')}"


class Reporting:
    """The metrics file and the trackers of one run (rank 0), fed the same lines."""

    def __init__(
        self,
        writer: MetricsWriter,
        trackers: list[Tracker],
        progress: ProgressReporter | None = None,
    ) -> None:
        """Report to ``writer``, ``progress`` and ``trackers``."""
        self.writer = writer
        self.progress = progress
        self.trackers = list(trackers)

    @classmethod
    def open(
        cls,
        config: TrainConfig,
        *,
        is_main: bool,
        resume: Mapping[str, Mapping[str, str]] | None,
        start_step: int,
        progress: ProgressReporter | None = None,
    ) -> Reporting:
        """The metrics file (rank 0) and, on rank 0, a run in each tracker of
        ``config.report_to``: new, or continued from ``resume``'s ids."""
        writer = MetricsWriter(config.metrics_file if is_main else None)
        if is_main and config.metrics_file:
            metrics = Path(config.metrics_file)
            resolved = metrics.with_name(f"{metrics.stem}.config.toml")
            resolved.write_text(config_file.dump(config), encoding="utf-8")
        names = resolve_report_to(config.report_to) if is_main else ()
        trackers = open_trackers(
            names,
            Path(config.tracking_dir or DEFAULT_TRACKING_DIR),
            config.run_name or default_run_name(config),
            asdict(config),
            resume or {},
            start_step,
        )
        return cls(writer, trackers, progress)

    def ids(self) -> dict[str, dict[str, str]] | None:
        """Each tracker's run ids, for the checkpoint (``None`` without trackers)."""
        return {t.name: t.ids() for t in self.trackers} or None

    def write(self, record: Mapping[str, Any]) -> None:
        """One metrics line, to the file, the console and every tracker."""
        self.writer.write(dict(record))
        if self.progress is not None:
            self.progress.write(record)
        self._each("write", record)

    def text(self, step: int, key: str, text: str) -> None:
        """Text at ``step`` (the metrics file gets it as a line of its own elsewhere)."""
        self._each("text", step, key, text)

    def artifact(self, path: Path, name: str) -> None:
        """A folder kept with the trackers' runs that keep artifacts."""
        self._each("artifact", path, name)

    def close(self) -> None:
        """Close the file and end the trackers' runs."""
        self.writer.close()
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # a tracker must not end the run: drop it, say so
                print(
                    f"dmuon.train: {tracker.name} failed ({type(error).__name__}: {error}); "
                    "no longer reporting to it (the metrics file still has every step)",
                    file=sys.stderr,
                )
                self.trackers.remove(tracker)
