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
    GRAM_MIN_ASPECT,
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_PUBLISHED_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY_FACTOR,
    Coefficients,
    CoefficientTriple,
    NewtonSchulzWorkspace,
    cpu_has_native_bf16,
    default_ns_dtype,
    newton_schulz,
    resolve_coefficients,
    uses_gram,
)

__all__ = [
    "ADJUST_LR_FNS",
    "COEFFICIENT_SETS",
    "GRAM_MIN_ASPECT",
    "KELLER_COEFFICIENTS",
    "NONFINITE_POLICIES",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY_FACTOR",
    "CoefficientTriple",
    "Coefficients",
    "Muon",
    "NewtonSchulzWorkspace",
    "NonFiniteGradientError",
    "adjust_lr_ratio",
    "cpu_has_native_bf16",
    "default_ns_dtype",
    "newton_schulz",
    "resolve_coefficients",
    "uses_gram",
]
