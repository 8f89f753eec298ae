"""`dmuon.comm.Pending`: a finished work handle stays referenced for a few collectives.

Oracle: object lifetimes observed through weak references. gloo's worker thread still
holds a work for a moment after ``wait()`` returns; the handle must not be released by
Python first, or the worker frees the work's tensors and needs the GIL to do it, which
aborts the process when it happens during interpreter teardown.
"""

from __future__ import annotations

import gc
import weakref
from collections import deque

from dmuon.comm import RECENT_WORK_KEPT, Pending


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
