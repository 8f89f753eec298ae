"""Count what every collective moves, by intercepting torch.distributed itself.

No library's own accounting is used (DMuon's audit included): while a `TrafficCounter` is
active, the collectives of ``torch.distributed`` and of its functional collectives are
wrapped, and each call adds the elements it moves per rank on a ring, over (N-1)/N:

* broadcast, reduce, all-gather (output size), reduce-scatter (input size): 1 x elements;
* all-reduce: 2 x elements (a reduce-scatter plus an all-gather).

Dividing by P_M, the elements of the Muon-target matrices, gives the units of (N-1)/N x P_M
that DMuon's formula is stated in. Each call is attributed to ``"dmuon"`` when code of the
``dmuon`` package called it directly, and to ``"torch"`` (FSDP2, DTensor) otherwise.
"""

from __future__ import annotations

import inspect
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import dmuon

_DMUON_DIR = str(Path(dmuon.__file__).parent)


def _numel(t: Any) -> int:
    return int(t.numel()) if isinstance(t, torch.Tensor) else 0


def _world(group: Any) -> int:
    if group is None or isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group)
    if isinstance(group, tuple):  # (mesh, dim)
        return int(group[0].size(group[1]))
    if hasattr(group, "size"):
        return int(group.size())
    return dist.get_world_size()


# name -> (module, elements moved per rank for the call's arguments)
_OPS: dict[str, tuple[Any, Callable[..., int]]] = {
    "broadcast": (dist, lambda t, *a, **k: _numel(t)),
    "reduce": (dist, lambda t, *a, **k: _numel(t)),
    "all_reduce": (dist, lambda t, *a, **k: 2 * _numel(t)),
    "all_gather": (dist, lambda out, t, *a, **k: _numel(t) * len(out)),
    "all_gather_into_tensor": (dist, lambda out, t, *a, **k: _numel(out)),
    "all_gather_single": (dist, lambda out, t, *a, **k: _numel(out)),
    "reduce_scatter_tensor": (dist, lambda out, t, *a, **k: _numel(t)),
    "reduce_scatter_single": (dist, lambda out, t, *a, **k: _numel(t)),
}
_FUNCOL_OPS: dict[str, Callable[..., int]] = {
    "all_gather_tensor": lambda t, dim, group, *a, **k: _numel(t) * _world(group),
    "all_gather_single": lambda t, dim, group, *a, **k: _numel(t) * _world(group),
    "reduce_scatter_tensor": lambda t, *a, **k: _numel(t),
    "all_reduce": lambda t, *a, **k: 2 * _numel(t),
}


def _issuer() -> str:
    # The frame that called the collective decides: the dmuon library issues its own
    # collectives; FSDP2 and DTensor issue theirs from torch, even inside a dmuon model's
    # forward, so walking further up the stack would misattribute them.
    caller = sys._getframe(2)
    return "dmuon" if caller.f_code.co_filename.startswith(_DMUON_DIR) else "torch"


class TrafficCounter:
    """Context manager counting collective traffic: ``elements[(issuer, op)]`` and ``bytes``."""

    def __init__(self) -> None:
        self.elements: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, module: Any, name: str, cost: Callable[..., int]) -> None:
        original = getattr(module, name, None)
        if original is None:
            return

        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            key = (_issuer(), name)
            bound = signature.bind(*args, **kwargs).args  # keywords to positions
            n = cost(*bound)
            self.elements[key] += n
            first = bound[0] if bound else None
            if isinstance(first, list) and first:
                first = first[0]
            size = first.element_size() if isinstance(first, torch.Tensor) else 4
            self.bytes[key] += n * size
            return original(*args, **kwargs)

        self._saved.append((module, name, original))
        setattr(module, name, counted)

    def __enter__(self) -> TrafficCounter:
        for name, (module, cost) in _OPS.items():
            self._wrap(module, name, cost)
        for name, cost in _FUNCOL_OPS.items():
            self._wrap(funcol, name, cost)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def total(self, issuer: str | None = None) -> int:
        """Elements moved per rank (over (N-1)/N), by ``issuer`` or by everyone."""
        return sum(n for (who, _), n in self.elements.items() if issuer in (None, who))
