"""Learning-rate schedules of the recipe: the multiplier of the peak rate at each step.

Every schedule warms up linearly over ``warmup_steps`` (``(i + 1) / warmup_steps`` for the
``i``-th optimizer step, counted from 0 as ``LambdaLR`` counts), then:

* ``cosine``: half a cosine from 1 down to ``min_ratio`` over the remaining steps;
* ``linear``: a straight line from 1 down to ``min_ratio`` over the remaining steps;
* ``constant``: 1 until the end;
* ``wsd`` (warmup, stable, decay; the trapezoid Muon runs often use): 1 until the final
  ``decay_fraction`` of all steps, then a straight line down to ``min_ratio``.

The last step of a decaying schedule runs at ``min_ratio`` times the peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: The schedules ``--lr-schedule`` takes.
SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_factor(
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float,
    decay_fraction: float = 0.2,
) -> Callable[[int], float]:
    """The multiplier of the peak rate for optimizer step ``i`` (0-based), for ``LambdaLR``.

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; one of {SCHEDULES}")
    decay_start = warmup_steps
    if schedule == "wsd":
        decay_start = max(warmup_steps, total_steps - math.ceil(decay_fraction * total_steps))

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        if schedule == "constant" or i < decay_start:
            return 1.0
        t = min(1.0, (i - decay_start) / max(1, total_steps - decay_start - 1))
        if schedule == "cosine":
            return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0 - (1.0 - min_ratio) * t

    return factor


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier for ``LambdaLR``: linear warmup, then cosine decay to ``min_ratio`` (the
    default ``--lr-schedule``; see `dmuon.train.schedules`)."""
    return lr_factor("cosine", warmup_steps, total_steps, min_ratio)
