"""Counting the device-to-host reads DMuon's own code makes.

Every ``Tensor.item`` and ``Tensor.tolist`` is a host synchronisation on a GPU; on CPU they
are counted instead of timed. `counted_host_reads` patches both for the duration of its
block and lists the calls made from inside the ``dmuon`` package (one entry each, naming
the file and line), leaving torch's and the test's own calls out.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import dmuon

_PACKAGE = str(Path(dmuon.__file__).parent)
_READS = ("item", "tolist")


@contextmanager
def counted_host_reads() -> Iterator[list[str]]:
    """The ``item``/``tolist`` calls DMuon's code makes inside the block, as they happen."""
    reads: list[str] = []

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = inspect.stack(context=0)[1]
            if caller.filename.startswith(_PACKAGE):
                reads.append(f"{name} in {Path(caller.filename).name}:{caller.lineno}")
            return original(self, *args, **kwargs)

        return read

    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(name, original))
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
