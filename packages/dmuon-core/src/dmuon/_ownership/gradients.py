"""The gradients of dedicated parameters: the only module that writes them.

Two attributes carry them, on the parameters a `DedicatedParam` names:

- ``_reduced_grad`` on an owner's master (``dp.param``): the averaged gradient of the
  global batch, what ``dmuon.Muon`` steps on;
- ``_accumulated_grad`` on the parameter a module holds between forwards (the master or
  placeholder, or a split stack's placeholder): the local sum of the backwards run under
  `dmuon.no_sync`, merged into the next synchronised backward.

The parameter a module holds also gets a ``.grad``: a *marker*, a zero-storage tensor of
the parameter's shape (`GradientMarker`), set whenever this module stores gradient state
for it. The marker is what the rest of PyTorch sees:

- ``model.zero_grad()`` (also on a ``DistributedDataParallel`` wrapper, or Hugging Face's
  Trainer calling it) sets it to ``None`` or zeroes it in place; the stored gradients are
  then cleared or zeroed accordingly the next time they are read, exactly as the
  parameters' own ``.grad`` would be;
- ``.grad.mul_(s)`` and ``.grad.div_(s)`` with a number ``s`` (torch's pipeline schedules
  dividing by the micro-batch count) scale the stored gradients, on every rank alike;
- ``torch.nn.utils.clip_grad_norm_`` (and any other norm, or arithmetic of ``.grad``)
  raises a `DedicatedGradientError` that names `dmuon.clip_grad_norm_`, instead of
  computing a norm that misses the dedicated gradients. Every rank holds a marker for
  every dedicated parameter it has gradients for, so every rank raises alike.

Gradient state written through other channels (a test assigning ``_reduced_grad`` by hand)
is taken as it is: a marker only governs state this module stored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

#: Hook boundaries whose gradient reduces may be in flight behind the one issued last.
#: Older ones are waited on during backward and their float32 reduce inputs released, so a
#: rank holds at most this many plus two boundaries' gradients at once (these, the one
#: issued last, and one whose cross-replica reduce-scatter is in flight), not the model's.
REDUCES_IN_FLIGHT = 2

REDUCED = "_reduced_grad"
ACCUMULATED = "_accumulated_grad"
_MARKER = "_dmuon_grad_marker"

_HINT = (
    "The averaged gradient of a dedicated matrix lives on its owner rank (as "
    "`_reduced_grad`), not in `.grad`, which holds a zero-storage marker: functions that read "
    "`.grad` (torch.nn.utils.clip_grad_norm_, a GradScaler, per-parameter norms) would miss "
    "it and compute a different result on every rank. Clip with "
    "dmuon.clip_grad_norm_(model, max_norm) and read the norm with optimizer.grad_norm()."
)

#: In-place ops that clear a gradient: ``zero_grad(set_to_none=False)`` calls them.
_ZEROING = {"zero_", "_foreach_zero_"}
#: In-place scalings by a number, applied to the stored gradients.
_SCALING = {"mul_": lambda s: s, "div_": lambda s: 1.0 / s}
#: Reading attributes and metadata is harmless.
_METADATA = {
    "__get__",
    "__repr__",
    "__format__",
    "size",
    "dim",
    "numel",
    "is_floating_point",
    "is_complex",
    "requires_grad_",
    "detach_",
    "stride",
    "element_size",
    "data_ptr",
    "untyped_storage",
    "storage_offset",
    "is_contiguous",
    "__reduce_ex__",
}


class DedicatedGradientError(RuntimeError):
    """An operation read or changed a dedicated parameter's ``.grad`` marker."""


class GradientMarker(torch.Tensor):
    """The ``.grad`` of a dedicated parameter: the parameter's shape, no storage of its own.

    ``zero_()`` (``zero_grad(set_to_none=False)``) marks the stored gradients zeroed; any
    arithmetic raises `DedicatedGradientError` with the fix.
    """

    #: Set by ``zero_()``: the stored gradients are to be zeroed when next read.
    _zeroed: bool
    #: The parameters whose averaged gradients this marker governs.
    _governed: list[nn.Parameter]
    #: The parameter whose ``.grad`` this marker is.
    _holder: nn.Parameter

    @staticmethod
    def create(like: torch.Tensor) -> GradientMarker:
        """A marker with ``like``'s shape, dtype and device (one element of storage)."""
        base = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
        marker = torch.Tensor._make_subclass(GradientMarker, base)
        marker._zeroed = False
        return marker

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"GradientMarker(shape={tuple(self.shape)}): DMuon keeps this dedicated "
            "parameter's gradient on its owner as `_reduced_grad`"
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _ZEROING:
            flat, _ = tree_flatten((args, kwargs))
            for value in flat:
                if isinstance(value, GradientMarker):
                    value._zeroed = True
            others = [
                [t for t in arg if not isinstance(t, GradientMarker)]
                if isinstance(arg, (list, tuple))
                else arg
                for arg in args
            ]
            if name == "_foreach_zero_" and others and others[0]:
                torch._foreach_zero_(others[0])
            return args[0]
        if name in _SCALING and len(args) == 2 and not kwargs and isinstance(args[0], cls):
            factor = _number(args[1])
            if factor is not None:
                _scale_stored(args[0], _SCALING[name](factor))
                return args[0]
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in ("to", "cuda", "cpu", "double", "float", "half", "bfloat16", "_apply"):
            raise DedicatedGradientError(
                "the model was moved (or cast) while gradients wait for optimizer.step(): "
                "move it before the backward, or after optimizer.step() and "
                "optimizer.zero_grad()"
            )
        raise DedicatedGradientError(f"{name or func} on a dedicated parameter's .grad. {_HINT}")


def _number(value: Any) -> float | None:
    """``value`` as a number, if it is one (a Python number or a one-element tensor)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    one_element = isinstance(value, torch.Tensor) and value.numel() == 1
    if one_element and not isinstance(value, GradientMarker):
        return float(value)
    return None


def _scale_stored(marker: GradientMarker, factor: float) -> None:
    """Multiply every gradient ``marker`` governs by ``factor`` (``.grad.mul_``)."""
    holder = marker._holder
    _refresh(holder)
    for target in {id(p): p for p in (holder, *marker._governed)}.values():
        for attr in (REDUCED, ACCUMULATED):
            grad = getattr(target, attr, None)
            if grad is not None:
                grad.mul_(factor)


def _marker_of(holder: nn.Parameter) -> GradientMarker | None:
    return getattr(holder, _MARKER, None)


def _refresh(holder: nn.Parameter) -> None:
    """Apply what the rest of PyTorch did to ``holder``'s marker since state was stored."""
    marker = _marker_of(holder)
    if marker is None:
        return
    if holder.grad is not marker:
        clear([holder], set_to_none=True)
    elif marker._zeroed:
        marker._zeroed = False
        clear([holder], set_to_none=False)


def _mark(holder: nn.Parameter, param: nn.Parameter) -> None:
    """Put the marker on ``holder.grad``; it governs ``param``'s averaged gradient too."""
    marker = _marker_of(holder)
    if marker is None:
        marker = GradientMarker.create(holder)
        marker._governed = []
        marker._holder = holder
        setattr(holder, _MARKER, marker)
    if not any(p is param for p in marker._governed):
        marker._governed.append(param)
    if holder.grad is not marker:
        holder.grad = marker


def is_plain_grad(holder: nn.Parameter) -> bool:
    """Whether autograd wrote ``holder.grad`` itself: a forward reached the module's
    parameter without its hook boundary (nothing of DMuon's stored it)."""
    grad = holder.grad
    return grad is not None and not isinstance(grad, GradientMarker)


def reduced(param: nn.Parameter, holder: nn.Parameter | None = None) -> torch.Tensor | None:
    """The owner's averaged gradient of ``param`` (``None`` when it has none).

    ``holder`` is the parameter the module holds (default: ``param`` itself).
    """
    _refresh(holder if holder is not None else param)
    return getattr(param, REDUCED, None)


def accumulated(holder: nn.Parameter) -> torch.Tensor | None:
    """The local `no_sync` total held on ``holder`` (``None`` when nothing accumulated)."""
    _refresh(holder)
    return getattr(holder, ACCUMULATED, None)


def accumulate(holder: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` (as float32) to ``holder``'s local `no_sync` total."""
    acc = accumulated(holder)
    if acc is None:
        # A copy: the gradient may be a view of a buffer that is reused.
        setattr(holder, ACCUMULATED, grad.detach().to(torch.float32, copy=True))
    else:
        acc.add_(grad.detach())
    _mark(holder, holder)


def fold_into_total(holder: nn.Parameter, leaf: nn.Parameter) -> None:
    """Add ``leaf.grad`` to ``holder``'s ``no_sync`` total now and drop it, where a total
    exists and the gradient is a plain tensor of its shape (a DTensor's waits for its
    boundary). The total is float32 whatever the gradient's dtype, as `accumulate` keeps
    it; the reduce or the next accumulation then finds the sum alone, the same sum they
    would have made."""
    acc = accumulated(holder)
    grad = leaf.grad
    if acc is None or grad is None or type(grad) is not torch.Tensor:
        return
    if grad.shape != acc.shape:
        return
    acc.add_(grad.detach())
    leaf.grad = None


def mark(holder: nn.Parameter) -> None:
    """Put the marker on ``holder.grad``: a backward produced gradients for it, wherever
    they are kept (on every rank, so that every rank sees the same ``.grad``)."""
    _mark(holder, holder)


def take_accumulated(holder: nn.Parameter) -> torch.Tensor | None:
    """Remove and return ``holder``'s local `no_sync` total (``None`` when there is none).

    The caller merges it into a reduction, which stores its result with `add_reduced`.
    """
    acc = accumulated(holder)
    if acc is not None:
        setattr(holder, ACCUMULATED, None)
    return acc


def add_reduced(param: nn.Parameter, piece: torch.Tensor, holder: nn.Parameter | None) -> None:
    """Add an averaged gradient to ``param._reduced_grad``, what the optimizer steps on.

    ``holder`` is the parameter its module holds (default ``param``), whose ``.grad`` gets
    the marker.
    """
    holder = holder if holder is not None else param
    current = reduced(param, holder)
    if current is None:
        setattr(param, REDUCED, piece)
    else:
        current.add_(piece)
    _mark(holder, param)


def is_absent(first: float, norm: float) -> bool:
    """Whether an averaged gradient says that no rank had a gradient for its matrix.

    ``first`` is the gradient's first element and ``norm`` its norm. A rank without a
    gradient contributes ``-0.0`` everywhere, a rank with one never ``-0.0``; IEEE sums
    (and the division by the world size, and clipping's positive scale) keep ``-0.0``
    only where every term was ``-0.0``, so such a gradient is all ``-0.0``. The optimizer
    leaves it alone, as torch's leave a ``.grad`` of ``None``; zeros stored by
    ``zero_grad(set_to_none=False)`` are ``+0.0``: a gradient, as in torch.
    """
    return norm == 0.0 and math.copysign(1.0, first) < 0


def scale_reduced(grads: Iterable[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply averaged gradients (from `reduced`) in place: gradient clipping."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel():
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), same in by_kind.items():
        torch._foreach_mul_(same, scale.to(device, dtype))


def clear(holders: Iterable[nn.Parameter], set_to_none: bool = True) -> None:
    """Clear (``None``) or zero the gradients stored for ``holders``.

    A holder's marker names the parameters whose averaged gradients it governs (a stack
    split by experts: every range's master); those are cleared with it. Zeroed gradients
    are gradients: the optimizer steps on them, as torch's do after
    ``zero_grad(set_to_none=False)``.
    """
    for holder in holders:
        marker = _marker_of(holder)
        params = [holder, *(marker._governed if marker is not None else [])]
        for target in params:
            for attr in (REDUCED, ACCUMULATED):
                grad = getattr(target, attr, None)
                if grad is None:
                    continue
                if set_to_none:
                    setattr(target, attr, None)
                else:
                    grad.zero_()
        if set_to_none and marker is not None:
            if holder.grad is marker:
                holder.grad = None
            delattr(holder, _MARKER)
