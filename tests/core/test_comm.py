"""`dmuon._comm.Pending`: a finished work handle stays referenced for a few collectives.

Oracle: object lifetimes observed through weak references. gloo's worker thread still
holds a work for a moment after ``wait()`` returns; the handle must not be released by
Python first, or the worker frees the work's tensors and needs the GIL to do it, which
aborts the process when it happens during interpreter teardown.

And the IEEE signed-zero behaviour of gloo's sums that the ownership runtime uses to tell
"no rank had a gradient" (all ``-0.0``) from "a gradient of zeros" (``+0.0``), on 3 ranks.
"""

from __future__ import annotations

import gc
import weakref
from collections import deque

from dmuon._comm_pending import RECENT_WORK_KEPT, Pending


class _Work:
    """Stands in for a ``torch.distributed.Work``: records that it was waited on."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_waited_work_outlives_its_handle_for_the_next_collectives() -> None:
    recent: deque[_Work] = deque(maxlen=RECENT_WORK_KEPT)
    first = _Work()
    alive = weakref.ref(first)
    pending = Pending(first, recent)  # type: ignore[arg-type]
    pending.wait()
    assert first.waited
    del first, pending
    gc.collect()
    assert alive() is not None  # still referenced after the handle is gone
    for _ in range(RECENT_WORK_KEPT - 1):
        Pending(_Work(), recent).wait()  # type: ignore[arg-type]
    gc.collect()
    assert alive() is not None
    Pending(_Work(), recent).wait()  # type: ignore[arg-type]
    gc.collect()
    assert alive() is None  # released by Python once RECENT_WORK_KEPT newer ones finished
    assert len(recent) == RECENT_WORK_KEPT


def test_waiting_twice_or_without_work_is_harmless() -> None:
    recent: deque[_Work] = deque(maxlen=RECENT_WORK_KEPT)
    pending = Pending(_Work(), recent)  # type: ignore[arg-type]
    pending.wait()
    pending.wait()
    Pending().wait()
    assert len(recent) == 1


def _signed_zero_sums(rank: int, world: int) -> dict[str, bool]:
    """What DMuon's "no rank had a gradient" signal rests on, on this backend."""
    import torch
    import torch.distributed as dist

    every = torch.full((1 << 16,), -0.0)
    reduced = every.clone()
    dist.reduce(reduced, 0)
    all_reduced = every.clone()
    dist.all_reduce(all_reduced)
    # One rank with a gradient of zeros (+0.0) among ranks without one (-0.0).
    mixed = torch.full((1 << 16,), 0.0 if rank == world - 1 else -0.0)
    dist.reduce(mixed, 0)
    return {
        "reduce": bool(torch.signbit(reduced).all()) if rank == 0 else True,
        "all_reduce": bool(torch.signbit(all_reduced).all()),
        "mixed": not bool(torch.signbit(mixed).any()) if rank == 0 else True,
        "divided": bool(torch.signbit(reduced / world).all()) if rank == 0 else True,
        "plus_zero_clears": not bool(torch.signbit(torch.add(every, 0.0)).any()),
    }


def test_gloo_sums_keep_negative_zero_only_when_every_term_is_negative_zero() -> None:
    from dist_harness import spawn_ranks

    for rank, result in enumerate(spawn_ranks(3, _signed_zero_sums)):
        assert all(result.values()), f"rank {rank}: {result}"
