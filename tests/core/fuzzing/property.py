"""The property, for hypothesis: every generated case matches the oracle.

`check_cases` runs hypothesis over `cases()` with a seed and an example budget, on rank
pools kept for the whole run. Hypothesis shrinks a failing case (fewer layers, smaller
worlds, simpler layouts, fewer steps...) and reports the smallest one it found; its
``repr`` is the line to paste into the regression list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from fuzzing.cases import Case, cases
from fuzzing.pool import Pools
from fuzzing.runner import assert_case


@dataclass
class Tally:
    """What a hypothesis run did."""

    ran: int = 0
    failed: int = 0
    seconds: float = 0.0
    counterexamples: list[str] = field(default_factory=list)


def check_cases(
    pools: Pools,
    *,
    max_examples: int,
    seed: int,
    stop_at: float | None = None,
    on_case: Callable[[int, Case, float, bool], None] | None = None,
    shrink: bool = True,
) -> Tally:
    """Run the property on ``max_examples`` generated cases; return the tally.

    ``stop_at`` (a ``time.monotonic()`` value) makes the remaining examples pass without
    running, so a time budget ends the run. ``on_case(number, case, seconds, ok)`` sees
    every case run, shrinking attempts included. A failure is raised after shrinking,
    with the shrunk case first in its message.
    """
    tally = Tally()
    phases = [Phase.generate] + ([Phase.shrink] if shrink else [])

    @hypothesis_seed(seed)
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=cases())
    def every_case_matches_the_oracle(case: Case) -> None:
        if stop_at is not None and time.monotonic() > stop_at:
            return
        start = time.monotonic()
        ok = False
        try:
            assert_case(pools, case)
            ok = True
        finally:
            elapsed = time.monotonic() - start
            tally.ran += 1
            tally.failed += not ok
            tally.seconds += elapsed
            if on_case is not None:
                on_case(tally.ran, case, elapsed, ok)

    every_case_matches_the_oracle()
    return tally
