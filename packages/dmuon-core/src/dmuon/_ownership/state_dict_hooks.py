"""How a dedicated model's own ``state_dict`` and ``load_state_dict`` behave: reads and
loads wait for the updates between replicas, each owner loads its matrices (a split
stack's range owner its experts), and the buffers are gathered again afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dmuon._ownership.guards import refuse_torchs_state_dict_functions
from dmuon._ownership.param import DedicatedParam


class Runtime(Protocol):
    """What the hooks need of `dmuon._ownership.runtime.DedicationRuntime`."""

    params: Sequence[DedicatedParam]

    def wait_for_updates(self) -> None: ...

    def invalidate_buffers(self) -> None: ...


def _load_range(dp: DedicatedParam, full: Any) -> bool:
    """The owner of a split stack's range copies its experts of ``full`` into its master.

    Returns ``False`` when ``full`` is not a tensor of the stack's shape.
    """
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(dp.stack_shape or ()):
        return False
    if dp.is_owned and dp.experts is not None:
        with torch.no_grad():
            dp.param.copy_(full[dp.experts[0] : dp.experts[1]])
    return True


def _is_whole(dp: DedicatedParam, value: Any) -> bool:
    """Whether ``value`` is a plain tensor of ``dp``'s whole (global) shape."""
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(dp.global_shape)


def install_state_dict_hooks(runtime: Runtime, model: nn.Module) -> None:
    """Make ``model.load_state_dict`` work on every rank and refresh ``runtime``'s buffers;
    torch's state-dict functions are refused (they would miss the owners' masters).

    Non-owners hold 0-element placeholders: a full tensor for one of them is replaced by
    an empty one before loading (the owner loads the value and broadcasts it). For a
    stack split by experts every rank holds a placeholder; each range's owner copies
    its experts from the full tensor into its master.
    """
    # Reading or loading the masters waits for the values still on their way (HSDP).
    model.register_state_dict_pre_hook(lambda *_: runtime.wait_for_updates())
    model.register_load_state_dict_pre_hook(lambda *_: runtime.wait_for_updates())
    by_module: dict[int, list[DedicatedParam]] = {}
    for dp in runtime.params:
        by_module.setdefault(id(dp.module), []).append(dp)
    for dps in by_module.values():

        def keep_owned_only(
            _module: nn.Module,
            state_dict: dict[str, Any],
            prefix: str,
            *_: Any,
            dps: list[DedicatedParam] = dps,
        ) -> None:
            given = {dp.attr: state_dict.get(prefix + dp.attr) for dp in dps}
            for dp in dps:
                value = given[dp.attr]
                if dp.tp is not None and _is_whole(dp, value):
                    # The owner takes its tp position's shard of the whole matrix.
                    local = dp.tp.local_of(value) if dp.is_owned else None
                    state_dict[prefix + dp.attr] = (
                        local if local is not None else dp.param.detach().new_empty(0)
                    )
                    continue
                if value is None or (dp.is_owned and not dp.is_range):
                    continue
                if dp.is_range and not _load_range(dp, value):
                    continue  # wrong shape: load_state_dict reports it
                state_dict[prefix + dp.attr] = dp.module_param.detach().new_empty(0)

        dps[0].module.register_load_state_dict_pre_hook(keep_owned_only)
    model.register_load_state_dict_post_hook(lambda _module, _keys: runtime.invalidate_buffers())
    model.register_state_dict_post_hook(refuse_torchs_state_dict_functions)
