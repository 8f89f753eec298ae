"""Dedicated matrices follow the model wherever it is moved after `dmuon.dedicate_params`.

A model is often dedicated where it was built (the CPU, or the meta device) and moved
afterwards: ``model.to("cuda")``, ``model.to(torch.bfloat16)``, ``to_empty``, or
``fully_shard``, which moves the parameters it manages to its mesh's device and leaves
the dedicated ones (taken out of its list) where they were; Accelerate does not move an
FSDP2 model itself. Before each forward the runtime compares where the model runs with
where its dedicated masters, flat buffers and communicator are (a pass over the registered
dedicated parameters' devices and dtypes), and on a change:

* the device is FSDP2's (the device of the parameters ``fully_shard`` manages) when the
  model is sharded, else the one every registered dedicated parameter is on;
* the masters (and the 0-element placeholders) move there, the flat buffers are made
  again there, and in one process the communicator computes there too; under a process
  group of more than one rank the group's device is fixed, and a model moved elsewhere
  is refused with what to do;
* the dtype the registered parameters were given (``model.to(torch.float64)``) becomes
  the masters' and the buffers' (unless ``param_dtype`` or FSDP2's policy chose the
  buffers' dtype);
* the Muon state follows the masters at the next ``optimizer.step()``.

A move while a gradient waits for its step is refused: it would split one step's state
over two devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon._comm import Communicator
from dmuon._ownership.boundary import Boundary
from dmuon._ownership.param import DedicatedParam

#: ``(device, dtype)`` of the registered dedicated parameters.
Placement = tuple[torch.device, torch.dtype]


class DedicationRuntime(Protocol):
    """What placement reads and writes of `dmuon._ownership.runtime.DedicationRuntime`."""

    params: list[DedicatedParam]
    boundaries: Sequence[Boundary]
    comm: Communicator
    unsynced_backwards: int
    placement: Placement
    fsdp_probe: tuple[tuple[type, ...], torch.Tensor | None] | None
    _root: nn.Module

    def reduced_grad(self, dp: DedicatedParam) -> torch.Tensor | None: ...


def _one(values: Iterable[object], what: str) -> object:
    found = set(values)
    if len(found) > 1:
        raise ValueError(
            f"the dedicated parameters are on several {what}s ({sorted(map(str, found))}); "
            "DMuon keeps every dedicated matrix of a model on one device and dtype: move the "
            "whole model with model.to(...), not some of its modules"
        )
    return found.pop()


def _fsdp_parameter(root: nn.Module) -> torch.Tensor | None:
    """A parameter FSDP2 manages in ``root`` (``None``: not sharded)."""
    return next((p for p in root.parameters() if isinstance(p, DTensor)), None)


def _follows_the_model(dp: DedicatedParam) -> bool:
    """Whether ``dp``'s tensors take the model's device and dtype: a master that steps here
    or a placeholder (an HSDP replica's narrow copy keeps its own dtype and device)."""
    return dp.updates_here or not dp.is_owned


def _held(runtime: DedicationRuntime) -> list[nn.Parameter]:
    """The registered dedicated parameters whose device and dtype the model sets."""
    return [dp.module_param for dp in runtime.params if _follows_the_model(dp)]


def current_placement(runtime: DedicationRuntime) -> Placement:
    """Where the model now wants its dedicated matrices: FSDP2's device when sharded, else
    the registered dedicated parameters'; their dtype."""
    held = _held(runtime)
    if not held:
        return runtime.placement
    # fully_shard gives the modules it wraps a new class: look again only then.
    key = (type(runtime._root), *(type(b.module) for b in runtime.boundaries[:1]))
    if runtime.fsdp_probe is None or runtime.fsdp_probe[0] != key:
        runtime.fsdp_probe = (key, _fsdp_parameter(runtime._root))
    probe = runtime.fsdp_probe[1]
    device = probe.device if probe is not None else _one((p.device for p in held), "device")
    dtype = _one((p.dtype for p in held), "dtype")
    assert isinstance(device, torch.device) and isinstance(dtype, torch.dtype)
    if device.type == "meta" or held[0].is_meta:
        return runtime.placement  # not materialised yet: nothing to follow
    return _normalized(device), dtype


def _normalized(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def follow_placement(runtime: DedicationRuntime) -> None:
    """Move the dedicated masters, buffers and (in one process) the communicator to where
    the model now runs, when it moved since the last forward (see the module docstring).

    Raises:
        ValueError: the model was moved off the device its process group communicates
            on, or while gradients wait for ``optimizer.step()``.
    """
    device, dtype = current_placement(runtime)
    old_device, old_dtype = runtime.placement
    if (device, dtype) == (old_device, old_dtype):
        return
    comm = runtime.comm
    if dtype != old_dtype and comm.replicas > 1:
        raise ValueError(
            f"the dedicated parameters changed dtype from {old_dtype} to {dtype} after "
            "dmuon.dedicate_params on an HSDP mesh; give the model its dtype before "
            "dedicate_params"
        )
    if device != comm.device and (comm.world_size > 1 or comm.replicas > 1):
        raise ValueError(
            f"the model runs on {device}, but DMuon's process group communicates on "
            f"{comm.device}: dedicated matrices cannot follow it there. Move the model to "
            f"{comm.device} (or build the process group and mesh for {device}) before "
            "dmuon.dedicate_params"
        )
    waiting = [dp.name for dp in runtime.params if runtime.reduced_grad(dp) is not None]
    if waiting or runtime.unsynced_backwards:
        raise ValueError(
            f"the model moved to {device} ({dtype}) while gradients wait for "
            "optimizer.step() (for example "
            f"{(waiting or ['accumulated under no_sync'])[0]}); move it before the "
            "backward or after the step"
        )
    with torch.no_grad():
        for dp in filter(_follows_the_model, runtime.params):
            for param in {id(p): p for p in (dp.param, dp.module_param)}.values():
                if param.device != device or param.dtype != dtype:
                    param.data = param.data.to(device, dtype)
    comm.move_to(device)
    for boundary in runtime.boundaries:
        buffer = boundary.buffer
        buffer.free()
        compute = dtype if buffer.dtype == old_dtype else buffer.dtype
        reduce = dtype if buffer.reduce_dtype == old_dtype else buffer.reduce_dtype
        buffer.retype(compute, reduce, device)
    runtime.placement = (device, dtype)


def state_to_param(state: dict[str, object], param: torch.Tensor) -> None:
    """Move an optimizer state's tensors onto ``param``'s device (they were made before the
    model moved); their dtype stays."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.device != param.device:
            state[key] = value.to(param.device)
