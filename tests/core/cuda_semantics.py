"""CUDA's arithmetic where it differs from CPU's, reproduced on CPU for tests.

A 0-dim floating tensor multiplying (or added to) a 16-bit tensor does not take part in
type promotion, and CUDA's kernels then compute in the 16-bit dtype with the 0-dim
operand rounded to it first (``torch._foreach_*`` takes the same per-tensor path when the
scalar's dtype differs from the list's), where CPU's kernels read the 0-dim operand
whole. On one H200: ``torch._foreach_mul_([a_bf16], torch.tensor(0.998, device="cuda"))``
multiplies by 0.99609375. `cuda_scalar_rounding` makes every such call on CPU round the
0-dim operand to the 16-bit dtype first, so a CPU test sees what a GPU computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

HALF_TYPES = (torch.bfloat16, torch.float16)
#: Elementwise ops whose 0-dim operand CUDA rounds to a 16-bit operand's dtype.
ROUNDING_OPS = frozenset(
    {"mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "lerp", "lerp_", "addcmul_"}
)
FOREACH_OPS = frozenset(
    {"_foreach_mul", "_foreach_mul_", "_foreach_add", "_foreach_add_", "_foreach_div_"}
)


def _half_dtype(args: tuple[Any, ...]) -> torch.dtype | None:
    for arg in args:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        for item in items:
            if isinstance(item, torch.Tensor) and item.dim() > 0 and item.dtype in HALF_TYPES:
                return item.dtype
    return None


def _rounded(arg: Any, dtype: torch.dtype) -> Any:
    if (
        isinstance(arg, torch.Tensor)
        and arg.dim() == 0
        and arg.dtype.is_floating_point
        and arg.dtype != dtype
    ):
        return arg.to(dtype)
    return arg


class _CudaScalarRounding(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ROUNDING_OPS or name in FOREACH_OPS:
            dtype = _half_dtype(args)
            if dtype is not None:
                args = tuple(_rounded(a, dtype) for a in args)
                kwargs = {k: _rounded(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextmanager
def cuda_scalar_rounding() -> Iterator[None]:
    """Within the block, CPU rounds 0-dim factors of 16-bit tensors as CUDA does."""
    with _CudaScalarRounding():
        yield
