"""`no_sync`: gradient accumulation without communication (FSDP2, HSDP, DDP)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from dmuon._ownership.dedication_state import dedicated_root, get_dedication, unwrap
from dmuon._ownership.fsdp_integration import fsdp_param_groups, is_fsdp_module

#: FSDP2's per-module switches ``no_sync`` turns off: ``(setter, the flag its setter
#: writes on each param group)``. FSDP2 has setters but no getters; the flag is read so
#: the user's own setting is restored (through the setter) on exit.
_GRADIENT_SYNC = ("set_requires_gradient_sync", "reduce_grads")
_ALL_REDUCE = ("set_requires_all_reduce", "all_reduce_grads")


def _fsdp_flag(module: FSDPModule, flag: str) -> bool:
    return all(getattr(group, flag, True) for group in fsdp_param_groups(module))


@contextmanager
def _fsdp_switched_off(modules: list[FSDPModule], switch: tuple[str, str]) -> Iterator[None]:
    """Turn one of FSDP2's switches off on ``modules`` inside the block."""
    setter, flag = switch
    previous = [_fsdp_flag(m, flag) for m in modules]
    try:
        for module in modules:
            getattr(module, setter)(False, recurse=False)
        yield
    finally:
        for module, value in zip(modules, previous, strict=True):
            getattr(module, setter)(value, recurse=False)


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
def no_sync(model: nn.Module, *, scope: str = "all") -> Iterator[None]:
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

    ``scope="replicas"`` (HSDP) accumulates across micro-batches between replicas only:
    each backward still sums the gradients inside its replica (the dedicated ones into
    their owners, FSDP2's with its reduce-scatter), each owner keeps the window's sums of
    its matrices (float32, about P_M / S elements per rank against a whole P_M with the
    default), and the next backward outside the block sends them across replicas once,
    as FSDP2's ``set_requires_all_reduce(False)`` does for its parameters. The traffic
    between nodes is then one step's whatever the number of micro-batches. On a 1-D mesh
    nothing crosses replicas, and the block changes nothing.

    Args:
        model: The model (or its DDP wrapper, or a module inside it).
        scope: ``"all"`` (no gradient communication) or ``"replicas"`` (only none
            between replicas).

    Raises:
        ValueError: another ``scope``.
    """
    if scope not in ("all", "replicas"):
        raise ValueError(
            f'no_sync(scope=...) is "all" (no gradient communication) or "replicas" (sum '
            f"inside each replica, cross replicas once per step), not {scope!r}"
        )
    root, ddp = _resolve(model)
    state = get_dedication(root)
    fsdp_modules = [m for m in root.modules() if is_fsdp_module(m)]
    with ExitStack() as stack:
        if scope == "replicas":
            stack.enter_context(_fsdp_switched_off(fsdp_modules, _ALL_REDUCE))
            if state is not None:
                stack.enter_context(state.runtime.no_replica_sync())
            yield
            return
        if ddp is not None:
            stack.enter_context(ddp.no_sync())
        stack.enter_context(_fsdp_switched_off(fsdp_modules, _GRADIENT_SYNC))
        if state is not None:
            stack.enter_context(state.runtime.no_sync())
        yield
