"""Start-up of the programs DMuon ships (the recipe's ranks, the job service's processes).

Importing torch creates about 250,000 objects that the cyclic garbage collector tracks,
and ``torch._dynamo``, which torch's optimizers import on first use, 200,000 more. While
they are created the collector runs full collections over them, and every full collection
afterwards scans them again, although they live as long as the process. For a short recipe run that
is two fifths of the process's CPU time, paid by every rank of every launch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_kept_for_life() -> Iterator[None]:
    """Run the block (a program's imports) with the cyclic garbage collector paused, then
    move every object alive at its end out of the collector's reach (`gc.freeze`).

    Only for a process's own entry point: what exists when the block ends is never
    collected afterwards (reference counting still frees it), so the block must create
    only what the process keeps: modules, their classes and functions. The few cyclic
    leftovers of the imports themselves stay too (a few MiB), which costs less than the
    full collection that would free them. The collector is left enabled only if it was.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
