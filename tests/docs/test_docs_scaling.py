"""The Scaling page (EN + ZH): its tables are the planner's, and its typed figures are the
code's.

Oracles: `dmuon.plan.plan_cluster` run here on the same configs (the tables are rendered
when the site is built, so a stale or edited cell fails), `dmuon.optim.workspace_nbytes`,
and the cost formulas (old ``m² n`` against ``2 m² n + m³``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from docs_md import DOCS, ZH, built_page, html_tables

from dmuon.optim import workspace_nbytes
from dmuon.plan import active_parameters, load_config, meta_model, plan_cluster

MODELS = Path(__file__).parents[2] / "benchmarks" / "models"
NAMES = sorted(p.stem for p in MODELS.glob("*.json"))
PAGES = {"en": DOCS / "scaling.md", "zh": ZH / "scaling.md"}
GIB = 1024**3


@functools.cache
def _model(name: str) -> tuple[torch.nn.Module, int]:
    config = load_config(MODELS / f"{name}.json")
    model = meta_model(config)
    return model, active_parameters(model, config)


@functools.cache
def _plan(name: str, world: int, shard: int) -> Any:
    """``plan_cluster`` with the defaults the tables use (both languages' rows read one)."""
    model, active = _model(name)
    return plan_cluster(model, world, shard, active_parameters=active)


def test_three_models_are_planned_and_each_has_its_table_in_both_languages() -> None:
    assert NAMES == ["llama-3-70b", "llama-3-8b", "qwen3-30b-a3b"]
    for path in PAGES.values():
        text = path.read_text(encoding="utf-8")
        for name in NAMES:
            assert f"<!-- generated: scaling-{name} -->" in text
        assert json.loads((MODELS / "llama-3-8b.json").read_text())["hidden_size"] == 4096


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_rendered_rows_are_the_planners(site: Path, lang: str) -> None:
    """Every row of the built tables against a plan made here: the Newton-Schulz overhead
    (once per world, at most 2% everywhere), the calls, and the step against FSDP2 +
    AdamW's: at most 1.03x everywhere (the updates between replicas overlap the next
    forward), and at most 1x where FSDP2's all-reduce outlasts backward."""
    tables = [t for t in html_tables(built_page(site, "scaling.md", lang)) if len(t[0]) == 11]
    assert len(tables) == len(NAMES)
    order = ["llama-3-8b", "llama-3-70b", "qwen3-30b-a3b"]  # the page's order
    for name, table in zip(order, tables, strict=True):
        rows = table[1:]
        assert len(rows) == 9
        for row in rows:
            world = int(row[0].replace(",", ""))
            shard = int(row[1].split()[-1]) if "HSDP" in row[1] else world
            plan = _plan(name, world, shard)
            assert row[3] == f"{plan.ns_overhead:.2%}", (name, row)
            assert plan.ns_overhead <= 0.02
            assert row[8] == f"{plan.calls:,} / {plan.fsdp2_calls:,}"
            assert row[10] == f"{plan.step_ratio:.3f}"
            assert plan.step_ratio <= 1.03, (name, row)
            # Its all-reduce between replicas outlasts backward: DMuon's is smaller.
            if plan.fsdp2_overhead - plan.shard_overhead > 1e-12:
                assert plan.step_ratio <= 1.0, (name, row)


def test_typed_figures_come_from_the_code() -> None:
    en = " ".join(PAGES["en"].read_text(encoding="utf-8").split())
    zh = " ".join(PAGES["zh"].read_text(encoding="utf-8").split())
    model, active = _model("llama-3-70b")
    plan = plan_cluster(model, 64, 8, accum=8, no_sync=True, active_parameters=active)
    accumulator = round(plan.ranks[0].accumulator_bytes / GIB)
    assert f"about {accumulator} GiB" in en and f"约 {accumulator} GiB" in zh
    one = workspace_nbytes(
        1, 28672, 8192, torch.bfloat16, torch.device("cuda"), out_dtype=torch.float32
    )
    assert f"{one / GIB:.1f} GiB for Llama-3-70B" in en and f"{one / GIB:.1f} GiB" in zh
    # Square matrices against the MLP's (m/n = 4096/14336 = 8192/28672): new/old weights.
    lighter = 3 / (2 + 4096 / 14336)
    assert f"{lighter:.2f}x too light" in en and f"{lighter:.2f} 倍" in zh
    # The time model's rates are the presets'; the workspace cap is the optimizer's default.
    from dmuon.optim._blocks import DEFAULT_MAX_WORKSPACE_BYTES
    from dmuon.plan._hardware import parse_hardware

    h100, h200 = parse_hardware("h100"), parse_hardware("h200")
    assert h100.peak_tflops == h200.peak_tflops
    assert f"({h100.peak_tflops:g} TFLOP/s for H100 and H200)" in en
    assert f"H100 和 H200 为 {h100.peak_tflops:g} TFLOP/s" in zh
    assert f"at {h100.ns_tflops:g} TFLOP/s" in en and f"按 {h100.ns_tflops:g} TFLOP/s" in zh
    assert f"({h100.network_gbps:g} GB/s for H100)" in en
    assert f"({h100.node_gbps:g} GB/s NVLink for H100 and H200)" in en
    assert f"NVLink 为 {h100.node_gbps:g} GB/s" in zh
    assert f"costs {h100.latency_us:g} us besides" in en and f"还要花 {h100.latency_us:g} us" in zh
    assert f"H100 为 {h100.network_gbps:g} GB/s" in zh
    cap = DEFAULT_MAX_WORKSPACE_BYTES // GIB
    assert f"({cap} GiB by default)" in en and f"默认 {cap} GiB" in zh


def test_the_reduce_window_on_the_z2_z3_page_is_the_runtimes() -> None:
    from dmuon._ownership.gradients import REDUCES_IN_FLIGHT

    words = {4: ("four", "四")}
    en_word, zh_word = words[REDUCES_IN_FLIGHT + 2]
    en = " ".join((DOCS / "z2-vs-z3.md").read_text(encoding="utf-8").split())
    zh = (ZH / "z2-vs-z3.md").read_text(encoding="utf-8")
    for text in (en, zh):
        assert f"`REDUCES_IN_FLIGHT = {REDUCES_IN_FLIGHT}`" in text
    assert f"at most {en_word} hook boundaries' worth" in en
    assert f"至多保留{zh_word}个钩子边界" in zh


@pytest.mark.parametrize("page", ["communication.md", "hsdp.md", "scaling.md"])
@pytest.mark.parametrize("root", [DOCS, ZH], ids=["en", "zh"])
def test_the_chunk_of_updated_values_is_the_codes(root: Path, page: str) -> None:
    """The pages' chunk of updates between replicas is `CHUNK_BYTES`, and no other size is
    stated for it."""
    from dmuon._ownership.replica_updates import CHUNK_BYTES

    text = (root / page).read_text()
    assert f"{CHUNK_BYTES // 2**20} MiB" in text
    assert "1 GiB of float32" not in text and "1 GiB 的 float32" not in text


def test_the_ns_split_figures_are_the_planners() -> None:
    """The ``ns_split`` section's floors and results at 4,096 H100s (512 x 8, Z3), and the
    changelog's: the optimizer step's share of forward+backward, whole and split over
    blocks of 8."""
    en = " ".join(PAGES["en"].read_text(encoding="utf-8").split())
    zh = " ".join(PAGES["zh"].read_text(encoding="utf-8").split())
    whole, split = {}, {}
    for name in ("llama-3-8b", "llama-3-70b"):
        model, active = _model(name)
        whole[name] = plan_cluster(model, 4096, 8, active_parameters=active).optimizer_overhead
        split[name] = plan_cluster(
            model, 4096, 8, active_parameters=active, ns_split=8
        ).optimizer_overhead
        assert split[name] < 0.03 < whole[name]
    w8, w70 = f"{whole['llama-3-8b']:.1%}", f"{whole['llama-3-70b']:.1%}"
    s8, s70 = f"{split['llama-3-8b']:.1%}", f"{split['llama-3-70b']:.1%}"
    assert f"floor is {w8} of forward+backward for Llama-3-8B and {w70} for Llama-3-70B" in en
    assert f"falls to {s8} and {s70} of forward+backward" in en
    assert f"对 Llama-3-8B 是前向+反向的 {w8}，对 Llama-3-70B 是 {w70}" in zh
    assert f"优化器步降到前向+反向的 {s8} 和 {s70}" in zh
    # The changelog's entry states the same figures.
    log_en = " ".join((DOCS / "changelog.md").read_text(encoding="utf-8").split())
    log_zh = " ".join((ZH / "changelog.md").read_text(encoding="utf-8").split())
    assert f"falls from {w8} and {w70} of forward+backward to {s8} and {s70}" in log_en
    assert f"从前向+反向的 {w8} 和 {w70} 降到 {s8} 和 {s70}" in log_zh


def test_the_masters_once_per_world_figures_are_the_planners() -> None:
    """The HSDP page's and the changelog's figures for Llama-3-70B on 1,024 H100 (128 x 8,
    a bfloat16 forward): the busiest rank's masters with a float32 master on every owner
    (``param_bytes=4`` plans the same owners) and with copies off the stepping replica,
    and DMuon's memory per rank before (every owner's float32 master, and an averaged
    gradient counted per owned element) and now, beside FSDP2 + AdamW's."""
    from dmuon.plan._memory import dmuon_memory_bytes

    model, active = _model("llama-3-70b")
    narrow = plan_cluster(model, 1024, 8, active_parameters=active, param_bytes=2)
    wide = plan_cluster(model, 1024, 8, active_parameters=active, param_bytes=4)
    before_masters = max(r.master_bytes for r in wide.ranks) / GIB
    after_masters = max(r.master_bytes for r in narrow.ranks) / GIB
    assert after_masters < 0.55 * before_masters
    before_memory = max(
        dmuon_memory_bytes(narrow, now)
        + 2 * then.master_bytes
        - now.master_bytes
        - now.momentum_bytes
        + then.update_bytes
        - now.update_bytes
        for now, then in zip(narrow.ranks, wide.ranks, strict=True)
    )
    figures = [f"{before_masters:.2f}", f"{after_masters:.2f}"]
    en = " ".join((DOCS / "hsdp.md").read_text(encoding="utf-8").split())
    zh = (ZH / "hsdp.md").read_text(encoding="utf-8")
    assert f"masters at {figures[1]} GiB, from {figures[0]} GiB" in en
    assert (
        f"主副本为 {figures[1]} GiB，而每个所有者都保存 float32 主副本时为 {figures[0]} GiB" in zh
    )
    memory = [f"{before_memory / GIB:.2f}", f"{narrow.memory_bytes / GIB:.2f}"]
    fsdp2 = f"{narrow.fsdp2_memory_bytes / GIB:.2f}"
    log_en = " ".join((DOCS / "changelog.md").read_text(encoding="utf-8").split())
    log_zh = " ".join((ZH / "changelog.md").read_text(encoding="utf-8").split())
    assert f"fall from {figures[0]} GiB to {figures[1]} GiB" in log_en
    assert f"is {memory[1]} GiB, from {memory[0]} GiB (FSDP2 + AdamW: {fsdp2} GiB)" in log_en
    assert f"从 {figures[0]} GiB 降到 {figures[1]} GiB" in log_zh
    assert f"内存为 {memory[1]} GiB，此前为 {memory[0]} GiB（FSDP2 + AdamW：{fsdp2} GiB）" in log_zh


def test_the_recommend_figures_are_the_planners() -> None:
    """The ``--recommend`` section's example: Llama-3-8B on 64 H100 (float32 traffic, then
    bfloat16), and Llama-3-70B on 1,024 GPUs (layouts, plans, those left out)."""
    from dmuon.plan._recommend import layouts, recommend

    en = " ".join(PAGES["en"].read_text(encoding="utf-8").split())
    zh = " ".join(PAGES["zh"].read_text(encoding="utf-8").split())
    model, active = _model("llama-3-8b")
    choices, _, _ = recommend(plan_cluster, model, 64, active_parameters=active)
    first = choices[0]
    flat = next(c for c in choices if c.plan.replicas == 1 and c.plan.mode == "z3")
    assert (first.plan.replicas, first.plan.shard_size, first.plan.mode) == (8, 8, "z3")
    free = f"{first.headroom_bytes / 2**30:.1f} GiB"
    slower = f"{flat.step_seconds / first.step_seconds - 1:.0%}"
    tokens = f"{flat.micro_batch_tokens:,.0f}"
    assert f"({first.plan.accum} micro-batches, {free} free)" in en
    assert f"but is {slower} slower" in en and f"each micro-batch of {tokens} tokens" in en
    assert f"剩余 {free}）" in zh and f"但慢 {slower}" in zh and f"每 rank {tokens} 个 token" in zh
    narrow, _, _ = recommend(
        plan_cluster, model, 64, active_parameters=active, param_bytes=2, reduce_bytes=2
    )
    top = narrow[0]
    flat = next(c for c in narrow if c.plan.replicas == 1 and c.plan.mode == "z3")
    assert (top.plan.replicas, top.plan.mode) == (8, "z3")
    assert flat.step_seconds <= top.step_seconds * 1.01
    high, low = f"{top.headroom_bytes / 2**30:.1f}", f"{flat.headroom_bytes / 2**30:.1f}"
    assert f"{high} GiB free against {low}" in en
    assert f"剩余 {high} GiB，对 {low} GiB" in zh
    big, active70 = _model("llama-3-70b")
    fit, left, planned = recommend(
        plan_cluster, big, 1024, tokens_per_step=16_000_000, active_parameters=active70
    )
    count = 2 * len(layouts(1024))
    assert len(fit) + len(left) == count
    assert f"plans its {count} layouts in {planned} plans and lists the {len(left)}" in en
    assert f"{count} 种布局共做 {planned} 次规划，并列出放不下的 {len(left)} 种" in zh
    one_d = next(c for c in fit if c.plan.replicas == 1 and c.plan.mode == "z3")
    assert not one_d.plan.no_sync
    assert f"fits with each of its {one_d.plan.accum} micro-batches reduced" in en
    assert f"在 {one_d.plan.accum} 个微批次都各自归约时放得下" in zh
