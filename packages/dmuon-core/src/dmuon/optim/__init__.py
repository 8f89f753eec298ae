"""Muon with dedicated ownership: the optimizer (Muon or NorMuon), the Newton-Schulz
iteration and its constants.

Everything a user calls is exported here; the modules inside are private.
"""

from dmuon.optim._muon import (
    ADJUST_LR_FNS,
    NONFINITE_POLICIES,
    Muon,
    NonFiniteGradientError,
    adjust_lr_ratio,
)
from dmuon.optim._muon_update import DEFAULT_MAX_WORKSPACE_BYTES, workspace_nbytes
from dmuon.optim._normuon import NORMUON_EPS, VARIANTS
from dmuon.optim._orthogonalize import (
    COEFFICIENT_SETS,
    GRAM_MIN_ASPECT,
    GRAM_RESTARTS,
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_PUBLISHED_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY_FACTOR,
    Coefficients,
    CoefficientTriple,
    cpu_bf16_unit,
    cpu_has_native_bf16,
    default_ns_dtype,
    iteration_dtype,
    newton_schulz,
    resolve_coefficients,
    uses_gram,
)
from dmuon.optim._qk_clip import QKClipReport
from dmuon.optim._qk_logits import record_attention_logits
from dmuon.optim._split import resolve_split

__all__ = [
    "ADJUST_LR_FNS",
    "COEFFICIENT_SETS",
    "DEFAULT_MAX_WORKSPACE_BYTES",
    "GRAM_MIN_ASPECT",
    "GRAM_RESTARTS",
    "KELLER_COEFFICIENTS",
    "NONFINITE_POLICIES",
    "NORMUON_EPS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY_FACTOR",
    "VARIANTS",
    "CoefficientTriple",
    "Coefficients",
    "Muon",
    "NonFiniteGradientError",
    "QKClipReport",
    "adjust_lr_ratio",
    "cpu_bf16_unit",
    "cpu_has_native_bf16",
    "default_ns_dtype",
    "iteration_dtype",
    "newton_schulz",
    "record_attention_logits",
    "resolve_coefficients",
    "resolve_split",
    "uses_gram",
    "workspace_nbytes",
]
