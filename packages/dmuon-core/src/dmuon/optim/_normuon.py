"""NorMuon: per-neuron second-moment normalization of Muon's orthogonalized update.

NorMuon (arXiv 2510.05491) keeps Muon's momentum and Newton-Schulz, then evens out the
update's rows. For the orthogonalized matrix ``O`` of a weight ``W`` (``out x in``):

```text
v = mean(O ** 2, over in)              # one value per output neuron, shape (out, 1)
s = lerp(s, v, 1 - beta2)              # second moment, kept per matrix
N = O / (sqrt(s) + NORMUON_EPS)        # row by row
N = N * (||O||_F / ||N||_F)            # the update keeps O's Frobenius norm
```

after which Muon's learning-rate adjustment and decoupled weight decay apply unchanged.

The second moment is per output neuron whatever the storage layout: a transposed
``(in, out)`` matrix (``Conv1D``) is normalized column by column, so it gets the update of
the same ``nn.Linear``. Its buffer has shape ``(out, 1)`` per matrix, ``(matrices, out, 1)``
for a 3-D stack, and lives with the momentum on the owner (``state["second_moment_buffer"]``,
float32, or float64 for float64 weights). A matrix split into parts (``split``) shares its
buffer: the parts are row ranges of the same output neurons, and each part keeps its own
Frobenius norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from dmuon._ownership.param import DedicatedParam

__all__ = [
    "NORMUON_EPS",
    "SECOND_MOMENT",
    "VARIANTS",
    "normalize_rows_",
    "second_moment_record",
    "second_moment_shape",
]

VARIANTS: tuple[str, ...] = ("muon", "normuon")
"""Accepted values of ``dmuon.Muon(variant=...)``."""

NORMUON_EPS = 1e-10
"""Added to ``sqrt(s)`` before dividing (NorMuon's published value)."""

SECOND_MOMENT = "second_moment_buffer"
"""Optimizer-state key of NorMuon's per-neuron second moment."""


def second_moment_shape(shape: Sequence[int], transposed: bool) -> tuple[int, ...]:
    """Shape of the second moment of a dedicated tensor of ``shape``: ``(*lead, out, 1)``."""
    out = shape[-1] if transposed else shape[-2]
    return (*shape[:-2], int(out), 1)


def second_moment_record(dp: DedicatedParam) -> DedicatedParam:
    """``dp`` with the second moment's shapes, for the checkpoint layouts.

    The layouts move any tensor of a record's ``shape`` (and ``stack_shape`` for a range
    of a split stack) between owners and state dicts; NorMuon is never tp-sharded.
    """
    stack = dp.stack_shape
    return replace(
        dp,
        shape=torch.Size(second_moment_shape(dp.shape, dp.transposed)),
        stack_shape=None
        if stack is None
        else torch.Size(second_moment_shape(stack, dp.transposed)),
        tp=None,
    )


def normalize_rows_(
    ortho: Tensor, seconds: Sequence[Tensor], beta2: float, transposed: bool
) -> Tensor:
    """Apply NorMuon to a batch of orthogonalized matrices; update their second moments.

    ``ortho`` is ``(batch, rows, cols)`` as stored; ``seconds[i]`` is matrix ``i``'s second
    moment, ``(out, 1)`` (``rows`` or, when ``transposed``, ``cols`` output neurons),
    updated in place. Computes in the second moments' dtype (float32, or float64 for float64
    weights) and returns the normalized batch in ``ortho``'s dtype (``ortho`` itself,
    overwritten, when the two dtypes agree).
    """
    o = ortho.to(seconds[0].dtype)
    neurons = -2 if transposed else -1  # the dimension averaged over: the inputs
    mean = o.square().mean(dim=neurons, keepdim=True)
    views = [s.mT for s in seconds] if transposed else list(seconds)
    torch._foreach_lerp_(views, list(mean.unbind(0)), 1 - beta2)
    frobenius = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
    normed = o.div_(torch.stack(views).sqrt_().add_(NORMUON_EPS))
    scale = frobenius.div_(
        torch.linalg.vector_norm(normed, dim=(-2, -1), keepdim=True).clamp_min_(1e-30)
    )
    normed.mul_(scale)
    return normed if normed.dtype == ortho.dtype else ortho.copy_(normed)


def check_normuon_layouts(group: dict[str, Any], dedicated: dict[int, DedicatedParam]) -> None:
    """Raise if a NorMuon group holds a matrix split by tensor parallelism."""
    split = [
        dedicated[id(p)].fqn
        for p in group["params"]
        if id(p) in dedicated and dedicated[id(p)].tp_sharded
    ]
    if split:
        raise ValueError(
            f"variant='normuon' does not support matrices split by tensor parallelism "
            f"yet ({split[:3]}); use variant='muon' for them (a param group of their own "
            "may set it), or leave them out of the tensor-parallel plan"
        )


def check_checkpoint_variants(
    groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]
) -> None:
    """Raise if a Muon group's variant differs from the checkpoint's (a checkpoint group
    without ``variant`` is Muon's)."""
    for index, (ours, saved) in enumerate(zip(groups, saved_groups, strict=False)):
        if ours.get("algorithm") != "muon" or saved.get("algorithm") != "muon":
            continue
        mine, theirs = ours["variant"], saved.get("variant", "muon")
        if mine != theirs:
            raise ValueError(
                f"param group {index} ({ours.get('name')!r}) is variant {mine!r}, the "
                f"checkpoint's is {theirs!r}; nothing was loaded. Create the optimizer "
                f"with variant={theirs!r} to resume, or load with "
                "dmuon.set_optimizer_state_dict(..., options=StateDictOptions("
                f"strict=False)) to continue as {mine!r} from the checkpoint's momenta"
            )
