"""Keep FSDP2 away from dedicated parameters.

``fully_shard`` collects the parameters of the modules it manages through one helper of
its initialisation module. DMuon wraps that helper (once, idempotently) so that parameters
marked as dedicated are skipped. The helper is looked up through its module at call time,
so the filter works whether ``fully_shard`` was imported before or after ``dmuon``, and
users call ``fully_shard`` with no extra arguments.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_init

DEDICATED_FLAG = "_dmuon_dedicated"
_FILTER_FLAG = "_dmuon_skips_dedicated"


def mark_dedicated(param: nn.Parameter, fqn: str) -> None:
    """Flag ``param`` as dedicated so that FSDP2 does not manage it."""
    setattr(param, DEDICATED_FLAG, fqn)


def is_dedicated(param: nn.Parameter) -> bool:
    """Whether ``param`` was dedicated by `dmuon.dedicate_params`."""
    return getattr(param, DEDICATED_FLAG, None) is not None


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
    _fsdp_init._get_managed_states = skip_dedicated
