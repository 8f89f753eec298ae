"""`no_sync`: gradient accumulation without communication."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule

from dmuon.ownership.fsdp_integration import fsdp_param_groups, is_fsdp_module
from dmuon.ownership.state import get_dedication


def _requires_gradient_sync(module: FSDPModule) -> bool:
    # FSDP2 has a public setter but no getter; read the flag its setter writes so the
    # user's own setting is restored (through the setter) on exit.
    return all(getattr(group, "reduce_grads", True) for group in fsdp_param_groups(module))


@contextmanager
def _fsdp_no_sync(modules: list[FSDPModule]) -> Iterator[None]:
    previous = [_requires_gradient_sync(m) for m in modules]
    try:
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        yield
    finally:
        for module, sync in zip(modules, previous, strict=True):
            module.set_requires_gradient_sync(sync, recurse=False)


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
    fsdp_modules = [m for m in model.modules() if is_fsdp_module(m)]
    with ExitStack() as stack:
        stack.enter_context(_fsdp_no_sync(fsdp_modules))
        if state is not None:
            stack.enter_context(state.runtime.no_sync())
        yield
