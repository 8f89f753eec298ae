"""The recipe's metrics file (rank 0 only); the console's progress is in
`dmuon.train.reporting.console`.

Metrics file format (``--metrics-file``, the only channel the job server reads): one JSON
object per line, appended and flushed line by line.

* One line per optimizer step ``s >= 1`` with the keys ``step`` (int), ``loss`` (mean
  training loss over the global batch), ``lr`` (the scheduled rate used for this step:
  the Muon rate ``--lr`` under dmuon, ``--adamw-lr`` under the adamw baseline),
  ``adamw_lr`` (under dmuon only: AdamW's scheduled rate, for the embeddings, norms and
  head),
  ``tokens_per_s`` (global tokens of the step / its wall time), ``grad_norm`` (global L2
  norm of the gradient before the update), ``time`` (seconds since training started,
  after setup), ``peak_memory_bytes`` (a list: each rank's peak memory so far, index =
  rank; CUDA's allocator peak, or the process's peak resident set on CPU), ``mfu``
  (model FLOPs utilization, only where a peak is known: ``--peak-tflops``, or a known
  CUDA device in bfloat16), and on evaluation steps also ``val_loss``.
* When evaluation is on (``--eval-every`` > 0), one extra line **before** the first step:
  ``{"step": 0, "loss": null, "lr": null, "tokens_per_s": null, "grad_norm": null,
  "time": ..., "val_loss": ...}`` carrying the validation loss of the initial weights.
  Every line therefore has all the keys; only the step-0 line has nulls.

* On a graceful stop (SIGTERM or SIGINT), one last line
  ``{"event": "stopped", "step": k, "signal": "SIGTERM", "checkpoint": "<path or null>"}``
  with the other required keys null. Lines with an ``event`` key are not metric points.
* A run resumed from the checkpoint of step ``k`` first drops the lines with a step above
  ``k`` (`truncate_after`), then appends from step ``k + 1``: the file never holds a step
  twice.

Non-finite floats (a diverged run) are written as the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"``, so every line stays strict JSON and a diverged value is told apart
from a missing one (``null``). The job server uses the same strings in its API.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import dmuon_recipe_contract as contract

__all__ = [
    "REQUIRED_KEYS",
    "MetricsWriter",
    "point_step",
    "truncate_after",
]

REQUIRED_KEYS = contract.METRIC_KEYS
"""Keys present on every line of the metrics file (`dmuon_recipe_contract.METRIC_KEYS`)."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    return value


def truncate_after(path: str | os.PathLike[str], step: int) -> int:
    """Drop the lines of metrics file ``path`` whose step is above ``step``; return the count.

    Lines that are not JSON objects with an integer ``step`` (a line cut short by a killed
    process) are dropped too. The file is rewritten to a temporary file and swapped in with
    ``os.replace``, so a crash leaves the old or the new file, never a mix. A missing file
    is left missing.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and isinstance(record.get("step"), int)
            keep = keep and record["step"] <= step
        except json.JSONDecodeError:
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class MetricsWriter:
    """Append one JSON object per call to a file, flushing each line.

    A writer created with ``path=None`` (non-zero ranks, or no ``--metrics-file``) does
    nothing.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        """Open ``path`` for appending (creating parent folders), or do nothing if None."""
        self.path = Path(path) if path is not None else None
        self._handle: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one line; missing required keys are filled with null."""
        if self._handle is None:
            return
        line = {key: None for key in REQUIRED_KEYS}
        line.update({key: _clean(value) for key, value in record.items()})
        self._handle.write(json.dumps(line, allow_nan=False) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def point_step(record: Mapping[str, Any]) -> int | None:
    """The step of a metrics line that is a metric point; ``None`` for an event line."""
    step = record.get("step")
    if contract.EVENT_KEY in record or isinstance(step, bool) or not isinstance(step, int):
        return None
    return step
