"""`no_sync`: gradient accumulation without communication."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from dmuon.ownership.fsdp_integration import is_fsdp_module
from dmuon.ownership.state import get_dedication


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, with no gradient communication, inside the block.

    Dedicated parameters: each backward adds the local full-matrix gradient to
    ``param._accumulated_grad`` on every rank instead of reducing it to the owner; the next
    backward outside ``no_sync`` merges it with its own gradient and reduces once.
    Symmetric (FSDP2) parameters: ``set_requires_gradient_sync(False)`` on every FSDP2
    module, so FSDP2 keeps unsharded gradients until the next synced backward.

    The previous settings are restored on exit, also when the block raises. On a model
    with neither dedicated parameters nor FSDP2 modules this does nothing: plain PyTorch
    already accumulates gradients locally.

    Args:
        model: The model passed to `dmuon.dedicate_params` and/or ``fully_shard``.
    """
    state = get_dedication(model)
    runtime = state.runtime if state is not None else None
    fsdp_modules = [m for m in model.modules() if is_fsdp_module(m)]
    # FSDP2 has a setter but no getter; read the flags it sets to restore them exactly.
    fsdp_groups = [g for m in fsdp_modules for g in m._get_fsdp_state()._fsdp_param_groups]
    previous_fsdp = [(g.reduce_grads, g.all_reduce_grads) for g in fsdp_groups]
    previous_sync = runtime.sync_grads if runtime is not None else True
    try:
        for module in fsdp_modules:
            module.set_requires_gradient_sync(False, recurse=False)
        if runtime is not None:
            runtime.sync_grads = False
        yield
    finally:
        for group, (reduce_grads, all_reduce_grads) in zip(fsdp_groups, previous_fsdp, strict=True):
            group.reduce_grads = reduce_grads
            group.all_reduce_grads = all_reduce_grads
        if runtime is not None:
            runtime.sync_grads = previous_sync
