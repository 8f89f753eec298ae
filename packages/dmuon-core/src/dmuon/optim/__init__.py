"""Muon with dedicated ownership: the optimizer (Muon or NorMuon), the Newton-Schulz
iteration and its constants.

Everything a user calls is exported here; the modules inside are private.
"""

from typing import TYPE_CHECKING

from dmuon._lazy import lazy_attributes

if TYPE_CHECKING:
    from dmuon.optim._blocks import DEFAULT_MAX_WORKSPACE_BYTES
    from dmuon.optim._muon import (
        ADJUST_LR_FNS,
        NONFINITE_POLICIES,
        Muon,
        NonFiniteGradientError,
        adjust_lr_ratio,
    )
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
        workspace_nbytes,
    )
    from dmuon.optim._qk_clip import QKClipReport
    from dmuon.optim._qk_logits import record_attention_logits
    from dmuon.optim._split import resolve_split

#: Each exported name and the module that defines it, imported when first read.
_EXPORTS = {
    "ADJUST_LR_FNS": "dmuon.optim._muon",
    "NONFINITE_POLICIES": "dmuon.optim._muon",
    "Muon": "dmuon.optim._muon",
    "NonFiniteGradientError": "dmuon.optim._muon",
    "adjust_lr_ratio": "dmuon.optim._muon",
    "DEFAULT_MAX_WORKSPACE_BYTES": "dmuon.optim._blocks",
    "workspace_nbytes": "dmuon.optim._orthogonalize",
    "NORMUON_EPS": "dmuon.optim._normuon",
    "VARIANTS": "dmuon.optim._normuon",
    "COEFFICIENT_SETS": "dmuon.optim._orthogonalize",
    "GRAM_MIN_ASPECT": "dmuon.optim._orthogonalize",
    "GRAM_RESTARTS": "dmuon.optim._orthogonalize",
    "KELLER_COEFFICIENTS": "dmuon.optim._orthogonalize",
    "POLAR_EXPRESS_COEFFICIENTS": "dmuon.optim._orthogonalize",
    "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS": "dmuon.optim._orthogonalize",
    "POLAR_EXPRESS_SAFETY_FACTOR": "dmuon.optim._orthogonalize",
    "Coefficients": "dmuon.optim._orthogonalize",
    "CoefficientTriple": "dmuon.optim._orthogonalize",
    "cpu_bf16_unit": "dmuon.optim._orthogonalize",
    "cpu_has_native_bf16": "dmuon.optim._orthogonalize",
    "default_ns_dtype": "dmuon.optim._orthogonalize",
    "iteration_dtype": "dmuon.optim._orthogonalize",
    "newton_schulz": "dmuon.optim._orthogonalize",
    "resolve_coefficients": "dmuon.optim._orthogonalize",
    "uses_gram": "dmuon.optim._orthogonalize",
    "QKClipReport": "dmuon.optim._qk_clip",
    "record_attention_logits": "dmuon.optim._qk_logits",
    "resolve_split": "dmuon.optim._split",
}

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

__getattr__, __dir__ = lazy_attributes("dmuon.optim", _EXPORTS, globals())
