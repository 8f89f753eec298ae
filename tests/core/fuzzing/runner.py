"""Run a case on the rank pools and compare it with the oracle."""

from __future__ import annotations

import tempfile
from typing import Any

from fuzzing.cases import Case
from fuzzing.oracle import compare_bfloat16, compare_float32, compare_run
from fuzzing.pool import Pools
from fuzzing.worker import run_phase_in_dir


def check_case(pools: Pools, case: Case) -> list[str]:
    """Train ``case`` (its run, then its resume) and return what disagrees with the oracle."""
    results: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dmuon-fuzz-") as root:
        for which, phase, _ in case.phases():
            per_rank = pools[phase.world].run(run_phase_in_dir, case, which, root)
            problems = compare_run(case, which, per_rank)
            if problems:
                return problems
            results[which] = per_rank
    return compare_bfloat16(case, results) if case.bf16 else compare_float32(case, results)


class CaseFailed(AssertionError):
    """A case disagrees with the oracle."""


class RankRaised(CaseFailed):
    """A rank raised (or never finished)."""


class CollectivesDiffer(CaseFailed):
    """The ranks of a process group issued different collective sequences."""


class StateDiffers(CaseFailed):
    """The dedicated selection, or gradients left after ``zero_grad``."""


class ParametersDiffer(CaseFailed):
    """Trained parameters (or bfloat16 steps and gradients) disagree with the oracle."""


def assert_case(pools: Pools, case: Case) -> None:
    """Raise a `CaseFailed` with every disagreement of ``case``.

    Each kind of failure is its own exception class raised from its own line, so that
    hypothesis shrinks each kind separately instead of reporting only the simplest one.
    """
    problems = check_case(pools, case)
    if not problems:
        return
    message = f"{case!r}\n" + "\n".join(problems)
    if any(" raised:" in p for p in problems):
        raise RankRaised(message)
    if any(" group (" in p for p in problems):
        raise CollectivesDiffer(message)
    if any("dedicated" in p or "left after" in p for p in problems):
        raise StateDiffers(message)
    raise ParametersDiffer(message)
