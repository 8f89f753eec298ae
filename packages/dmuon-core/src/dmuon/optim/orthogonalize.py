"""Newton-Schulz orthogonalization: coefficient sets and the quintic iteration.

Muon replaces a gradient (momentum) matrix ``G = U S Vᵀ`` by an approximation of its
orthogonal polar factor ``U Vᵀ``. The approximation is a fixed number of quintic
Newton-Schulz steps on the Frobenius-normalized matrix:

```text
A = X Xᵀ
B = b·A + c·A·A
X ← a·X + B·X
```

Two coefficient sets are built in:

* ``"keller"``: Keller Jordan's triple ``(3.4445, -4.7750, 2.0315)`` every step, the default
  of ``torch.optim.Muon``. It is tuned for speed, not accuracy: the singular values of the
  result land roughly in ``(0.5, 1.5)`` instead of exactly 1.
* ``"polar_express"`` (the default here): the five per-step triples of Polar Express
  (Amsel, Persson, Musco, Gower; arXiv 2505.16932) with the safety factor ``s = 1.05``
  applied as ``(a/s, b/s³, c/s⁵)``. After five steps the singular values are much closer
  to 1. Steps after the fifth repeat the last triple.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "COEFFICIENT_SETS",
    "KELLER_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY_FACTOR",
    "CoefficientTriple",
    "Coefficients",
    "default_ns_dtype",
    "newton_schulz",
    "resolve_coefficients",
]

CoefficientTriple = tuple[float, float, float]
"""One quintic step ``(a, b, c)``: ``X ← a·X + (b·A + c·A·A)·X`` with ``A = X Xᵀ``."""

Coefficients = str | Sequence[float] | Sequence[Sequence[float]]
"""What ``coefficients`` accepts: a set name, one triple, or a per-step list of triples."""

KELLER_COEFFICIENTS: CoefficientTriple = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's triple, used at every step (``torch.optim.Muon``'s default)."""

POLAR_EXPRESS_PUBLISHED_COEFFICIENTS: tuple[CoefficientTriple, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
"""The five Polar Express triples as published (arXiv 2505.16932), before the safety factor."""

POLAR_EXPRESS_SAFETY_FACTOR: float = 1.05
"""Safety factor ``s``: each published triple is used as ``(a/s, b/s³, c/s⁵)``."""

POLAR_EXPRESS_COEFFICIENTS: tuple[CoefficientTriple, ...] = tuple(
    (
        a / POLAR_EXPRESS_SAFETY_FACTOR,
        b / POLAR_EXPRESS_SAFETY_FACTOR**3,
        c / POLAR_EXPRESS_SAFETY_FACTOR**5,
    )
    for a, b, c in POLAR_EXPRESS_PUBLISHED_COEFFICIENTS
)
"""The Polar Express triples actually used (safety factor applied); later steps repeat the last."""

COEFFICIENT_SETS: dict[str, tuple[CoefficientTriple, ...]] = {
    "keller": (KELLER_COEFFICIENTS,),
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
}
"""Named coefficient sets, as per-step tuples (the last triple repeats for later steps)."""


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (5 is the usual choice), got {steps!r}")
    return int(steps)


def _as_triple(value: object, where: str) -> CoefficientTriple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(
            f"{where} must be a triple (a, b, c) of finite real numbers, got {value!r}; "
            'pass e.g. (3.4445, -4.7750, 2.0315), or a name: "keller" or "polar_express"'
        )
    if not all(_is_real(v) and math.isfinite(float(v)) for v in value):
        raise ValueError(f"{where} must contain three finite real numbers (a, b, c), got {value!r}")
    a, b, c = (float(v) for v in value)
    return (a, b, c)


def resolve_coefficients(coefficients: Coefficients, steps: int) -> list[CoefficientTriple]:
    """Return the exact list of ``steps`` triples ``(a, b, c)`` the iteration will use.

    Args:
        coefficients: ``"keller"``, ``"polar_express"``, a single triple ``(a, b, c)`` used at
            every step, or a per-step sequence of triples.
        steps: number of Newton-Schulz steps (>= 1).

    Returns:
        A list of length ``steps``. A per-step sequence shorter than ``steps`` repeats its
        last triple; a longer one is cut after ``steps`` triples.

    Raises:
        ValueError: ``steps < 1``, an unknown name, or a malformed triple.
    """
    steps = _check_steps(steps)
    if isinstance(coefficients, str):
        try:
            per_step: Sequence[Sequence[float]] = COEFFICIENT_SETS[coefficients]
        except KeyError:
            raise ValueError(
                f"unknown Newton-Schulz coefficient set {coefficients!r}; pass one of "
                f"{sorted(COEFFICIENT_SETS)} or a sequence of (a, b, c) triples"
            ) from None
        triples = [_as_triple(t, "coefficient triple") for t in per_step]
    elif isinstance(coefficients, Sequence) and not isinstance(coefficients, bytes):
        if len(coefficients) == 0:
            raise ValueError(
                'coefficients is empty; pass a name ("keller" or "polar_express") or at '
                "least one (a, b, c) triple"
            )
        if len(coefficients) == 3 and all(_is_real(v) for v in coefficients):
            triples = [_as_triple(coefficients, "coefficients")]
        else:
            triples = [_as_triple(t, f"coefficients[{i}]") for i, t in enumerate(coefficients)]
    else:
        raise ValueError(
            f'coefficients must be a name ("keller" or "polar_express"), a triple '
            f"(a, b, c) or a sequence of triples, got {type(coefficients).__name__}"
        )
    if len(triples) >= steps:
        return triples[:steps]
    return triples + [triples[-1]] * (steps - len(triples))


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """The iteration dtype used when ``dtype=None``: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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


def _newton_schulz_unchecked(
    G: Tensor, triples: Sequence[CoefficientTriple], dtype: torch.dtype, eps: float
) -> Tensor:
    """The iteration itself, for a validated 2-D or 3-D input; returns ``G``'s dtype."""
    transpose = G.size(-2) > G.size(-1)
    # Normalize in float32 (float64 when iterating in float64), then cast.
    X = G.to(torch.promote_types(dtype, torch.float32))
    if transpose:
        X = X.mT
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp_min(eps)
    X = (X / norm).to(dtype)
    if X.dim() == 2:
        for a, b, c in triples:
            A = X @ X.mT
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        for a, b, c in triples:
            A = X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
    if transpose:
        X = X.mT
    return X.to(G.dtype)


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: Coefficients = "polar_express",
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
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
        dtype: the iteration dtype; ``None`` means bfloat16 on CUDA, float32 elsewhere.
        eps: lower clamp of the norm, so a zero matrix maps to zero.

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
    return _newton_schulz_unchecked(G, triples, dtype, eps)
