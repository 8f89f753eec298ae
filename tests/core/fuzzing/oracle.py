"""The oracle: one process trains the plain model on each step's whole global batch.

Muon written out here (momentum, Nesterov, float32 Newton-Schulz through
``dmuon.newton_schulz``, decoupled weight decay, the learning-rate adjustment on each
matrix's ``(out, in)``; each expert of a fused stack on its own) for the matrices
`muon_matrices` names; ``torch.optim.AdamW`` for every other parameter, with the
hyperparameters the case's parameter groups give it; ``torch.nn.utils.clip_grad_norm_``;
the same freezing schedule. With bfloat16 the forward and backward run on a bfloat16 copy
of the float32 weights (what FSDP2's mixed precision computes), the optimizer on the
float32 weights.

`compare` then checks a distributed phase's results against it: every parameter on every
rank (float32: 1e-5 absolute; bfloat16: the update error bound `BF16_UPDATE_ERROR`), the
dedicated selection, no gradient left after ``zero_grad``, and, for every process group,
the same collective sequence (kinds and sizes) on each of its ranks.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fuzzing.cases import Case, Phase
from fuzzing.models import Decoder, loss_of, muon_matrices
from fuzzing.training import (
    ADAMW_LR,
    ADAMW_WD,
    CUSTOM_MUON,
    CUSTOM_NO_DECAY_LR,
    LR,
    apply_schedule,
    frozen_at_construction,
    global_batch,
    layer0_prefix,
    pieces,
    static_frozen,
)

#: Float32 runs: largest absolute difference of any parameter from the oracle's (plus the
#: oracle's own spread, see `compare_float32`).
FLOAT32_TOLERANCE = 1e-5
#: bfloat16 runs, one step at a time from the same weights: relative (Frobenius) error of
#: each Muon matrix's step and of each other parameter's gradient, plus an absolute floor.
BF16_STEP_ERROR = 0.01
BF16_GRAD_ERROR = 0.05
BF16_FLOOR = 1e-6


def hyperparameters(case: Case, model: Decoder) -> dict[str, dict[str, float]]:
    """Per parameter: its group's settings, written out from the case (not from DMuon)."""
    matrices = muon_matrices(model)
    frozen = frozen_at_construction(case)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon_default = {"lr": LR, "momentum": case.momentum, "weight_decay": case.weight_decay}
    adamw_default = {"lr": ADAMW_LR, "weight_decay": ADAMW_WD}
    out: dict[str, dict[str, float]] = {}
    for name, p in model.named_parameters():
        if name in matrices:
            settings = dict(muon_default)
            if (
                case.groups == "custom"
                and name not in frozen
                and name.startswith(layer0_prefix(case))
            ):
                settings.update(CUSTOM_MUON)
        else:
            settings = dict(adamw_default)
            no_decay = p.ndim < 2 or id(p) in embeddings
            if case.groups is not None and name not in frozen and no_decay:
                settings["weight_decay"] = 0.0
                if case.groups == "custom":
                    settings["lr"] = CUSTOM_NO_DECAY_LR
        out[name] = settings
    return out


def _lr_ratio(case: Case, out_in: tuple[int, int]) -> float:
    rows, cols = out_in
    if case.adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


@torch.no_grad()
def _muon_update(
    case: Case, p: torch.Tensor, buf: torch.Tensor, out_in: tuple[int, int], s: dict[str, float]
) -> None:
    from dmuon import newton_schulz

    grad = p.grad
    buf.lerp_(grad, 1 - s["momentum"])
    update = grad.lerp(buf, s["momentum"]) if case.nesterov else buf.clone()
    if update.ndim == 3:
        ortho = torch.stack(
            [newton_schulz(m, 5, "polar_express", dtype=torch.float32) for m in update]
        )
    else:
        ortho = newton_schulz(update, 5, "polar_express", dtype=torch.float32)
    p.mul_(1 - s["lr"] * s["weight_decay"])
    p.add_(ortho, alpha=-s["lr"] * _lr_ratio(case, out_in))


def _set_gradients_global(case: Case, model: Decoder, step: int) -> None:
    """The gradient of the step's global batch, in one forward (float32)."""
    loss_of(model, global_batch(case, step)).backward()


def _set_gradients_split(
    case: Case, model: Decoder, low: nn.Module, phase: Phase, step: int
) -> None:
    """The step's gradient from the pieces each rank computes, each piece's forward and
    backward on ``low`` (the weights in the phase's compute dtype), the pieces' gradients
    summed in float32, then averaged over the data-parallel ranks: what the distributed
    run adds up (with its losses scaled alike, since a bfloat16 backward rounds scaled
    gradients differently), in another order."""
    params = dict(model.named_parameters())
    low_params = dict(low.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            low_params[name].copy_(p)
            low_params[name].requires_grad_(p.requires_grad)
    totals: dict[str, torch.Tensor] = {}
    for mine in pieces(global_batch(case, step), phase.dp):
        for chunk in pieces(mine, phase.accum):
            for q in low_params.values():
                q.grad = None
            loss = sum(
                loss_of(low, part) * (part.shape[0] * phase.dp / case.rows)
                for part in pieces(chunk, phase.forwards)
            )
            loss.backward()
            for name, q in low_params.items():
                if q.grad is not None:
                    grad = q.grad.float()
                    totals[name] = totals[name] + grad if name in totals else grad
    for name, p in params.items():
        total = totals.get(name)
        p.grad = None if total is None else total / phase.dp


@dataclass
class Trajectory:
    """The oracle's run: parameters before the first step and after each step, and the
    gradients each step's AdamW parameters were stepped with (after clipping)."""

    params: list[dict[str, torch.Tensor]]
    grads: list[dict[str, torch.Tensor]]


def reference(
    case: Case,
    plan: list[Phase] | None = None,
    forced: list[dict[str, torch.Tensor]] | None = None,
    float_dtype: torch.dtype = torch.float32,
) -> Trajectory:
    """The one-process run (see `Trajectory`).

    Without ``plan``, each step's gradient is that of its global batch in one float32
    forward. With ``plan`` (the phase that trains each step), it is summed from the pieces
    that phase's ranks compute, in the phase's compute dtype (see `_set_gradients_split`).
    With ``forced``, step ``s`` starts from the weights ``forced[s]`` (the distributed
    run's) instead of the oracle's own, and its optimizer state carries on: a bfloat16
    forward rounds each weight to 8 bits, so the tiniest float32 difference (a sum in
    another order) flips some roundings and grows step after step; restarting each step
    from the run's weights compares one step at a time, at float32 precision.
    ``float_dtype`` is the dtype of a ``plan``'s float32 pieces (float64: the same
    gradients rounded once, at the end).
    """
    model = Decoder(case.model, case.seed)
    for name in static_frozen(case, -2) + static_frozen(case, -1):
        model.get_parameter(name).requires_grad_(False)
    matrices = muon_matrices(model)
    settings = hyperparameters(case, model)
    params = dict(model.named_parameters())
    by_settings: dict[tuple[float, float], list[nn.Parameter]] = defaultdict(list)
    for name, p in params.items():
        if name not in matrices:
            by_settings[(settings[name]["lr"], settings[name]["weight_decay"])].append(p)
    adamw = torch.optim.AdamW(
        [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in by_settings.items()]
    )
    momentum = {n: torch.zeros_like(params[n]) for n in matrices}
    copies: dict[torch.dtype, nn.Module] = {}
    history = [{n: p.detach().clone() for n, p in params.items()}]
    grads: list[dict[str, torch.Tensor]] = []
    for step in range(case.steps):
        if forced is not None:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(forced[step][name])
        apply_schedule(model, case, range(step, step + 1))
        if plan is None:
            _set_gradients_global(case, model, step)
        else:
            dtype = torch.bfloat16 if plan[step].bf16 else float_dtype
            if dtype not in copies:
                copies[dtype] = copy.deepcopy(model).to(dtype)
            _set_gradients_split(case, model, copies[dtype], plan[step], step)
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for p in params.values() if p.grad is not None], case.clip
            )
        grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in params.items()
                if n not in matrices and p.grad is not None
            }
        )
        for name, out_in in matrices.items():
            p = params[name]
            if p.grad is not None:
                _muon_update(case, p, momentum[name], out_in, settings[name])
                p.grad = None
        adamw.step()
        adamw.zero_grad()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return Trajectory(history, grads)


def step_plan(case: Case, which: str) -> list[Phase]:
    """The phase that trains each step, as phase ``which`` saw them: the run's, and for the
    resume the run's up to the checkpoint and the resume's after it."""
    if which == "run":
        return [case.run] * case.steps
    assert case.resume is not None and case.save_at is not None
    return [case.run] * case.save_at + [case.resume] * (case.steps - case.save_at)


def _collective_mismatches(
    per_rank: list[list[tuple[tuple[int, ...], str, int, int]]],
) -> list[str]:
    by_group: dict[tuple[int, ...], dict[int, list[tuple[str, int, int]]]] = defaultdict(dict)
    for rank, issued in enumerate(per_rank):
        mine: dict[tuple[int, ...], list[tuple[str, int, int]]] = defaultdict(list)
        for group, kind, numel, root in issued:
            mine[group].append((kind, numel, root))
        for group, sequence in mine.items():
            by_group[group][rank] = sequence
    problems = []
    for group, sequences in by_group.items():
        expected_members = set(group)
        members = set(sequences)
        if members != expected_members:
            problems.append(f"group {group}: only ranks {sorted(members)} issued collectives on it")
            continue
        first = sequences[min(members)]
        for rank in sorted(members):
            if sequences[rank] != first:
                pairs = enumerate(zip(sequences[rank], first, strict=False))
                at = next(
                    (i for i, (a, b) in pairs if a != b), min(len(first), len(sequences[rank]))
                )
                problems.append(
                    f"group {group}: rank {rank} differs from rank {min(members)} at "
                    f"collective {at}: {sequences[rank][at : at + 2]} vs {first[at : at + 2]} "
                    f"({len(sequences[rank])} vs {len(first)} collectives)"
                )
    return problems


def compare_run(case: Case, which: str, per_rank: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a phase's per-rank results apart from the parameters: errors, the
    dedicated selection, gradients left after ``zero_grad``, the collective sequences."""
    problems: list[str] = []
    for rank, result in enumerate(per_rank):
        if "error" in result:
            problems.append(f"{which} rank {rank} raised:\n{result['error']}")
    if problems:
        return problems
    expected_dedicated = sorted(muon_matrices(Decoder(case.model, case.seed)))
    for rank, result in enumerate(per_rank):
        if result["dedicated"] != expected_dedicated:
            problems.append(
                f"{which} rank {rank}: dedicated {result['dedicated']}, expected "
                f"{expected_dedicated}"
            )
        if result["leftover"]:
            problems.append(
                f"{which} rank {rank}: gradients left after zero_grad: {result['leftover']}"
            )
    problems += [
        f"{which} {p}" for p in _collective_mismatches([r["collectives"] for r in per_rank])
    ]
    return problems


def compare_parameters(
    what: str,
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    bound: float,
    other: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Every parameter of ``got`` within ``bound`` (absolute) of ``expected``'s, plus twice
    its largest difference from ``other`` (another oracle) when given."""
    if sorted(got) != sorted(expected):
        return [f"{what}: parameters {sorted(got)}, expected {sorted(expected)}"]
    problems = []
    for name, value in expected.items():
        mine = got[name].float()
        if mine.shape != value.shape:
            problems.append(
                f"{what} {name}: shape {tuple(mine.shape)}, expected {tuple(value.shape)}"
            )
            continue
        diff = (mine - value).abs().max().item() if mine.numel() else 0.0
        allowed = bound
        if other is not None and mine.numel():
            allowed += 2 * (other[name] - value).abs().max().item()
        if not diff <= allowed:
            problems.append(f"{what} {name}: off by {diff:.3g} (bound {allowed:.3g})")
    return problems


def compare_float32(case: Case, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each phase's final parameters, on every rank, against the global-batch oracle.

    The bound is `FLOAT32_TOLERANCE` plus twice the parameter's spread between two
    float32 oracles that differ only in how they add up the gradient (the global batch in
    one forward, and the pieces the phase's ranks compute): Newton-Schulz turns the
    rounding of a nearly rank-deficient gradient into a visible difference, and the spread
    says how much this case amplifies rounding. It is about 1e-8 for most cases. Tensor
    parallelism also splits every matrix product of the forward and backward over the tp
    ranks, a rounding the pieces do not make: for a phase with it, the spread is also
    taken against an oracle whose gradients are computed in float64 and rounded once
    (AdamW's ``eps`` turns the rounding of a tiny gradient, an embedding row's, into a
    visible difference), the larger of the two per parameter.
    """
    final = reference(case).params[-1]
    problems = []
    for which, per_rank in results.items():
        plan = step_plan(case, which)
        split = reference(case, plan).params[-1]
        if any(phase.layout == "tp" for phase in plan):
            precise = reference(case, plan, float_dtype=torch.float64).params[-1]
            split = {
                name: max(
                    (split[name], precise[name]),
                    key=lambda other, name=name: (
                        (other - final[name]).abs().max().item() if other.numel() else 0.0
                    ),
                )
                for name in split
            }
        for rank, result in enumerate(per_rank):
            problems += compare_parameters(
                f"{which} rank {rank}", result["params"], final, FLOAT32_TOLERANCE, split
            )
    return problems


def _relative_errors(
    what: str,
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    scale: dict[str, torch.Tensor],
    bound: float,
) -> list[str]:
    """``||got - expected|| <= bound * ||scale|| + BF16_FLOOR`` for every name (Frobenius)."""
    if sorted(got) != sorted(expected):
        return [f"{what}: {sorted(got)}, expected {sorted(expected)}"]
    problems = []
    for name, value in expected.items():
        error = (got[name].float() - value).norm().item()
        allowed = bound * scale[name].norm().item() + BF16_FLOOR
        if not error <= allowed:
            problems.append(f"{what} {name}: off by {error:.3g} (bound {allowed:.3g})")
    return problems


def compare_bfloat16(case: Case, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each step of each phase against the oracle's step from the same weights.

    The weights each step starts from are rank 0's snapshots (the run's, then the
    resume's). On every rank: each Muon matrix's step within `BF16_STEP_ERROR` of the
    oracle's (relative, Frobenius), and the gradients the other parameters were stepped
    with within `BF16_GRAD_ERROR` of the oracle's. The AdamW steps themselves are not
    compared: AdamW's first steps move every element by about its learning rate in the
    sign of its gradient, and a bfloat16 forward (its kernels round by memory alignment
    too) can flip the sign of an element whose gradient is nearly zero.
    """
    matrices = set(muon_matrices(Decoder(case.model, case.seed)))
    problems = []
    run = results["run"][0]["snapshots"]
    for which, per_rank in results.items():
        snapshots = per_rank[0]["snapshots"]
        first = 0 if which == "run" else case.save_at
        assert first is not None
        if which == "resume":
            problems += compare_parameters(
                f"resume loaded at step {first}", snapshots[0], run[first], 0.0
            )
        weights_at = run[:first] + snapshots
        oracle = reference(case, step_plan(case, which), weights_at)
        for step in range(first, case.steps):
            before = {n: weights_at[step][n] for n in matrices}
            step_of = {n: oracle.params[step + 1][n] - before[n] for n in matrices}
            for rank, result in enumerate(per_rank):
                after = result["snapshots"][step + 1 - first]
                problems += _relative_errors(
                    f"{which} rank {rank} step {step} Muon update",
                    {n: after[n].float() - before[n] for n in matrices},
                    step_of,
                    step_of,
                    BF16_STEP_ERROR,
                )
                problems += _relative_errors(
                    f"{which} rank {rank} step {step} gradient",
                    result["grads"][step - first],
                    oracle.grads[step],
                    oracle.grads[step],
                    BF16_GRAD_ERROR,
                )
    return problems
