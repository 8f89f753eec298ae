"""State dicts of dedicated models, with the signatures of torch's DCP state-dict functions.

Change ``from torch.distributed.checkpoint.state_dict import get_state_dict`` to
``from dmuon import get_state_dict`` and the rest of a DCP script stays as it is:

```python
model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
```

On a model without `dmuon.dedicate_params` every function here is torch's own. Each takes
the model or its ``DistributedDataParallel`` wrapper; keys are the unwrapped model's. On a
dedicated model the model part has the keys, shapes and dtypes of the unwrapped model's
``state_dict()``, and each dedicated matrix (with its Muon momentum) takes the layout
FSDP2 gives a parameter: a ``Shard(0)`` DTensor by default, or a full tensor with
``full_state_dict=True`` (on rank 0 only, on CPU, with ``cpu_offload=True``). Loading
re-plans nothing: each rank takes its shards, and each owner its whole matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_sd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from dmuon._ownership.dedication_state import get_dedication, unwrap
from dmuon.checkpoint._model_state import (
    get_dedicated_model_state_dict,
    set_dedicated_model_state_dict,
)
from dmuon.checkpoint._optim_state import (
    as_tuple,
    get_dedicated_optimizer_state_dict,
    set_dedicated_optimizer_state_dict,
)

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def get_model_state_dict(
    model: nn.Module, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """The model's state dict, keyed like the unwrapped model's ``state_dict()``.

    Call on every rank. Dedicated matrices are ``Shard(0)`` DTensors over the dedication's
    mesh by default (what ``dcp.save`` writes from every rank at once); with
    ``full_state_dict=True`` they are full tensors (on rank 0 only, on CPU, when
    ``cpu_offload=True`` as well). Everything else is torch's
    ``get_model_state_dict``.

    Args:
        model: the model (prepared with `dmuon.dedicate_params` or not).
        options: torch's ``StateDictOptions``.
    """
    options = options or StateDictOptions()
    model = unwrap(model)
    state = get_dedication(model)
    if state is not None:
        state.runtime.wait_for_updates()  # HSDP: the last step's values everywhere
    if state is None:
        return torch_sd.get_model_state_dict(model, options=options)
    return get_dedicated_model_state_dict(model, state, options)


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load a model state dict; every owner gets its matrices, the next forward broadcasts them.

    Call on every rank. Accepts what `get_model_state_dict` returns (filled by
    ``dcp.load``, at any world size), a full state dict on every rank
    (``full_state_dict=True``), or one on rank 0 only (``broadcast_from_rank0=True``).
    Z2's resident broadcast buffers are invalidated.

    Returns:
        The missing and unexpected keys, as ``nn.Module.load_state_dict`` does.

    Raises:
        RuntimeError: ``strict`` (the default) and keys are missing or unexpected.
        ValueError: a dedicated matrix has the wrong shape, or the ranks disagree on
            whether it is sharded (the same error on every rank).
    """
    options = options or StateDictOptions()
    model = unwrap(model)
    state = get_dedication(model)
    if state is not None:
        state.runtime.wait_for_updates()  # HSDP: the last step's values everywhere
    if state is None:
        return torch_sd.set_model_state_dict(model, model_state_dict, options=options)
    return set_dedicated_model_state_dict(model, state, model_state_dict, options)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizers' state dict in torch's FQN-keyed format.

    ``state[fqn]`` per parameter and ``param_groups[i]["params"]`` as FQNs. Muon momentum
    sits under its matrix's FQN in the matrix's layout; AdamW moments and steps as torch
    gives them for FSDP2 parameters. A fresh optimizer gets zero state first (so a
    checkpoint can be loaded into it); that changes none of its later steps.
    """
    options = options or StateDictOptions()
    model = unwrap(model)
    state = get_dedication(model)
    if state is not None:
        state.runtime.wait_for_updates()  # HSDP: the last step's values everywhere
    if state is None:
        return torch_sd.get_optimizer_state_dict(model, optimizers, options=options)
    return get_dedicated_optimizer_state_dict(model, state, as_tuple(optimizers), options)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an FQN-keyed optimizer state dict; momentum goes to each matrix's owner.

    Raises:
        ValueError: with ``strict`` (the default), a parameter of ``optimizers`` has no
            state or param group in ``optim_state_dict``; or a dedicated matrix's momentum
            does not fit.
    """
    options = options or StateDictOptions()
    model = unwrap(model)
    state = get_dedication(model)
    if state is not None:
        state.runtime.wait_for_updates()  # HSDP: the last step's values everywhere
    if state is None:
        torch_sd.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
        return
    set_dedicated_optimizer_state_dict(
        model, state, as_tuple(optimizers), optim_state_dict, options
    )


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))``."""
    options = options or StateDictOptions()
    model = unwrap(model)
    if get_dedication(model) is None:
        return torch_sd.get_state_dict(model, optimizers, options=options)
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizers, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """`set_model_state_dict` then `set_optimizer_state_dict`; returns the model's key report."""
    options = options or StateDictOptions()
    model = unwrap(model)
    if get_dedication(model) is None:
        return torch_sd.set_state_dict(
            model,
            optimizers,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys
