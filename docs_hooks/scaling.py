"""The Scaling page's tables, computed by `dmuon.plan` when the site is built.

``<!-- generated: scaling-MODEL -->`` renders one table per model of
``benchmarks/models/MODEL.json``: every layout of `LAYOUTS`, planned with
`dmuon.plan.plan_cluster` under its default time model (H100, 4M tokens per step, Z3).
The "every replica" column plans the same mesh as if each replica ran its owners'
Newton-Schulz iterations itself (the plan over the shard ranks alone), which is what
HSDP did before the plan covered every rank of the mesh. No number on the page is typed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

MODELS = Path(__file__).parents[1] / "benchmarks" / "models"

#: ``(GPUs, shard size)``: 1-D meshes, and HSDP with shard groups of 8 and of 64.
LAYOUTS: tuple[tuple[int, int], ...] = (
    (8, 8),
    (64, 64),
    (128, 128),
    (1024, 1024),
    (64, 8),
    (128, 8),
    (1024, 8),
    (128, 64),
    (1024, 64),
)

HEADERS = {
    "en": (
        "GPUs",
        "mesh",
        "Newton-Schulz, in every replica",
        "Newton-Schulz, once per world",
        "busiest rank (ms)",
        "imbalance",
        "masters + momentum (GiB)",
        "workspace (GiB)",
        "calls per step (DMuon / FSDP2)",
        "exposed between replicas",
        "step: DMuon / FSDP2 + AdamW",
    ),
    "zh": (
        "GPU 数",
        "网格",
        "Newton-Schulz（每个副本都算）",
        "Newton-Schulz（整个集群只算一次）",
        "最忙的 rank（毫秒）",
        "不均衡度",
        "主副本 + 动量（GiB）",
        "工作区（GiB）",
        "每步调用数（DMuon / FSDP2）",
        "副本间通信的暴露部分",
        "每步时间：DMuon / FSDP2 + AdamW",
    ),
}
MESH = {
    "en": ("1-D", "HSDP {r} x {s}"),
    "zh": ("一维", "HSDP {r} x {s}"),
}


@functools.cache
def _model(name: str) -> tuple[object, int]:
    from dmuon.plan import active_parameters, load_config, meta_model

    config = load_config(MODELS / f"{name}.json")
    model = meta_model(config)
    return model, active_parameters(model, config)


@functools.cache
def _row(name: str, world: int, shard: int) -> tuple[str, ...]:
    from dmuon._ownership.selection import plan_dedication
    from dmuon.plan import plan_cluster

    model, active = _model(name)
    plan = plan_cluster(model, world, shard, active_parameters=active)  # type: ignore[arg-type]
    replicated = plan_dedication(model, shard, 1).plan  # type: ignore[arg-type]
    per_iteration = 2 * plan.ns_steps / (plan.hardware.ns_tflops * 1e12)
    before = max(replicated.loads) * per_iteration / plan.forward_backward_seconds
    gib = 1024**3
    held = max(r.master_bytes + r.momentum_bytes for r in plan.ranks) / gib
    workspace = max(r.workspace_bytes for r in plan.ranks) / gib
    return (
        f"{world:,}",
        f"{plan.replicas}x{shard}",
        f"{before:.2%}",
        f"**{plan.ns_overhead:.2%}**",
        f"{plan.busiest.ns_seconds * 1e3:.1f}",
        f"{plan.ns_imbalance:.2f}",
        f"{held:.1f}",
        f"{workspace:.2f}",
        f"{plan.calls:,} / {plan.fsdp2_calls:,}",
        f"{plan.update_overhead + plan.reduce_overhead:.1%}" if plan.replicas > 1 else "-",
        f"{plan.step_ratio:.3f}",
    )


def render(name: str, lang: str) -> str:
    """The Markdown table of model ``name`` in language ``lang``."""
    headers = HEADERS[lang]
    flat, hsdp = MESH[lang]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for world, shard in LAYOUTS:
        cells = list(_row(name, world, shard))
        replicas = world // shard
        cells[1] = flat if replicas == 1 else hsdp.format(r=replicas, s=shard)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[str], str]] = {
    f"scaling-{path.stem}": (lambda lang, stem=path.stem: render(stem, lang))
    for path in sorted(MODELS.glob("*.json"))
}
