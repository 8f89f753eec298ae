"""The Gram Newton-Schulz iteration: for an ``m x n`` matrix with ``n`` at least twice
``m``, iterate on the ``m x m`` Gram matrix and touch the long side only to form it and to
apply the result (and at each restart, in 16-bit dtypes).

Used by `dmuon.optim._orthogonalize.NewtonSchulzWorkspace` where `uses_gram` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from dmuon.optim._coefficients import CoefficientTriple


class NewtonSchulzWorkspace(Protocol):
    """What the Gram iteration reads of `dmuon.optim._orthogonalize.NewtonSchulzWorkspace`:
    its iteration dtype and whether the iterate is held as ``Xᵀ``."""

    dtype: torch.dtype
    _long_first: bool


GRAM_MIN_ASPECT: float = 2.0
"""Long side / short side from which ``gram=True`` switches to the Gram iteration.

Per step the standard iteration costs ``2·m²n + m³`` multiply-adds for an ``m x n`` matrix
(``m <= n``); the Gram iteration costs ``4·m³`` per step plus ``2·m²n`` once. Over five
steps the two break even near ``n = 2m``; beyond it the Gram iteration does less work.
"""


GRAM_RESTARTS: tuple[int, ...] = (2,)
"""Steps at which a 16-bit Gram iteration starts again from the matrix it reached.

In float16 the Gram matrix ``R = X Xᵀ`` squares the condition number; its rounding errors
grow with every polynomial applied to it. Before these steps the iterate ``X ← Q X`` is
formed on the long side and ``R`` computed afresh from it, so the later steps start from a
well-conditioned matrix (the remedy Dao AI Lab published for their Gram Newton-Schulz:
restart at step 2 of the Polar Express coefficients). Each restart costs two products on
the long side (``2·m²n`` multiply-adds) and saves ``3·m³`` on the short side.
"""


def uses_gram(rows: int, cols: int, gram: bool = True, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a ``rows x cols`` matrix is orthogonalized with the Gram iteration.

    True when ``gram`` is on and the long side is at least `GRAM_MIN_ASPECT` times the
    short one. In a 16-bit ``dtype`` the Gram iteration runs in float16 with restarts
    (`gram_dtype`, `GRAM_RESTARTS`), from a float32 normalization: never in bfloat16,
    whose 8 significant bits round the Gram matrix's small eigenvalues to negative values
    that the iteration then amplifies (measured: relative error up to 5e3 on a matrix whose
    singular values span 1e-2..1, where the standard bfloat16 iteration stays within 1.3e-2).
    """
    short, long = min(rows, cols), max(rows, cols)
    return gram and long >= GRAM_MIN_ASPECT * short


def gram_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a Gram iteration asked for in ``dtype`` runs in: float16 for a 16-bit
    ``dtype`` (10 significant bits where bfloat16 has 7), else ``dtype``."""
    return torch.float16 if torch.finfo(dtype).bits <= 16 else dtype


def iteration_dtype(rows: int, cols: int, gram: bool, dtype: torch.dtype) -> torch.dtype:
    """The dtype a ``rows x cols`` matrix iterates (and its result comes back) in."""
    return gram_dtype(dtype) if uses_gram(rows, cols, gram, dtype) else dtype


def gram_restarts(steps: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The steps of ``steps`` at which a Gram iteration in ``dtype`` restarts (16-bit only)."""
    if torch.finfo(dtype).bits > 16:
        return ()
    return tuple(k for k in GRAM_RESTARTS if 0 < k < steps)


def run_gram(
    ws: NewtonSchulzWorkspace,
    X0: Tensor,
    out: Tensor,
    small: list[Tensor],
    triples: Sequence[CoefficientTriple],
) -> Tensor:
    """The Gram iteration of one chunk of ``ws``: ``X0`` normalized in, the result in
    ``out`` (or in ``X0``'s buffer after an odd number of restarts), which it returns."""
    # Every iterate is X_k = Q_k X_0 with Q_k a polynomial of R_0 = X_0 X_0ᵀ, and
    # X_k X_kᵀ = h R h with h = aI + bR + cR² (all polynomials of R_0 commute). So the
    # iteration runs on short x short matrices and touches the long side twice, and
    # twice more at each restart (16-bit: `gram_restarts`), where X ← Q X and R is
    # formed afresh from it.
    R, Z, T, Q, Q2 = small
    restarts = gram_restarts(len(triples), ws.dtype)
    _gram_of(ws, X0, R)
    last = len(triples) - 1
    fresh = True
    for k, (a, b, c) in enumerate(triples):
        if k in restarts:
            _apply(ws, Q, X0, out)
            X0, out = out, X0
            _gram_of(ws, X0, R)
            fresh = True
        torch.baddbmm(R, R, R, beta=b, alpha=c, out=Z)  # Z = bR + cR²
        if fresh:
            Q.copy_(Z)
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = aI + Z
            fresh = False
        else:
            torch.baddbmm(Q, Z, Q, beta=a, out=Q2)  # Q = (aI + Z) Q
            Q, Q2 = Q2, Q
        if k < last and k + 1 not in restarts:
            torch.baddbmm(R, R, Z, beta=a, out=T)  # T = R h
            torch.baddbmm(T, Z, T, beta=a, out=R)  # R = h R h
    _apply(ws, Q, X0, out)
    return out


def _gram_of(ws: NewtonSchulzWorkspace, X: Tensor, R: Tensor) -> None:
    """``R = X Xᵀ`` of the iterate (held as ``Xᵀ`` on the long-first layout)."""
    if ws._long_first:
        torch.bmm(X.mT, X, out=R)
    else:
        torch.bmm(X, X.mT, out=R)


def _apply(ws: NewtonSchulzWorkspace, Q: Tensor, X: Tensor, out: Tensor) -> None:
    """``out = Q X`` (``(Q X)ᵀ = Xᵀ Qᵀ`` on the long-first layout)."""
    if ws._long_first:
        torch.bmm(X, Q.mT, out=out)
    else:
        torch.bmm(Q, X, out=out)
