"""Argument types shared by the benchmark scripts: a count of 0 (or less) is refused at the
command line, with the flag named, instead of failing later inside a run."""

from __future__ import annotations

import argparse


def _int_at_least(lowest: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{value} is less than {lowest}")
    return value


def positive_int(text: str) -> int:
    """A whole number of at least 1 (steps, rounds, ranks, micro-batches...)."""
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    """A whole number of at least 0 (warm-up rounds or steps)."""
    return _int_at_least(0, text)
