"""Memory per rank of one contender: its peak tensor bytes, and DMuon's packed buffers.

Peak: on CPU, torch.profiler's memory events (every allocation and free of torch's CPU
allocator, with its size) are recorded from the moment the contender is built, through a
first step (which creates the optimizer state) and a second, steady-state step. Summing
the events in time order gives the tensor bytes the contender holds at every instant; the
peak is the largest sum during the second step. Everything it holds was allocated inside
the recording, so nothing is missed at the start, and other contenders' tensors are not
counted. Not counted: memory outside torch's allocator (gloo's own buffers, Python
objects, the allocator's slack). On CUDA, ``torch.cuda.max_memory_allocated`` during the
second step minus ``memory_allocated`` before the build gives the same quantity.

Dedicated bytes after forward: the storage of every packed buffer of DMuon's ownership
runtime (``FlatBuffer.buffer``) that is allocated when the forward has returned and the
backward has not begun, next to the formula of docs/z2-vs-z3.md: Z2 keeps every full
matrix, P_M x b bytes (b: bytes per element of the broadcast dtype); Z3 frees each hook
boundary's buffers when its forward ends, so 0.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_WINDOW = "dmuon-bench:measured-step"


class PeakTensorMemory:
    """Context manager: the peak tensor bytes held inside its `window`, counted from entry."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak: int | None = None
        self._profiler: Any = None
        self._base = 0

    def __enter__(self) -> PeakTensorMemory:
        if self.cuda:
            # Free what earlier contenders left in reference cycles first: freed during the
            # window, it would be subtracted from this contender's peak.
            gc.collect()
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
        else:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    @contextmanager
    def window(self) -> Iterator[None]:
        """The span whose peak is reported (the steady-state step)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
            return
        with record_function(_WINDOW):
            yield

    def __exit__(self, *exc: object) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.peak = peak_in_window(self._profiler.profiler.kineto_results.events())


def peak_in_window(events: Any) -> int:
    """Largest running sum of the CPU allocator's events inside the marked window.

    The running sum starts at the first recorded event, so it is the bytes allocated since
    recording began and not yet freed; frees of blocks allocated before the recording are
    not reported by the profiler and do not lower it.
    """
    window = [e for e in events if e.name() == _WINDOW]
    if len(window) != 1:
        raise RuntimeError(f"expected one {_WINDOW!r} span in the profile, got {len(window)}")
    return span_memory(cpu_memory_events(events), window[0].start_ns(), window[0].end_ns())[1]


def cpu_memory_events(events: Any) -> list[tuple[int, int]]:
    """``(time in ns, bytes)`` of the CPU allocator's events (a free is negative), in time
    order."""
    return sorted((e.start_ns(), e.nbytes()) for e in events if _is_cpu_memory(e))


def span_memory(memory: list[tuple[int, int]], start: int, end: int) -> tuple[int, int, int]:
    """Bytes alive before ``start``, the peak inside ``[start, end]`` and the bytes alive
    at ``end``, as running sums of ``memory`` (`cpu_memory_events`) from its first event."""
    live = sum(nbytes for when, nbytes in memory if when < start)
    before = peak = live
    for when, nbytes in memory:
        if start <= when <= end:
            live += nbytes
            peak = max(peak, live)
    return before, peak, live


def _is_cpu_memory(event: Any) -> bool:
    return event.name() == "[memory]" and str(event.device_type()).endswith("CPU")


def dedicated_bytes_held(model: Any) -> int | None:
    """Bytes of DMuon's packed buffers that hold storage now (``None``: not a DMuon model)."""
    from dmuon._ownership.dedication_state import get_dedication

    state = get_dedication(model)
    if state is None:
        return None
    return sum(group.buffer.untyped_storage().nbytes() for group in state.runtime.buffers())


def dedicated_bytes_formula(contender: str, p_m: int, element_size: int) -> int | None:
    """Bytes DMuon holds for dedicated matrices after forward, per rank (docs/z2-vs-z3.md).

    Z2 keeps every packed buffer resident: all P_M elements at ``element_size`` bytes. Z3
    frees each boundary's buffers at the end of its forward: 0.
    """
    if contender == "dmuon-z2":
        return p_m * element_size
    if contender == "dmuon-z3":
        return 0
    return None
