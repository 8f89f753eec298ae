"""The planner's text and JSON output: one plan's table, and ``--recommend``'s ranking."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence

import torch

from dmuon.plan._collectives import Tally
from dmuon.plan._estimate import GIB, ClusterPlan, RankPlan, plan_cluster
from dmuon.plan._hardware import Hardware
from dmuon.plan._memory import ACTIVATION_BYTES, activation_bytes_per_token
from dmuon.plan._model import active_parameters
from dmuon.plan._recommend import WITHIN, recommend


def _row(
    name: str, ranks: Sequence[RankPlan], value: Callable[[RankPlan], float], unit: str
) -> str:
    values = [value(r) for r in ranks]
    cells = (min(values), statistics.fmean(values), max(values))
    return f"  {name:<34}" + "".join(f"{c:>12,.2f}" for c in cells) + f"  {unit}"


def format_plan(plan: ClusterPlan, model_name: str, per_rank: bool = False) -> str:
    """The plan as text: assumptions, totals, per-rank ranges, warnings."""
    lines = _summary_lines(plan, model_name)
    lines += ["", f"  {'per rank':<34}{'min':>12}{'mean':>12}{'max':>12}"]
    lines += _range_rows(plan.ranks) + _collective_rows(plan.ranks)
    if per_rank:
        lines += _per_rank_table(plan.ranks)
    for warning in plan.warnings:
        lines += ["", f"warning: {warning}"]
    return "\n".join(lines)


def _summary_lines(plan: ClusterPlan, model_name: str) -> list[str]:
    """The model, the mesh, the time model, and the step's figures against FSDP2 + AdamW."""
    tp = plan.world // (plan.replicas * plan.shard_size)
    layout = (
        f"{plan.replicas} replicas x {plan.shard_size} shard ranks (HSDP)"
        if plan.replicas > 1
        else f"a 1-D mesh of {plan.shard_size} ranks"
    ) + (f" x tensor parallel {tp} (data-parallel ranks x tp)" if tp > 1 else "")
    sync = " under dmuon.no_sync" if plan.no_sync and plan.accum > 1 else ""
    busiest = plan.busiest
    lines = [
        f"model: {model_name}: {plan.parameters / 1e9:,.2f} B parameters, "
        f"{plan.active_parameters / 1e9:,.2f} B active per token; {plan.matrices:,} "
        f"dedicated matrices ({plan.dedicated_elements / 1e9:,.2f} B elements) in "
        f"{plan.boundaries} hook boundaries",
        f"mesh: {plan.world} ranks, {layout}; {plan.mode.upper()}, {plan.accum} "
        f"micro-batch(es) per step{sync}",
        f"time model: {plan.hardware.describe()}; forward+backward = 6 x active parameters x "
        f"{plan.tokens_per_step:,} tokens per step; Newton-Schulz = 2 x {plan.ns_steps} "
        "iterations x each matrix's 2 m^2 n + m^3 multiply-adds"
        + (
            f" (Gram iteration where it applies: 2 x (2 m^2 n + {4 * plan.ns_steps - 3} m^3) "
            "in all)"
            if plan.ns_gram
            else ""
        ),
        f"forward+backward: {plan.forward_backward_seconds * 1e3:,.1f} ms per step per rank",
        f"optimizer-step overhead against forward+backward: Newton-Schulz "
        f"{plan.ns_overhead:.2%} (busiest rank {busiest.rank}: {busiest.ns_seconds * 1e3:,.2f} "
        f"ms; imbalance {plan.ns_imbalance:.2f}: the busiest rank over the mean)"
        + (
            f"; exposed between replicas: updates {plan.update_overhead:.2%} (they "
            f"travel during the next forward), backward's reduces {plan.reduce_overhead:.2%}"
            if plan.replicas > 1
            else ""
        ),
        _shard_line(plan),
        f"step time against FSDP2 + AdamW on the same mesh: DMuon +{plan.step_overhead:.2%}, "
        f"FSDP2 + AdamW +{plan.fsdp2_overhead:.2%} beyond forward+backward (its all-reduce "
        f"between replicas past backward): ratio {plan.step_ratio:.3f}",
        f"collective calls per step: DMuon up to {plan.calls:,} per rank, FSDP2 "
        f"{plan.fsdp2_calls:,} for the same model and mesh",
    ]
    if plan.ns_split > 1:
        slowest = max(plan.ranks, key=lambda r: r.ns_seconds + r.split_seconds)
        lines.append(
            f"split iterations: {len(plan.owner_plan.split):,} matrices shared by blocks of "
            f"{plan.ns_split} ranks; the busiest rank iterates {slowest.ns_seconds * 1e3:,.2f} "
            f"ms and waits {slowest.split_seconds * 1e3:,.2f} ms for its block's collectives"
        )
    return lines


def _shard_line(plan: ClusterPlan) -> str:
    """The shard group's gathers and reduce-scatters against the compute they overlap."""
    traffic = plan.shard_traffic
    if plan.shard_size == 1:
        return "inside a shard group: nothing (one data-parallel rank per replica)"
    where = "crosses nodes (network rate)" if traffic.crosses_nodes else "inside a node"
    worst = f"; most exposed: {traffic.worst_unit}" if traffic.worst_unit else ""
    return (
        f"inside a shard group of {plan.shard_size} ({where}): FSDP2's and DMuon's gathers "
        f"and reduce-scatters {traffic.seconds * 1e3:,.1f} ms per step, exposed beyond the "
        f"compute of their layer {plan.shard_overhead:.2%} of forward+backward, on both "
        f"sides{worst}"
    )


def _range_rows(ranks: list[RankPlan]) -> list[str]:
    """Each per-rank figure's minimum, mean and maximum over the ranks."""
    gib = float(GIB)
    return [
        _row("masters", ranks, lambda r: r.master_bytes / gib, "GiB"),
        _row("momentum", ranks, lambda r: r.momentum_bytes / gib, "GiB"),
        _row("Newton-Schulz workspace", ranks, lambda r: r.workspace_bytes / gib, "GiB"),
        _row("packed buffers", ranks, lambda r: r.buffer_bytes / gib, "GiB"),
        _row("no_sync accumulator", ranks, lambda r: r.accumulator_bytes / gib, "GiB"),
        _row("reduce buffers (backward)", ranks, lambda r: r.reduce_buffer_bytes / gib, "GiB"),
        _row("DMuon adds in all", ranks, lambda r: r.added_bytes / gib, "GiB"),
        _row("Newton-Schulz", ranks, lambda r: r.ns_flops / 1e12, "TFLOP"),
        _row("Newton-Schulz time", ranks, lambda r: r.ns_seconds * 1e3, "ms"),
        _row("collective calls", ranks, lambda r: r.calls, "per step"),
    ]


def _collective_rows(ranks: list[RankPlan]) -> list[str]:
    """Calls and elements of each kind of collective, per mesh dimension."""
    lines = []
    for dim, pick in (
        ("shard", lambda r: r.shard_collectives),
        ("replicate", lambda r: r.replicate_collectives),
        ("tensor", lambda r: r.tensor_collectives),
        ("split", lambda r: r.split_collectives),
    ):
        kinds = sorted({kind for r in ranks for kind in pick(r)})
        for kind in kinds:
            lines.append(
                _row(
                    f"{dim} {kind} calls",
                    ranks,
                    lambda r, k=kind, p=pick: p(r).get(k, _ZERO).count,
                    "per step",
                )
            )
            lines.append(
                _row(
                    f"{dim} {kind} elements",
                    ranks,
                    lambda r, k=kind, p=pick: p(r).get(k, _ZERO).elements / 1e6,
                    "M per step",
                )
            )
    return lines


def _per_rank_table(ranks: list[RankPlan]) -> list[str]:
    """One line per rank: its coordinates, memory, Newton-Schulz time and calls."""
    gib = float(GIB)
    lines = ["", "  rank replica shard tp  masters GiB  momentum GiB  workspace GiB  NS ms  calls"]
    for r in ranks:
        lines.append(
            f"  {r.rank:>4} {r.replica:>7} {r.shard:>5} {r.tp:>2} "
            f"{r.master_bytes / gib:>12.2f} {r.momentum_bytes / gib:>13.2f} "
            f"{r.workspace_bytes / gib:>14.2f} "
            f"{r.ns_seconds * 1e3:>6.2f} {r.calls:>6}"
        )
    return lines


_ZERO = Tally()


def print_recommendation(
    args: argparse.Namespace,
    model: torch.nn.Module,
    config: object,
    hardware: Hardware,
    tokens: int,
    kwargs: dict[str, int],
) -> int:
    """``--recommend``: the layouts that fit, best first, and those left out with why
    (`dmuon.plan._recommend`)."""
    choices, rejected, planned = recommend(
        plan_cluster,
        model,
        args.world,
        tokens_per_step=tokens,
        hardware=hardware,
        active_parameters=active_parameters(model, config),
        ns_steps=args.ns_steps,
        ns_dtype=torch.float32 if args.ns_dtype == "float32" else torch.bfloat16,
        reduce_bytes=2 if args.reduce_dtype == "bfloat16" else 4,
        param_bytes=2 if args.param_dtype == "bfloat16" else 4,
        **kwargs,
    )
    if args.json:
        rows = [
            {
                "layout": c.layout,
                "step_seconds": c.step_seconds,
                "micro_batch_tokens": c.micro_batch_tokens,
                "headroom_bytes": c.headroom_bytes,
                "why": c.why,
                **c.plan.as_dict(),
            }
            for c in choices
        ]
        left_out = [{"layout": r.layout, "reason": r.reason} for r in rejected]
        print(json.dumps({"planned": planned, "choices": rows, "rejected": left_out}, indent=2))
        return 0 if choices else 1
    print(
        f"{args.model} on {args.world} GPUs ({hardware.describe()}), {tokens:,} tokens per "
        f"step: {len(choices)} layouts fit ({planned} plans made), fastest first; within "
        f"{WITHIN:.0%} of the fastest, most memory left first"
    )
    print(f"activations: {_activation_model(model)}")
    for place, choice in enumerate(choices, 1):
        print(f"{place:>3}. {choice.layout}: {choice.step_seconds * 1e3:,.0f} ms per step")
        print(f"     {choice.why}")
    if not choices:
        print("none fits: use more GPUs or a larger accelerator (--hardware)")
    if rejected:
        print("left out:")
        for left in rejected:
            print(f"  - {left.layout}: {left.reason}")
    return 0 if choices else 1


def _activation_model(model: torch.nn.Module) -> str:
    """The activation memory assumption in words, with its figure for this model."""
    per_token = activation_bytes_per_token(model)
    if per_token == 0:
        return "left out: the config gives no hidden size and layer count"
    return (
        f"{ACTIVATION_BYTES} bytes per token, layer and hidden unit (bfloat16, no "
        f"recomputation, fused attention): {per_token / 2**20:.2f} MiB per token of a "
        "micro-batch"
    )
