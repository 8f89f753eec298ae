"""Newton-Schulz orthogonalization: the quintic iteration and its workspaces.

Muon replaces a gradient (momentum) matrix ``G = U S Vᵀ`` by an approximation of its
orthogonal polar factor ``U Vᵀ``. The approximation is a fixed number of quintic
Newton-Schulz steps on the Frobenius-normalized matrix:

```text
A = X Xᵀ
B = b·A + c·A·A
X ← a·X + B·X
```

with the coefficients of `dmuon.optim._coefficients` (``"keller"``, or ``"polar_express"``
by default).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dmuon.optim._blocks import Allocate, Arena, SymmetricProduct
from dmuon.optim._coefficients import (
    COEFFICIENT_SETS,
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_PUBLISHED_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY_FACTOR,
    Coefficients,
    CoefficientTriple,
    _is_real,
    resolve_coefficients,
)
from dmuon.optim._gram import (
    GRAM_MIN_ASPECT,
    GRAM_RESTARTS,
    gram_dtype,
    iteration_dtype,
    run_gram,
    uses_gram,
)

__all__ = [
    "COEFFICIENT_SETS",
    "GRAM_MIN_ASPECT",
    "GRAM_RESTARTS",
    "KELLER_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY_FACTOR",
    "CoefficientTriple",
    "Coefficients",
    "NewtonSchulzWorkspace",
    "cpu_bf16_unit",
    "cpu_has_native_bf16",
    "default_ns_dtype",
    "gram_dtype",
    "iteration_dtype",
    "newton_schulz",
    "resolve_coefficients",
    "uses_gram",
    "workspace_nbytes",
]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX-BF16 or AVX512-BF16):
    whether `cpu_bf16_unit` names a unit. Computed once."""
    return _cpu_bf16_unit() is not None


def cpu_bf16_unit() -> str | None:
    """The unit this CPU multiplies bfloat16 matrices with: ``"AMX-BF16"`` (what oneDNN uses
    where both exist), ``"AVX512-BF16"``, or ``None`` where such products are emulated.

    Asked of torch's own CPU feature probe (``torch.cpu._is_amx_tile_supported`` and
    ``torch.cpu._is_avx512_bf16_supported``, the checks its oneDNN kernels dispatch on), with
    the ``amx_bf16`` / ``avx512_bf16`` flags of ``/proc/cpuinfo`` as a fallback. Computed once.
    """
    return _cpu_bf16_unit()


_BF16_UNITS = (
    ("AMX-BF16", "_is_amx_tile_supported", "amx_bf16"),
    ("AVX512-BF16", "_is_avx512_bf16_supported", "avx512_bf16"),
)
"""Each native bfloat16 unit, preferred first: its name, torch's probe, its cpuinfo flag."""


@functools.cache
def _cpu_bf16_unit() -> str | None:
    for unit, probe_name, _ in _BF16_UNITS:
        probe = getattr(torch.cpu, probe_name, None)
        if probe is not None:
            try:
                if bool(probe()):
                    return unit
            except RuntimeError:  # pragma: no cover - probe unavailable on this build
                pass
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return next((unit for unit, _, flag in _BF16_UNITS if flag in flags), None)
    except OSError:
        pass
    return None


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """The iteration dtype used when ``dtype=None``, decided by what the device multiplies fast.

    * CUDA: bfloat16 (tensor cores; ``torch.optim.Muon``'s choice).
    * CPU with AMX-BF16 or AVX512-BF16 (`cpu_has_native_bf16`): bfloat16, which these
      units multiply natively (measured: the optimizer step in float32 takes 2.5 to 4
      times as long on both kinds).
    * Any other CPU or device: float32. Without those units bfloat16 matrix products are
      emulated through float32 and are slower than float32 itself.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be None or a floating torch.dtype (e.g. torch.bfloat16, "
            f"torch.float32), got {dtype!r}"
        )


def _check_eps(eps: object) -> float:
    if not _is_real(eps) or not (float(eps) > 0.0 and math.isfinite(float(eps))):
        raise ValueError(f"eps must be a finite float > 0 (default 1e-7), got {eps!r}")
    return float(eps)


CPU_ONE_AT_A_TIME_MIN_SIDE: int = 512
"""Short side from which a CPU workspace iterates its matrices one at a time, not batched."""


CPU_SYMMETRIC_BLOCKS: bool = True
"""Whether CPU matrices iterated one at a time compute their symmetric products by blocks."""


class NewtonSchulzWorkspace:
    """Preallocated buffers to orthogonalize a batch of same-shape matrices without allocating.

    Callers write the matrices into `source` (or the views of `source_views`) in their own
    ``rows x cols`` orientation, then call `run`, which returns the results in the same
    orientation and the iteration dtype. Keeping the caller's orientation makes every
    elementwise pass of the optimizer (momentum, normalization, the update) read and write
    contiguous memory; only the iterate is laid out for the matrix products.

    Args:
        batch: number of matrices.
        rows, cols: the shape of each matrix as the caller sees it.
        dtype: iteration dtype.
        device: where the buffers live.
        gram: use the Gram iteration where `uses_gram` says so (aspect ratio, dtype).
        allocate: ``allocate(shape, dtype)`` makes every buffer (default: ``torch.empty``
            on ``device``); an `Arena` lets workspaces that never run at the same time
            share their memory.
        out_dtype: the dtype `cast` will be asked for (the weights'), so that its buffer
            is made with the others; another one is allocated on first use.
    """

    def __init__(
        self,
        batch: int,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        device: torch.device,
        gram: bool = True,
        allocate: Allocate | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        empty = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
        self.gram = uses_gram(rows, cols, gram, dtype)
        dtype = iteration_dtype(rows, cols, gram, dtype)
        self.dtype = dtype
        self.short, self.long = min(rows, cols), max(rows, cols)
        tall = rows > cols
        norm_dtype = torch.promote_types(dtype, torch.float32)
        self.source = empty((batch, rows, cols), norm_dtype)
        """The matrices to orthogonalize (float32, or float64); `run` may overwrite them."""
        self.source_views = list(self.source.unbind(0))
        """One view per matrix of `source`."""
        self._norm = empty((batch, 1, 1), norm_dtype)
        # The iterate keeps the caller's orientation, so no pass transposes memory: a wide
        # matrix iterates on X (short x long), a tall one on Xᵀ (long x short) with every
        # product transposed to match (A = X Xᵀ, B and the Gram polynomials are symmetric,
        # so the results are the same matrices). Measured on AMX: the transposed copies
        # cost more than iterating long-side-first saves. One exception: oneDNN's CPU
        # bfloat16 GEMM without AMX/AVX512-BF16 is several times faster when its second
        # operand is transposed (measured 5x on 256x768 matrices, AVX2), which only the
        # long-side-first iteration gives, so there every matrix iterates long-side-first.
        emulated_bf16 = (
            torch.device(device).type == "cpu"
            and dtype == torch.bfloat16
            and not self.gram
            and not cpu_has_native_bf16()
        )
        self._long_first = tall or emulated_bf16
        self._result_transposed = tall != self._long_first
        if self._long_first:
            layout = (batch, self.long, self.short)
        else:
            layout = (batch, self.short, self.long)
        if norm_dtype == dtype and not self._result_transposed:
            self._x = self.source  # the iteration starts on the normalized source
        else:
            self._x = empty(layout, dtype)
        self._y = empty(layout, dtype)
        # X ← aX + BX as X ← (aI + B)X, with a on B's diagonal: the product then writes Y
        # without first copying X into it (baddbmm's beta term), a pass over the long side
        # saved per step. Only at 32 bits or more: in bfloat16 the rounded diagonal a + Bᵢᵢ
        # costs accuracy (measured: the smallest singular value fell below the band).
        self._fold_identity = torch.finfo(dtype).bits >= 32
        if self.gram:
            self._iterate = run_gram
        elif self._long_first:
            self._iterate = NewtonSchulzWorkspace._run_long_first
        else:
            self._iterate = NewtonSchulzWorkspace._run_standard
        square = (batch, self.short, self.short)
        count = 5 if self.gram else 2
        self._small = [empty(square, dtype) for _ in range(count)]
        self._empty = empty
        self._cast_buffers: dict[torch.dtype, Tensor] = {}
        if out_dtype is not None and out_dtype != dtype:
            self._cast_buffers[out_dtype] = empty((batch, rows, cols), out_dtype)
        self._plan_chunks(batch, device, emulated_bf16)

    def _plan_chunks(self, batch: int, device: torch.device, emulated_bf16: bool) -> None:
        """Cut the batch into the pieces one pass iterates together, and plan their products."""
        empty, dtype = self._empty, self.dtype
        # On a CPU, matrices with a short side of CPU_ONE_AT_A_TIME_MIN_SIDE or more iterate
        # one at a time: each one's products then stay in cache (measured on AMX: 8-20%
        # faster from 512 up, while smaller ones are up to 2x faster batched).
        one_at_a_time = (
            torch.device(device).type == "cpu" and self.short >= CPU_ONE_AT_A_TIME_MIN_SIDE
        )
        step = 1 if one_at_a_time else batch
        self._chunks = [
            (
                self._x[lo : lo + step],
                self._y[lo : lo + step],
                [m[lo : lo + step] for m in self._small],
            )
            for lo in range(0, batch, step)
        ]
        # Matrices iterated one at a time compute the two symmetric products, A = X Xᵀ and
        # A·A, by 2 x 2 blocks: the upper three blocks and a mirrored copy, a quarter of
        # those products' work saved (see `SymmetricProduct`).
        self._blocked = (
            one_at_a_time and CPU_SYMMETRIC_BLOCKS and not self.gram and not emulated_bf16
        )
        if self._blocked:
            self._iterate = NewtonSchulzWorkspace._run_blocked
            h = self.short // 2
            scratch = empty((h, self.short - h), dtype)
            scratch_t = empty((self.short - h, h), dtype)
            self._chunks = [
                (x, y, self._plan_blocked(x, y, small, scratch, scratch_t))
                for x, y, small in self._chunks
            ]

    def run(self, triples: Sequence[CoefficientTriple], eps: float) -> Tensor:
        """Normalize `source` and iterate; returns ``(batch, rows, cols)`` in the iteration dtype.

        The returned tensor (a buffer, or a transposed view of one) is owned by the
        workspace: read it before the next `run`.
        """
        self.normalize_source(eps)
        if self._x is not self.source:
            # (torch.div(..., out=) into another dtype would allocate a temporary.)
            self._x.copy_(self.source.mT if self._result_transposed else self.source)
        for x, y, small in self._chunks:
            last = self._iterate(self, x, y, small, triples)
        result = self._y if last is y else self._x  # every chunk ends in the same buffer
        return result.mT if self._result_transposed else result

    def normalize_source(self, eps: float) -> None:
        """Divide each matrix of `source` by its Frobenius norm (at least ``eps``), in
        place: what `run` iterates from, and what a split iteration starts from."""
        torch.linalg.vector_norm(self.source, dim=(-2, -1), keepdim=True, out=self._norm)
        self._norm.clamp_min_(eps)
        self.source.div_(self._norm)

    def cast(self, result: Tensor, dtype: torch.dtype) -> Tensor:
        """``result`` (from `run`) in ``dtype``, copied into a buffer kept for the next call."""
        if result.dtype == dtype:
            return result
        buffer = self._cast_buffers.get(dtype)
        if buffer is None:
            buffer = self._cast_buffers[dtype] = self._empty(tuple(self.source.shape), dtype)
        return buffer.copy_(result)

    def _run_long_first(
        self, Xt: Tensor, Yt: Tensor, small: list[Tensor], triples: Sequence[CoefficientTriple]
    ) -> Tensor:
        # The standard iteration on Xt = Xᵀ: A = Xtᵀ Xt, B = bA + cA·Aᵀ, Xt ← a·Xt + Xt·Bᵀ.
        A, B = small
        for a, b, c in triples:
            torch.bmm(Xt.mT, Xt, out=A)
            torch.baddbmm(A, A, A.mT, beta=b, alpha=c, out=B)
            if self._fold_identity:
                B.diagonal(dim1=-2, dim2=-1).add_(a)
                torch.bmm(Xt, B.mT, out=Yt)
            else:
                torch.baddbmm(Xt, Xt, B.mT, beta=a, out=Yt)
            Xt, Yt = Yt, Xt
        return Xt

    def _run_standard(
        self, X: Tensor, Y: Tensor, small: list[Tensor], triples: Sequence[CoefficientTriple]
    ) -> Tensor:
        A, B = small
        for a, b, c in triples:
            torch.bmm(X, X.mT, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
            if self._fold_identity:
                B.diagonal(dim1=-2, dim2=-1).add_(a)
                torch.bmm(B, X, out=Y)
            else:
                torch.baddbmm(X, B, X, beta=a, out=Y)
            X, Y = Y, X
        return X

    def _run_blocked(
        self, X: Tensor, Y: Tensor, plans: Any, triples: Sequence[CoefficientTriple]
    ) -> Tensor:
        # ``plans``: this chunk's `_plan_blocked`, for an iterate in X and for one in Y.
        for a, b, c in triples:
            gram_of_x, square_of_a, diagonal, left, right, X2, Y2 = plans[0]
            gram_of_x()
            square_of_a(beta=b, alpha=c)
            if self._fold_identity:
                diagonal.add_(a)
                torch.mm(left, right, out=Y2)
            else:
                torch.addmm(X2, left, right, beta=a, out=Y2)
            X, Y = Y, X
            plans = plans[::-1]
        return X

    def _plan_blocked(
        self, X: Tensor, Y: Tensor, small: list[Tensor], scratch: Tensor, scratch_t: Tensor
    ) -> list[tuple[Any, ...]]:
        """Every view one step of `_run_blocked` uses, made once: the chunk's matrix as 2-D
        views (torch's 2-D products write into a block of a larger matrix in place, where
        the batched ones copy through a temporary), for an iterate in ``X`` and in ``Y``."""
        A, B = (m[0] for m in small)
        square_of_a = SymmetricProduct(B, A, scratch, scratch_t, add=A)
        plans = []
        for src, dst in ((X[0], Y[0]), (Y[0], X[0])):
            # X ← aX + B·X, or Xᵀ ← aXᵀ + Xᵀ·Bᵀ on the long-first layout.
            left, right = (src, B.mT) if self._long_first else (B, src)
            gram = SymmetricProduct(A, src.mT if self._long_first else src, scratch, scratch_t)
            plans.append((gram, square_of_a, B.diagonal(), left, right, src, dst))
        return plans


def _newton_schulz_unchecked(
    G: Tensor,
    triples: Sequence[CoefficientTriple],
    dtype: torch.dtype,
    eps: float,
    gram: bool = False,
) -> Tensor:
    """The iteration itself, for a validated 2-D or 3-D input; returns ``G``'s dtype."""
    batched = G.dim() == 3
    G3 = G if batched else G.unsqueeze(0)
    batch, rows, cols = G3.shape
    ws = NewtonSchulzWorkspace(batch, rows, cols, dtype, G.device, gram=gram)
    ws.source.copy_(G3)
    X = ws.run(triples, eps).to(G.dtype)
    return X if batched else X.squeeze(0)


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: Coefficients = "polar_express",
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    gram: bool = False,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ``.

    ``G`` is normalized by its Frobenius norm (clamped below at ``eps``) in float32 (float64
    when ``dtype`` is float64), cast to ``dtype``, and run through ``steps`` quintic
    Newton-Schulz steps on its short side (tall matrices are transposed and transposed back).

    Args:
        G: a matrix ``(m, n)``, or a batch ``(B, m, n)`` orthogonalized matrix by matrix
            (each with its own norm).
        steps: number of steps, honoured exactly (>= 1).
        coefficients: ``"polar_express"`` (default), ``"keller"``, one triple ``(a, b, c)``
            for every step, or a per-step sequence of triples (see `resolve_coefficients`).
        dtype: the iteration dtype; ``None`` means `default_ns_dtype` of ``G``'s device
            (bfloat16 on CUDA and on CPUs that multiply it natively, float32 elsewhere).
        eps: lower clamp of the norm, so a zero matrix maps to zero.
        gram: iterate on the short side's Gram matrix ``X Xᵀ`` and apply the result to the
            matrix once, for matrices at least `GRAM_MIN_ASPECT` times wider than tall (or
            taller than wide; see `uses_gram`); other matrices take the standard
            iteration. Equal to the standard iteration in exact arithmetic; in float32 the
            two differ by at most 4e-5 per entry (measured, see the Newton-Schulz docs
            page). With a 16-bit ``dtype`` it runs in float16 with restarts
            (`GRAM_RESTARTS`), and its result comes back through float16.

    Returns:
        A tensor of ``G``'s shape and dtype.

    Raises:
        ValueError: ``G`` is not 2-D/3-D or holds NaN/Inf, ``steps < 1``, an unknown
            coefficient name, a malformed triple, a non-floating ``dtype`` or ``eps <= 0``.
    """
    if not isinstance(G, Tensor):
        raise ValueError(f"G must be a torch.Tensor, got {type(G).__name__}")
    if G.dim() not in (2, 3):
        raise ValueError(
            f"newton_schulz needs a matrix (m, n) or a batch of matrices (B, m, n), got "
            f"shape {tuple(G.shape)}; reshape it to 2-D first (e.g. G.view(G.size(0), -1)), "
            "or optimize 1-D parameters with AdamW"
        )
    if not G.is_floating_point():
        raise ValueError(f"G must be a floating tensor, got dtype {G.dtype}")
    triples = resolve_coefficients(coefficients, steps)
    if dtype is None:
        dtype = default_ns_dtype(G.device)
    _check_dtype(dtype)
    eps = _check_eps(eps)
    if not bool(torch.isfinite(G).all()):
        raise ValueError(
            "G contains NaN or Inf; check the loss and gradients for overflow (lower the "
            "learning rate, enable gradient clipping or use a loss scaler) before "
            "orthogonalizing"
        )
    return _newton_schulz_unchecked(G, triples, dtype, eps, gram=bool(gram))


def workspace_nbytes(
    batch: int,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    device: torch.device,
    gram: bool = False,
    out_dtype: torch.dtype | None = None,
) -> int:
    """Bytes a `NewtonSchulzWorkspace` of ``batch`` ``rows x cols`` matrices takes when
    carved from an `Arena`, computed on the meta device (nothing is allocated)."""
    measure, used = Arena(torch.device("meta")).carver(measure_only=True)
    NewtonSchulzWorkspace(
        batch, rows, cols, dtype, device, gram=gram, allocate=measure, out_dtype=out_dtype
    )
    return used()
