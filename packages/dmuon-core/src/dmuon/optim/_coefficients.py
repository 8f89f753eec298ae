"""The Newton-Schulz coefficient sets, and what ``coefficients`` arguments may be.

Two sets are built in:

* ``"keller"``: Keller Jordan's triple ``(3.4445, -4.7750, 2.0315)`` every step, the default
  of ``torch.optim.Muon``. It is tuned for speed, not accuracy: the singular values of the
  result land roughly in ``(0.5, 1.5)`` instead of exactly 1.
* ``"polar_express"`` (the default here): the five per-step triples of Polar Express
  (Amsel, Persson, Musco, Gower; arXiv 2505.16932) with the safety factor ``s = 1.05``
  applied as ``(a/s, b/s³, c/s⁵)``. After five steps the singular values are much closer
  to 1. Steps after the fifth repeat the last triple.

See `dmuon.optim._orthogonalize` for the iteration they drive.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

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
