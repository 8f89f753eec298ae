"""``log_metrics``: the metrics file of the job service, written from your own script.

Under ``dmuon-server`` every process of a job finds ``DMUON_METRICS_FILE`` in its
environment; rank 0 appends one JSON line per call, in the format of the recipe's own
metrics file (:mod:`dmuon.train.reporting.metrics_file`), which is what the service streams to its
clients and draws in its dashboard. Outside the service (no ``DMUON_METRICS_FILE``), and
on every rank but 0, a call does nothing.
"""

from __future__ import annotations

import os
from numbers import Real
from typing import Any

from dmuon.train.reporting.metrics_file import MetricsWriter

__all__ = ["METRICS_FILE_ENV", "log_metrics"]

#: The environment variable naming the file (set by the job service for each attempt).
METRICS_FILE_ENV = "DMUON_METRICS_FILE"


def _number(key: str, value: Any) -> float | int:
    if hasattr(value, "item") and not isinstance(value, Real):  # a 0-d tensor or array
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"log_metrics({key}=...) takes a number (or a one-element tensor), not "
            f"{type(value).__name__}; log text with print() instead"
        )
    return value if isinstance(value, int) else float(value)


def log_metrics(step: int, **values: Any) -> None:
    """Record optimizer step ``step`` of your script for the job service (rank 0 only).

    ``values`` are numbers (Python numbers or one-element tensors): ``loss``, ``lr``,
    ``grad_norm``, ``tokens_per_s``, ``val_loss`` and ``time`` (seconds since training
    started) are the contract's keys; any other key is kept and shown as a series of its
    own. Non-finite values are written as ``"NaN"``/``"Infinity"``.

    Raises:
        TypeError: ``step`` is not a whole number, or a value is not a number.
        ValueError: ``step`` is negative.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"log_metrics(step) takes a whole number, not {type(step).__name__}")
    if step < 0:
        raise ValueError(f"log_metrics(step={step}): steps start at 0")
    record = {"step": step, **{k: _number(k, v) for k, v in values.items()}}
    path = os.environ.get(METRICS_FILE_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return
    writer = MetricsWriter(path)
    try:
        writer.write(record)
    finally:
        writer.close()
