"""The AdamW half of `dmuon.Muon`: every parameter that is not dedicated."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw


def scalar_dtype() -> torch.dtype:
    """The dtype of AdamW's step counter, as torch.optim's ``_get_scalar_dtype()`` picks it."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def fused_on(p: Tensor) -> bool:
    """Whether ``p`` steps with torch's fused AdamW kernel: on CUDA, for real floating
    weights (one kernel launch for the whole group, as ``torch.optim.AdamW(fused=True)``)."""
    return p.device.type == "cuda" and p.is_floating_point()


def new_adamw_state(p: Tensor) -> dict[str, Tensor]:
    """AdamW's state of ``p`` before its first step: ``step`` 0 (on ``p``'s device where
    the fused kernel steps it, as torch keeps it) and zero moments."""
    fused = fused_on(p)
    return {
        "step": torch.tensor(
            0.0,
            dtype=torch.float32 if fused else scalar_dtype(),
            device=p.device if fused else None,
        ),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def adamw_step(state: dict[Tensor, dict[str, Any]], group: dict[str, Any]) -> None:
    """Step an AdamW param group (``state`` is the optimizer's) with
    ``torch.optim.adamw.adamw`` on every parameter with a gradient (FSDP2 DTensor shards
    included): fused where every one is on CUDA (`fused_on`), else torch's default
    (foreach), as ``torch.optim.AdamW`` does."""
    params: list[Tensor] = []
    grads: list[Tensor] = []
    exp_avgs: list[Tensor] = []
    exp_avg_sqs: list[Tensor] = []
    steps: list[Tensor] = []
    has_complex = False
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise ValueError("AdamW does not support sparse gradients; use dense ones")
        has_complex |= torch.is_complex(p)
        entry = state[p]
        if len(entry) == 0:
            entry.update(new_adamw_state(p))
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(entry["exp_avg"])
        exp_avg_sqs.append(entry["exp_avg_sq"])
        steps.append(entry["step"])
    if not params:
        return
    fused = all(fused_on(p) for p in params) and not has_complex
    if fused:  # a step counter made on the CPU (a loaded state) moves to its parameter
        for i, (p, step) in enumerate(zip(params, steps, strict=True)):
            if step.device != p.device:
                steps[i] = state[p]["step"] = step.to(p.device, torch.float32)
    beta1, beta2 = group["betas"]
    adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=True if fused else None,
        grad_scale=None,
        found_inf=None,
        has_complex=has_complex,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
