"""Muon with dedicated ownership: the Newton-Schulz iteration and the optimizer."""

from .muon import ADJUST_LR_FNS, Muon, adjust_lr_ratio
from .orthogonalize import (
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
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY_FACTOR",
    "CoefficientTriple",
    "Coefficients",
    "Muon",
    "adjust_lr_ratio",
    "default_ns_dtype",
    "newton_schulz",
    "resolve_coefficients",
]
