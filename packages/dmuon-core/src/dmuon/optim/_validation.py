"""Checks of `dmuon.Muon`'s hyperparameters, and the learning-rate adjustment by shape."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import nn

from dmuon._ownership.dedication_state import DedicationState, get_dedication, unwrap
from dmuon._ownership.wrappers import check_wrapped
from dmuon.optim._normuon import VARIANTS
from dmuon.optim._orthogonalize import Coefficients, _check_dtype, _is_real, resolve_coefficients

ADJUST_LR_FNS: tuple[str | None, ...] = ("original", "match_rms_adamw", None)
"""Accepted values of ``adjust_lr_fn``."""

NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip")
"""Accepted values of ``nonfinite``."""


def _unknown_adjust_lr_fn(value: object) -> ValueError:
    return ValueError(
        f"adjust_lr_fn must be one of 'original', 'match_rms_adamw' or None, got {value!r}"
    )


def adjust_lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Factor the learning rate is multiplied by for a ``rows x cols`` matrix.

    * ``"original"`` (Keller Jordan): ``sqrt(max(1, rows / cols))``.
    * ``"match_rms_adamw"`` (Moonlight, arXiv 2502.16982): ``0.2 * sqrt(max(rows, cols))``,
      which gives the update an RMS of about 0.2, like AdamW's, so AdamW learning rates and
      weight decay carry over.
    * ``None``: 1 (no adjustment). Note that ``torch.optim.Muon`` treats ``None`` as
      ``"original"``.

    Raises:
        ValueError: an unknown ``adjust_lr_fn``.
    """
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn is None:
        return 1.0
    raise _unknown_adjust_lr_fn(adjust_lr_fn)


def _check_nonneg(name: str, value: object, hint: str) -> None:
    if not _is_real(value) or not (0.0 <= float(value) < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0 ({hint}), got {value!r}")


def _check_unit(name: str, value: object, hint: str) -> None:
    if not _is_real(value) or not (0.0 <= float(value) < 1.0):
        raise ValueError(f"{name} must be in [0, 1) ({hint}), got {value!r}")


def validate_muon_group(group: dict[str, Any]) -> None:
    _check_nonneg("lr", group["lr"], "e.g. 0.02")
    _check_unit("momentum", group["momentum"], "e.g. 0.95")
    _check_nonneg("weight_decay", group["weight_decay"], "0 disables it")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1 (5 is usual), got {steps!r}")
    try:
        resolve_coefficients(group["ns_coefficients"], steps)
    except ValueError as e:
        raise ValueError(f"ns_coefficients: {e}") from None
    if not isinstance(group.get("ns_gram", True), bool):
        raise ValueError(f"ns_gram must be True or False, got {group['ns_gram']!r}")
    if group["ns_dtype"] is not None:
        try:
            _check_dtype(group["ns_dtype"])
        except ValueError as e:
            raise ValueError(f"ns_{e}") from None
    eps = group["eps"]
    if not _is_real(eps) or not (0.0 < float(eps) < math.inf):
        raise ValueError(f"eps must be a finite number > 0 (default 1e-7), got {eps!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise _unknown_adjust_lr_fn(group["adjust_lr_fn"])
    if group.get("variant", "muon") not in VARIANTS:
        raise ValueError(
            f"variant must be 'muon' or 'normuon' (NorMuon: Muon with per-neuron "
            f"second-moment normalization), got {group['variant']!r}"
        )
    _check_unit("beta2", group.get("beta2", 0.95), "NorMuon's second-moment decay, e.g. 0.95")
    if group["nonfinite"] not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite must be 'raise' or 'skip' (what to do with a NaN or infinite Muon "
            f"gradient), got {group['nonfinite']!r}"
        )


def validate_adamw_group(group: dict[str, Any]) -> None:
    _check_nonneg("adamw_lr", group["lr"], "e.g. 1e-3")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"adamw_betas must be a pair (beta1, beta2), e.g. (0.9, 0.999), got {betas!r}"
        )
    _check_unit("adamw_betas[0]", betas[0], "e.g. 0.9")
    _check_unit("adamw_betas[1]", betas[1], "e.g. 0.999")
    _check_nonneg("adamw_eps", group["eps"], "e.g. 1e-8")
    _check_nonneg("adamw_weight_decay", group["weight_decay"], "e.g. 0.01")


def group_defaults(
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    ns_steps: int,
    ns_coefficients: Coefficients,
    ns_dtype: torch.dtype | None,
    ns_gram: bool,
    eps: float,
    adjust_lr_fn: str | None,
    adamw_lr: float,
    adamw_betas: tuple[float, float],
    adamw_eps: float,
    adamw_weight_decay: float,
    nonfinite: str,
    variant: str,
    beta2: float,
) -> dict[str, dict[str, Any]]:
    """``{"muon": ..., "adamw": ...}``: `dmuon.Muon`'s constructor arguments as each
    algorithm's group defaults, validated (the first error names the argument)."""
    defaults: dict[str, dict[str, Any]] = {
        "muon": {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
            "ns_dtype": ns_dtype,
            "ns_gram": ns_gram,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
            "nonfinite": nonfinite,
            "variant": variant,
            "beta2": beta2,
        },
        "adamw": {
            "lr": adamw_lr,
            "betas": tuple(adamw_betas) if isinstance(adamw_betas, (tuple, list)) else adamw_betas,
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        },
    }
    validate_muon_group(dict(defaults["muon"]))
    validate_adamw_group(dict(defaults["adamw"]))
    return defaults


def check_params_are_the_models(param_groups: list[dict[str, Any]], model: nn.Module) -> None:
    """Raise if the model's parameters were replaced after the optimizer was built.

    ``fully_shard`` (or anything else) replacing parameters after ``dmuon.Muon`` would
    leave the AdamW groups stepping tensors the model no longer uses: embeddings and
    norms would silently never train.
    """
    current = {id(p) for p in model.parameters()}
    stale = [
        p
        for group in param_groups
        if group["algorithm"] == "adamw"
        for p in group["params"]
        if id(p) not in current
    ]
    if stale:
        raise ValueError(
            f"{len(stale)} parameters of this optimizer's AdamW groups are no longer the "
            "model's (shapes "
            f"{[tuple(p.shape) for p in stale[:3]]}): the model's parameters were replaced "
            "after dmuon.Muon was created, typically by fully_shard. Create the optimizer "
            "last: dmuon.dedicate_params, then fully_shard (or DistributedDataParallel), "
            "then dmuon.Muon."
        )
    state = get_dedication(model)
    if state is not None:  # subclasses without dedication (the naive baseline) skip it
        check_wrapped(model, state)


def dedicated_model(model: object) -> tuple[nn.Module, DedicationState]:
    """The model `dmuon.Muon` was given (unwrapped from DDP) and its dedication state.

    Raises:
        ValueError: not a module, a module never given to ``dedicate_params``, or a
            dedicated parameter that is not a matrix or a stack of matrices.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"Muon takes the model (an nn.Module prepared with dmuon.dedicate_params, or "
            f"its DistributedDataParallel wrapper), not {type(model).__name__}; pass "
            "param_groups=[...] for per-group settings"
        )
    model = unwrap(model)
    state = get_dedication(model)
    if state is None:
        raise ValueError(
            "this model has no dedication state: call dmuon.dedicate_params(model, ...) "
            "first (before fully_shard or DistributedDataParallel), then create "
            "dmuon.Muon(model, ...) (after them)"
        )
    for dp in state.params:
        if len(dp.shape) not in (2, 3):
            raise ValueError(
                f"dedicated parameter {dp.fqn!r} has shape {tuple(dp.shape)}; Muon updates "
                "matrices and 3-D stacks of matrices only: dedicate 2-D weights and fused "
                "expert stacks, and leave other parameters to AdamW"
            )
    return model, state
