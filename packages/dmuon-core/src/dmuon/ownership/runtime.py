"""Hooks that move dedicated parameters through forward and backward.

Per hook boundary (usually one transformer layer):

- forward pre-hook: broadcast each owner's packed buffer (prefetching the next boundary's),
  register the full-matrix views on their modules;
- forward post-hook: put the registered parameters back; Z3 frees the buffers, Z2 keeps
  them until ``optimizer.step()`` changes the owners' values;
- pre-backward (a hook on the boundary's outputs): Z3 broadcasts again; the views are
  registered again so activation-checkpoint recomputation sees full matrices;
- post-backward (once every view of the boundary has its gradient, or at the end of
  backward): SUM-reduce the gradients to their owners, or, under `no_sync`, add them to
  ``_accumulated_grad`` locally.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dmuon.comm import Communicator
from dmuon.ownership.packed_group import PackedGroup
from dmuon.ownership.state import DedicatedParam


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors inside a forward output: tensors, sequences, mappings, dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from iter_tensors(getattr(value, f.name))


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floating(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Boundary:
    """One hook boundary: its module, its packed groups and its backward bookkeeping."""

    def __init__(self, name: str, module: nn.Module, groups: list[PackedGroup]) -> None:
        self.name = name
        self.module = module
        self.groups = groups
        self.expected_grads = sum(leaf.requires_grad for g in groups for leaf in g.leaves)
        self.arrived_grads = 0
        self.awaiting_backward = False
        self.pre_backward_done = False

    def pairs(self) -> Iterator[tuple[DedicatedParam, nn.Parameter]]:
        """(dedicated parameter, full-matrix view) pairs of this boundary."""
        for group in self.groups:
            yield from zip(group.params, group.leaves, strict=True)

    def register_views(self) -> None:
        """Put the full-matrix views on their modules (forward and recomputation use them)."""
        for dp, leaf in self.pairs():
            dp.module._parameters[dp.attr] = leaf

    def register_params(self) -> None:
        """Put the registered parameters (master / placeholder) back on their modules."""
        for dp, _ in self.pairs():
            dp.module._parameters[dp.attr] = dp.param


class DedicationRuntime:
    """All boundaries of one model and the hooks that drive them."""

    def __init__(
        self,
        boundaries: list[Boundary],
        comm: Communicator,
        reshard_after_forward: bool,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.boundaries = boundaries
        self.comm = comm
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.sync_grads = True
        self._callback_queued = False
        for index, boundary in enumerate(boundaries):
            self._install(index, boundary)

    # ----- installation ------------------------------------------------------------------
    def _install(self, index: int, boundary: Boundary) -> None:
        module = boundary.module
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: self._pre_forward(index, args, kwargs), with_kwargs=True
        )
        module.register_forward_hook(lambda _m, _args, out: self._post_forward(index, out))
        for _, leaf in boundary.pairs():
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(lambda _t: self._grad_arrived(index))

    # ----- forward -------------------------------------------------------------------------
    def _unshard(self, index: int, prefetch: int | None) -> None:
        boundary = self.boundaries[index]
        for group in boundary.groups:
            group.unshard_async()
        if prefetch is not None and 0 <= prefetch < len(self.boundaries):
            for group in self.boundaries[prefetch].groups:
                group.unshard_async()
        for group in boundary.groups:
            group.wait_unshard()

    def _pre_forward(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._unshard(index, prefetch=index + 1)
        self.boundaries[index].register_views()
        if self.param_dtype is not None:
            return _cast_floating(args, self.param_dtype), _cast_floating(kwargs, self.param_dtype)
        return None

    def _post_forward(self, index: int, output: Any) -> None:
        boundary = self.boundaries[index]
        boundary.register_params()
        if _in_backward():
            return  # recomputation of a checkpointed boundary: backward still needs buffers
        if torch.is_grad_enabled() and boundary.expected_grads:
            hooked = False
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._pre_backward(index, grad))
                    hooked = True
            if hooked:
                boundary.awaiting_backward = True
                boundary.arrived_grads = 0
                boundary.pre_backward_done = False
        if self.reshard_after_forward:
            for group in boundary.groups:
                group.free()

    # ----- backward ------------------------------------------------------------------------
    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        boundary = self.boundaries[index]
        self._queue_final_callback()
        if not boundary.pre_backward_done:
            boundary.pre_backward_done = True
            previous = index - 1
            prefetch = (
                previous if previous >= 0 and self.boundaries[previous].awaiting_backward else None
            )
            self._unshard(index, prefetch=prefetch)
            boundary.register_views()
        return grad

    def _grad_arrived(self, index: int) -> None:
        self._queue_final_callback()
        boundary = self.boundaries[index]
        boundary.arrived_grads += 1
        if boundary.awaiting_backward and boundary.arrived_grads == boundary.expected_grads:
            self._post_backward(boundary)

    def _post_backward(self, boundary: Boundary) -> None:
        boundary.awaiting_backward = False
        boundary.pre_backward_done = False
        boundary.arrived_grads = 0
        boundary.register_params()
        for group in boundary.groups:
            if self.sync_grads:
                group.reduce_async()
            else:
                group.accumulate_locally()
            if self.reshard_after_forward:
                group.free()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for boundary in self.boundaries:
            if boundary.awaiting_backward:
                self._post_backward(boundary)
        for boundary in self.boundaries:
            for group in boundary.groups:
                group.finish_reduce()

    # ----- optimizer -----------------------------------------------------------------------
    def parameters_updated(self) -> None:
        """Owners changed their masters: invalidate buffers and close the audit step."""
        for boundary in self.boundaries:
            for group in boundary.groups:
                group.invalidate()
        self.comm.audit.close_step()

    def groups(self) -> Iterator[PackedGroup]:
        """Every packed group, boundary by boundary."""
        for boundary in self.boundaries:
            yield from boundary.groups
