"""Keep FSDP2 away from dedicated parameters.

``fully_shard`` collects the parameters of the modules it manages through one helper of
its initialisation module. DMuon wraps that helper (once, idempotently) so that parameters
marked as dedicated are skipped. The helper is looked up through its module at call time,
so the filter works whether ``fully_shard`` was imported before or after ``dmuon``, and
users call ``fully_shard`` with no extra arguments.

That helper is private to torch. `verify_not_sharded` checks the outcome through public
behaviour only (FSDP2 replaces the parameters it manages with DTensors), so a torch
release that moves the helper gives a clear error instead of silently sharded matrices;
the public alternative, ``fully_shard(..., ignored_params=dmuon.dedicated_parameters(model))``,
works in every case.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_init
from torch.distributed.tensor import DTensor

from dmuon._ownership.param import DedicatedParam


class PolicyBoundary(Protocol):
    """What `adopt_fsdp_policies` needs of a `dmuon._ownership.boundary.Boundary`."""

    name: str
    buffer: Any

    def fsdp_module(self, root: nn.Module) -> Any: ...


DEDICATED_FLAG = "_dmuon_dedicated"
_FILTER_FLAG = "_dmuon_skips_dedicated"


def mark_dedicated(param: nn.Parameter, fqn: str) -> None:
    """Flag ``param`` as dedicated so that FSDP2 does not manage it."""
    setattr(param, DEDICATED_FLAG, fqn)


def is_dedicated(param: nn.Parameter) -> bool:
    """Whether ``param`` was dedicated by `dmuon.dedicate_params`."""
    return getattr(param, DEDICATED_FLAG, None) is not None


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The FSDP2 parameter groups of one ``fully_shard`` module (private state: torch 2.13
    keeps a list, earlier releases a single group or ``None``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``module``."""
    return isinstance(module, FSDPModule)


def install_fsdp_filter() -> None:
    """Make FSDP2's managed-parameter collection skip dedicated parameters."""
    original = _fsdp_init._get_managed_states
    if getattr(original, _FILTER_FLAG, False):
        return

    def skip_dedicated(modules: list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        params, buffers = original(modules, *args, **kwargs)
        return [p for p in params if not is_dedicated(p)], buffers

    setattr(skip_dedicated, _FILTER_FLAG, True)
    skip_dedicated.__wrapped_original__ = original  # type: ignore[attr-defined]
    _fsdp_init._get_managed_states = skip_dedicated


def verify_not_sharded(params: Sequence[DedicatedParam]) -> None:
    """Raise if ``fully_shard`` took a dedicated parameter (checked through public behaviour).

    Raises:
        ValueError: A dedicated parameter is registered as a DTensor or was replaced.
    """
    taken = []
    for dp in params:
        registered = dp.module._parameters.get(dp.attr)
        if isinstance(registered, DTensor) or registered is not dp.module_param:
            taken.append(dp.fqn)
    if taken:
        raise ValueError(
            f"fully_shard sharded the dedicated parameters {taken[:3]} ({len(taken)} in all): "
            f"DMuon's filter of FSDP2's parameter collection did not apply with torch "
            f"{torch.__version__}. Pass the dedicated parameters to every fully_shard call "
            "yourself: fully_shard(module, mesh=mesh, "
            "ignored_params=dmuon.dedicated_parameters(model))."
        )


def adopt_fsdp_policies(
    boundaries: Sequence[PolicyBoundary],
    root: nn.Module,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> None:
    """Before the first forward: each boundary computes and reduces its dedicated
    matrices as the ``MixedPrecisionPolicy`` of the ``fully_shard`` around it does for
    its other parameters.

    The compute dtype is the policy's ``param_dtype``; the reduce dtype is the policy's
    effective one (``reduce_dtype``, else ``param_dtype``, as FSDP2 reduces). The policy is
    the one source of each dtype it sets: ``param_dtype`` and ``reduce_dtype`` (what
    ``dedicate_params`` was given) may repeat it, and where they differ the layer would
    mix dtypes, so it raises. Where the policy sets neither, they apply as given.
    """
    for boundary in boundaries:
        fsdp = boundary.fsdp_module(root)
        policy = fsdp._get_fsdp_state()._mp_policy if fsdp is not None else None
        if policy is None or (policy.param_dtype is None and policy.reduce_dtype is None):
            continue
        where = boundary.name or "<root>"
        if param_dtype is not None and policy.param_dtype not in (None, param_dtype):
            raise ValueError(
                f"dedicate_params(param_dtype={param_dtype}) differs from the "
                f"MixedPrecisionPolicy(param_dtype={policy.param_dtype}) of the fully_shard "
                f"around hook boundary {where!r}: the layer would compute with two dtypes. "
                "Drop dedicate_params' param_dtype (dedicated matrices follow the policy), "
                "or give both the same dtype."
            )
        policy_reduce = policy.reduce_dtype or policy.param_dtype
        if reduce_dtype is not None and policy_reduce not in (None, reduce_dtype):
            raise ValueError(
                f"dedicate_params(reduce_dtype={reduce_dtype}) differs from the dtype the "
                f"MixedPrecisionPolicy of the fully_shard around hook boundary {where!r} "
                f"reduces in ({policy_reduce}): one layer's gradients would be summed in two "
                "dtypes. Drop dedicate_params' reduce_dtype (dedicated matrices follow the "
                "policy), or give both the same dtype."
            )
        compute = param_dtype or policy.param_dtype
        reduce = reduce_dtype or policy_reduce
        buffer = boundary.buffer
        buffer.retype(compute or buffer.dtype, reduce or torch.float32)
