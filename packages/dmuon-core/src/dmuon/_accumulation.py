"""`no_sync`: gradient accumulation without communication (FSDP2, HSDP, DDP)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from dmuon._ownership.fsdp_integration import fsdp_param_groups, is_fsdp_module
from dmuon._ownership.state import dedicated_root, get_dedication, unwrap


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


def _resolve(module: nn.Module) -> tuple[nn.Module, DistributedDataParallel | None]:
    """The whole model ``module`` belongs to, and the DDP wrapper it runs in (if known)."""
    ddp = module if isinstance(module, DistributedDataParallel) else None
    module = unwrap(module)
    root = dedicated_root(module) or module
    state = get_dedication(root)
    if ddp is None and state is not None:
        ddp = state.runtime.ddp()
    return root, ddp


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, with no gradient communication, inside the block.

    Dedicated parameters: each backward adds the local full-matrix gradient to a local
    total (``_accumulated_grad``) on every rank instead of reducing it to the owner; the
    next backward outside ``no_sync`` merges it with its own gradient and reduces once.
    Symmetric parameters: ``set_requires_gradient_sync(False)`` on every FSDP2 module, so
    FSDP2 keeps unsharded gradients until the next synced backward; under
    ``DistributedDataParallel``, DDP's own ``no_sync()``, so it skips its all-reduce.

    ``model`` may be the model passed to `dmuon.dedicate_params`, its DDP wrapper, or any
    module inside it (a Hugging Face model's base model, one layer): the block always
    covers the whole model, whose traffic would otherwise still flow for the parts outside
    the module given. The previous settings are restored on exit, also when the block
    raises. On a model with neither dedicated parameters, FSDP2 modules nor DDP this does
    nothing: plain PyTorch already accumulates gradients locally.

    Args:
        model: The model (or its DDP wrapper, or a module inside it).
    """
    root, ddp = _resolve(model)
    state = get_dedication(root)
    fsdp_modules = [m for m in root.modules() if is_fsdp_module(m)]
    with ExitStack() as stack:
        if ddp is not None:
            stack.enter_context(ddp.no_sync())
        stack.enter_context(_fsdp_no_sync(fsdp_modules))
        if state is not None:
            stack.enter_context(state.runtime.no_sync())
        yield
