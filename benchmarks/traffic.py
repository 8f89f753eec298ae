"""Count what every collective moves, by intercepting torch.distributed itself.

No library's own accounting is used (DMuon's audit included): while a `TrafficCounter` is
active, the collectives of ``torch.distributed``, of its functional collectives and
DTensor's all-to-all are wrapped, and each call adds the elements it moves per rank on a
ring, over (N-1)/N:

* broadcast, reduce, all-gather (output size), reduce-scatter (input size), gather and
  scatter (the full, N-piece size): 1 x elements;
* all-reduce: 2 x elements (a reduce-scatter plus an all-gather);
* all-to-all: the input's elements (each rank sends all but its own 1/N of them).

Dividing by P_M, the elements of the Muon-target matrices, gives the units of (N-1)/N x P_M
that DMuon's formula is stated in. Code that imported a collective by name
(``from torch.distributed import gather``) holds its own reference, so the aliases in
torch.distributed's, dmuon's and the peers' modules are replaced too; a collective that
calls another (the functional ``all_gather_tensor`` calls ``all_gather_single``) is counted
once. Each call is attributed to ``"dmuon"`` when code of the ``dmuon`` package called it
directly (``"control"`` for its one-number reductions: a gradient norm, the non-finite
agreement, QK-clip's maxima), to ``"peer"`` when a peer optimizer (``muon_fsdp2``,
``dtensor_muon``) is on the stack, and to ``"torch"`` (FSDP2, DTensor) otherwise.
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
import torch.distributed.tensor._collective_utils as dtensor_collectives

import dmuon

_DMUON_DIR = str(Path(dmuon.__file__).parent)
PEER_MODULES = ("muon_fsdp2", "dtensor_muon")
"""Top-level modules of the peer optimizers; their collectives count as ``"peer"``."""
_CALLER_PACKAGES = ("torch.distributed", "dmuon", *PEER_MODULES)
"""Modules whose aliases of the collectives are replaced (scanning every module is slow)."""


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


def _group_world(*args: Any, **kwargs: Any) -> int:
    # gather/scatter: (tensor, list, dst/src, group, ...)
    return dist.get_world_size(args[3] if len(args) > 3 else None)


# name -> (module, elements moved per rank for the call's arguments)
_OPS: dict[str, tuple[Any, Callable[..., int]]] = {
    "broadcast": (dist, lambda t, *a, **k: _numel(t)),
    "reduce": (dist, lambda t, *a, **k: _numel(t)),
    "all_reduce": (dist, lambda t, *a, **k: 2 * _numel(t)),
    "all_gather": (dist, lambda out, t, *a, **k: _numel(t) * len(out)),
    "all_gather_into_tensor": (dist, lambda out, t, *a, **k: _numel(out)),
    "all_gather_single": (dist, lambda out, t, *a, **k: _numel(out)),
    "reduce_scatter": (dist, lambda out, ts, *a, **k: sum(_numel(t) for t in ts)),
    "reduce_scatter_tensor": (dist, lambda out, t, *a, **k: _numel(t)),
    "reduce_scatter_single": (dist, lambda out, t, *a, **k: _numel(t)),
    # Every rank passes its equal piece; the full tensor is N pieces.
    "gather": (dist, lambda t, *a, **k: _numel(t) * _group_world(t, *a)),
    "scatter": (dist, lambda t, *a, **k: _numel(t) * _group_world(t, *a)),
    # What the rank receives, as for the all-gathers (DMuon's uneven all-gather on gloo).
    "all_to_all_single": (dist, lambda out, t, *a, **k: _numel(out)),
    "all_to_all": (dist, lambda outs, ts, *a, **k: sum(_numel(t) for t in ts)),
    "shard_dim_alltoall": (dtensor_collectives, lambda t, *a, **k: _numel(t)),
}
_FUNCOL_OPS: dict[str, Callable[..., int]] = {
    "all_gather_tensor": lambda t, dim, group, *a, **k: _numel(t) * _world(group),
    "all_gather_single": lambda t, dim, group, *a, **k: _numel(t) * _world(group),
    "reduce_scatter_tensor": lambda t, *a, **k: _numel(t),
    "reduce_scatter_single": lambda t, *a, **k: _numel(t),
    "all_reduce": lambda t, *a, **k: 2 * _numel(t),
    "all_to_all_single": lambda t, *a, **k: _numel(t),
}


def _is_peer_file(filename: str) -> bool:
    parts = Path(filename).parts
    return any(p in PEER_MODULES or p in (f"{m}.py" for m in PEER_MODULES) for p in parts)


def _issuer() -> str:
    # The frame that called the collective decides for dmuon: the dmuon library issues its
    # own collectives; FSDP2 and DTensor issue theirs from torch, even inside a dmuon
    # model's forward, so walking further up the stack would misattribute them. A peer's
    # collectives go through DTensor's code, so a peer frame anywhere on the stack decides
    # (peers run only in optimizer.step(), where no FSDP2 hook fires).
    caller = sys._getframe(2)
    if caller.f_code.co_filename.startswith(_DMUON_DIR):
        # A norm, a QK-clip maximum, the non-finite agreement: not the matrices' traffic.
        return "control" if caller.f_code.co_name == "all_reduce_control" else "dmuon"
    frame: Any = caller
    while frame is not None:
        if _is_peer_file(frame.f_code.co_filename):
            return "peer"
        frame = frame.f_back
    return "torch"


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    """The global ranks of a collective's group (``None`` when its form is not known)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    if isinstance(group, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(group))
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
        return tuple(dist.get_process_group_ranks(group[0].get_group(group[1])))
    return None


class TrafficCounter:
    """Context manager counting collective traffic: ``elements[(issuer, op)]`` and ``bytes``.

    ``ignored_group``: the global ranks of a group whose collectives are not counted (the
    replicate dimension of an HSDP mesh, whose traffic the per-step formulas leave out).
    """

    def __init__(self, ignored_group: tuple[int, ...] | None = None) -> None:
        self.ignored_group = ignored_group
        self.elements: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def _counted(self, original: Any, name: str, cost: Callable[..., int]) -> Any:
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # called by another wrapped collective: counted there
                return original(*args, **kwargs)
            key = (_issuer(), name)
            binding = signature.bind(*args, **kwargs)
            bound = binding.args  # keywords to positions
            group = binding.arguments.get("group")
            if self.ignored_group is not None and _group_ranks(group) == self.ignored_group:
                self._depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self._depth -= 1
            n = cost(*bound)
            self.elements[key] += n
            first = bound[0] if bound else None
            if isinstance(first, list) and first:
                first = first[0]
            size = first.element_size() if isinstance(first, torch.Tensor) else 4
            self.bytes[key] += n * size
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _wrap_everywhere(self, wrapped: dict[int, Any]) -> None:
        # Replace the function in its own module and every alias of it in loaded modules.
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith(_CALLER_PACKAGES):
                continue
            names = getattr(module, "__dict__", None)
            if not isinstance(names, dict):
                continue
            for attr, value in list(names.items()):
                replacement = wrapped.get(id(value))
                if replacement is not None and callable(value):
                    self._saved.append((module, attr, value))
                    setattr(module, attr, replacement)

    def __enter__(self) -> TrafficCounter:
        wrapped: dict[int, Any] = {}
        for name, (module, cost) in _OPS.items():
            original = getattr(module, name, None)
            if original is not None:
                wrapped[id(original)] = self._counted(original, name, cost)
        for name, cost in _FUNCOL_OPS.items():
            original = getattr(funcol, name, None)
            if original is not None:
                wrapped[id(original)] = self._counted(original, f"funcol.{name}", cost)
        self._wrap_everywhere(wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def total(self, issuer: str | None = None) -> int:
        """Elements moved per rank (over (N-1)/N), by ``issuer`` or by everyone."""
        return sum(n for (who, _), n in self.elements.items() if issuer in (None, who))
