"""Counting the collectives a rank issues, independently of DMuon's own audit.

Both doors are watched: the ``torch.distributed`` functions (what DMuon's ``_comm`` and
FSDP2 call) always, and, when asked, the functional-collective ops that DTensor dispatches
(tensor parallelism), through a dispatch mode every op passes (slower, so only there).
Used by the rank harness (`dist_harness.count_collectives`) and the fuzzer's worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

#: The ``torch.distributed`` functions watched (those a torch release has).
PYTHON_COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "gather",
    "all_to_all_single",
)
#: The argument whose size a collective is recorded with (the first one present).
SIZE_ARGUMENTS = ("input_tensor", "input", "tensor")
#: Collectives whose pieces differ between ranks: recorded with their output, the same on
#: every rank (an all-to-all of uneven pieces receives them all everywhere).
SIZE_BY_OUTPUT = {"all_to_all_single": "output"}
ROOT_ARGUMENTS = ("src", "dst")
#: Functional-collective ops that move data (``wait_tensor`` and wrappers do not).
FUNCTIONAL_OPS = frozenset(
    {
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "all_to_all_single",
    }
)

#: One recorded collective: (global ranks of its group, kind, elements, root or -1).
Collective = tuple[tuple[int, ...], str, int, int]


def _ranks_of(group: Any) -> tuple[int, ...]:
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    return tuple(dist.get_process_group_ranks(group))


def _functional_mode(seen: list[Collective]) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = str(func.overloadpacket.__name__)
            if func.namespace == "_c10d_functional" and name in FUNCTIONAL_OPS:
                first = args[0] if args else None
                if isinstance(first, (list, tuple)):
                    first = first[0] if first else None
                group = next((a for a in reversed(args) if isinstance(a, str)), None)
                numel = first.numel() if isinstance(first, torch.Tensor) else 0
                seen.append((_ranks_of(group), name, numel, -1))
            return func(*args, **(kwargs or {}))

    return Mode()


@contextmanager
def recorded_collectives(functional: bool = True) -> Iterator[list[Collective]]:
    """Record every collective issued inside the block (see `Collective`); with
    ``functional`` also DTensor's functional-collective ops."""
    seen: list[Collective] = []
    originals = {n: getattr(dist, n) for n in PYTHON_COLLECTIVES if hasattr(dist, n)}

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            names = (SIZE_BY_OUTPUT[name],) if name in SIZE_BY_OUTPUT else SIZE_ARGUMENTS
            tensor = next((bound[a] for a in names if a in bound), None)
            root = next((bound[a] for a in ROOT_ARGUMENTS if bound.get(a) is not None), -1)
            numel = tensor.numel() if isinstance(tensor, torch.Tensor) else 0
            seen.append((_ranks_of(bound.get("group")), name, numel, root))
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        with _functional_mode(seen) if functional else nullcontext():
            yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
