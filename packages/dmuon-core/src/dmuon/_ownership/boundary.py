"""A hook boundary: its module, its flat buffer and the bookkeeping of its backwards; and
the autograd function that tells the runtime a forward's inputs got their gradients."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any, Protocol

import torch
from torch import nn

from dmuon._ownership import gradients
from dmuon._ownership.flat_buffer import FlatBuffer
from dmuon._ownership.fsdp_integration import is_fsdp_module


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


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_floating(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _InputsGradListener(Protocol):
    def _inputs_grad_done(self, index: int, ticket: int) -> None: ...


class BoundaryInputsGrad(torch.autograd.Function):
    """Identity on a boundary's inputs; its backward runs once their gradients are done."""

    @staticmethod
    def forward(
        ctx: Any, runtime: _InputsGradListener, index: int, ticket: int, *inputs: torch.Tensor
    ) -> Any:
        ctx.runtime = runtime
        ctx.index = index
        ctx.ticket = ticket
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.runtime._inputs_grad_done(ctx.index, ctx.ticket)
        return (None, None, None, *grads)


class BoundaryState(Enum):
    """Where a hook boundary stands in the training step (like FSDP2's ``TrainingState``)."""

    #: Between steps, or forward done and backward not yet reached.
    IDLE = "idle"
    #: Backward reached the boundary: its buffers are unsharded and its views registered.
    PRE_BACKWARD = "pre_backward"


class Boundary:
    """One hook boundary: its module, its flat buffer and its backward bookkeeping."""

    def __init__(self, name: str, module: nn.Module, buffer: FlatBuffer) -> None:
        self.name = name
        self.module = module
        self.buffer = buffer
        self.state = BoundaryState.IDLE
        #: The forwards (by ticket) whose backward has not run yet, each with whether its
        #: inputs carry gradients (then it is done when they get theirs; else at the end
        #: of the backward that reaches it). Two forwards before two backwards (GPipe's
        #: order) leave the second pending through the first backward.
        self.pending: dict[int, bool] = {}
        #: The tickets the running backward reached.
        self.covered: set[int] = set()
        #: Whether the running backward already reduced this boundary's gradients.
        self.reduced = False
        #: The ticket of the forward running now (``None``: it needs no backward).
        self.forward_ticket: int | None = None
        self._hooked: set[int] = set()

    @property
    def awaits_backward(self) -> bool:
        """Whether a forward of this boundary waits for its gradients to be reduced."""
        return bool(self.pending)

    def grad_leaves(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(fqn, full-tensor view) pairs whose gradients this boundary reduces."""
        for view in self.buffer.views:
            yield view.name, view.leaf

    def sync_requires_grad(self, on_grad: Any) -> bool:
        """Leaves follow their holders' ``requires_grad``; return whether any needs grads.

        ``on_grad(fqn)`` becomes a post-accumulate-grad hook of each leaf the first time it
        needs gradients.
        """
        needs = self.buffer.sync_requires_grad()
        for fqn, leaf in self.grad_leaves():
            if leaf.requires_grad and id(leaf) not in self._hooked:
                self._hooked.add(id(leaf))
                leaf.register_post_accumulate_grad_hook(lambda _t, fqn=fqn: on_grad(fqn))
        return needs

    def fold_into_total(self, fqn: str) -> None:
        """Add view ``fqn``'s fresh gradient to its holder's ``no_sync`` total at once and
        drop it, as torch accumulates ``.grad`` in place: the boundary's gradients are
        then not all alive beside their totals until its backward ends."""
        for view in self.buffer.views:
            if view.name == fqn:
                gradients.fold_into_total(view.holder, view.leaf)
                return

    def register_views(self) -> None:
        """Put the full-matrix views on their modules (forward and recomputation use them)."""
        for view in self.buffer.views:
            view.module._parameters[view.attr] = view.leaf

    def register_params(self) -> None:
        """Put the registered parameters (master / placeholder) back on their modules."""
        for view in self.buffer.views:
            view.module._parameters[view.attr] = view.holder

    def covered_by_fsdp(self, root: nn.Module) -> bool:
        """Whether ``fully_shard`` wraps this boundary's module or one of its ancestors."""
        return self.fsdp_module(root) is not None

    def fsdp_module(self, root: nn.Module) -> nn.Module | None:
        """The innermost module ``fully_shard`` wraps among this boundary's module and its
        ancestors (its mixed-precision policy is the boundary's), or None."""
        module: nn.Module = root
        found = module if is_fsdp_module(module) else None
        for part in self.name.split(".") if self.name else []:
            module = module.get_submodule(part)
            if is_fsdp_module(module):
                found = module
        return found
