"""Muon with dedicated ownership: the Newton-Schulz iteration and the optimizer."""

from dmuon.optim.muon import (
    ADJUST_LR_FNS,
    NONFINITE_POLICIES,
    Muon,
    NonFiniteGradientError,
    adjust_lr_ratio,
)
from dmuon.optim.orthogonalize import (
    COEFFICIENT_SETS,
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_PUBLISHED_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY_FACTOR,
    Coefficients,
    CoefficientTriple,
    default_ns_dtype,
    newton_schulz,
    resolve_coefficients,
)

__all__ = [
    "ADJUST_LR_FNS",
    "COEFFICIENT_SETS",
    "KELLER_COEFFICIENTS",
    "NONFINITE_POLICIES",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY_FACTOR",
    "CoefficientTriple",
    "Coefficients",
    "Muon",
    "NonFiniteGradientError",
    "adjust_lr_ratio",
    "default_ns_dtype",
    "newton_schulz",
    "resolve_coefficients",
]
