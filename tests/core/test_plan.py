"""`dmuon.plan` (`python -m dmuon.plan`): the cluster planner against formulas and its own
contract. Its predictions against measurement (the comm audit and ``FlopCounterMode`` on
gloo) are in test_hsdp.py.

Oracles: the shapes of a Llama layer written out from its config (elements, Newton-Schulz
multiply-adds ``2 m² n + m³``), the time model's formula, and the scale criteria of the
scaling page (Newton-Schulz overhead at most 2% of forward+backward, 70B's workspace at most
4 GiB at shard groups of 8).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dmuon.plan import (
    active_parameters,
    load_config,
    meta_model,
    parse_hardware,
    parse_tokens,
    plan_cluster,
)
from dmuon.plan.__main__ import main

MODELS = Path(__file__).parents[2] / "benchmarks" / "models"
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "tie_word_embeddings": False,
}


def _tiny_matrices() -> list[tuple[int, int]]:
    """The dedicated matrices of `TINY`, written out: per layer q, k, v, o, gate, up, down."""
    d, i, hd = 64, 96, 64 // 4
    layer = [(4 * hd, d), (2 * hd, d), (2 * hd, d), (d, 4 * hd), (i, d), (i, d), (d, i)]
    return layer * 3


def _iteration(rows: int, cols: int) -> int:
    m, n = sorted((rows, cols))
    return 2 * m * m * n + m**3


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--model",
        "--world",
        "--shard-size",
        "--tokens-per-step",
        "--mode",
        "--accum",
        "--no-sync",
        "--hardware",
        "--ns-dtype",
        "--ns-gram",
        "--json",
    ):
        assert flag in text


def test_json_totals_follow_the_config(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--model", str(tiny_dir), "--world", "8", "--shard-size", "4", "--json")
    plan = json.loads(out)
    matrices = _tiny_matrices()
    p_m = sum(r * c for r, c in matrices)
    assert (plan["world"], plan["shard_size"], plan["replicas"]) == (8, 4, 2)
    assert plan["dedicated_elements"] == p_m and plan["matrices"] == len(matrices)
    ranks = plan["ranks"]
    assert len(ranks) == 8
    # Each matrix is stepped on one rank of the whole mesh, and mastered once per replica.
    assert sum(r["momentum_bytes"] for r in ranks) == 4 * p_m
    assert sum(r["master_bytes"] for r in ranks if r["replica"] == 0) == 4 * p_m
    assert sum(r["ns_flops"] for r in ranks) == 2 * 5 * sum(_iteration(*s) for s in matrices)
    # The time model: 6 x parameters x tokens at the measured 34% of 989 TFLOP/s, per rank.
    parameters = p_m + 2 * 100 * 64 + 3 * 2 * 64 + 64  # + embed, head, norms
    assert plan["parameters"] == parameters
    expected = 6 * parameters * 4_000_000 / (0.34 * 989e12 * 8)
    assert plan["forward_backward_seconds"] == pytest.approx(expected)
    busiest = max(r["ns_flops"] for r in ranks)
    assert plan["ns_overhead"] == pytest.approx(busiest / 600e12 / expected)


def test_text_output_states_every_assumption(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--world",
        "4",
        "--hardware",
        "b200",
        "--tokens-per-step",
        "512k",
    )
    assert "a 1-D mesh of 4 ranks" in out
    assert "Newton-Schulz at 1365 TFLOP/s" in out and "34% of 2250 TFLOP/s" in out
    assert "512,000 tokens per step" in out
    assert "FSDP2" in out and "masters" in out and "momentum" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "6", "--shard-size", "4"], "must divide the world size 6"),
        (["--world", "0"], "the world size must be at least 1 rank"),
        (["--world", "4", "--ns-steps", "0"], "ns_steps must be at least 1"),
        (["--world", "4", "--max-workspace-bytes", "-5"], "max_workspace_bytes must be a positive"),
        (["--world", "4", "--hardware", "tpu"], "neither one of ['b200', 'h100', 'h200']"),
        (["--world", "4", "--tokens-per-step", "lots"], "not a positive count"),
        (["--world", "4", "--tp", "3"], "tensor-parallel size 3 must divide the world size 4"),
        (["--world", "4", "--tp", "0"], "tensor-parallel size must be at least 1, got 0"),
        (["--world", "8", "--tp", "2", "--shard-size", "3"], "divide the 4 data-parallel ranks"),
    ],
)
def test_bad_input_says_what_to_pass(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_dir), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_tensor_parallel_splits_the_planned_matrices_by_the_configs_tp_plan(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--tp 2`` each rank holds half of every matrix Llama's tp plan splits (all
    seven per layer), the tp group gathers and scatters each matrix its owner steps, and
    the Newton-Schulz work of the whole world is the same as without tensor parallelism
    (each matrix is orthogonalized once, by one rank of its tp group)."""
    flat = json.loads(_run(capsys, "--model", str(tiny_dir), "--world", "2", "--json"))
    split = json.loads(
        _run(capsys, "--model", str(tiny_dir), "--world", "4", "--tp", "2", "--json")
    )
    assert [(r["rank"], r["shard"], r["tp"]) for r in split["ranks"]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1),
    ]  # fmt: skip
    by_shard = {r["shard"]: r for r in flat["ranks"]}
    for rank in split["ranks"]:
        whole = by_shard[rank["shard"]]
        assert rank["master_bytes"] * 2 == whole["master_bytes"]
        gathers = rank["tensor_collectives"]["gather"]
        assert gathers == rank["tensor_collectives"]["scatter"]
        assert gathers["elements"] * 4 == whole["master_bytes"]  # every owned matrix, whole
    assert sum(r["ns_flops"] for r in split["ranks"]) == sum(r["ns_flops"] for r in flat["ranks"])
    assert "x tensor parallel 2" in _run(
        capsys, "--model", str(tiny_dir), "--world", "4", "--tp", "2"
    )


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        load_config(tmp_path)


def test_parsers() -> None:
    assert parse_tokens("4M") == 4_000_000 and parse_tokens("512k") == 512_000
    assert parse_tokens("1048576") == 1_048_576
    custom = parse_hardware("1000,25")
    assert (custom.peak_tflops, custom.network_gbps) == (1000.0, 25.0)
    assert custom.ns_tflops == pytest.approx(1000 * 600 / 989, abs=0.1)


@functools.cache
def _model(name: str) -> tuple[nn.Module, int]:
    config = load_config(MODELS / f"{name}.json")
    model = meta_model(config)
    return model, active_parameters(model, config)


def _total_iteration_cost(model: nn.Module) -> int:
    """Multiply-adds of one iteration over every matrix Muon trains, from the parameters:
    the layers' 2-D projections (not the router) and every expert of the 3-D stacks."""
    total = 0
    for name, p in model.named_parameters():
        if ".layers." not in name or name.endswith("mlp.gate.weight") or p.ndim < 2:
            continue
        count = p.shape[0] if p.ndim == 3 else 1
        total += count * _iteration(p.shape[-2], p.shape[-1])
    return total


#: Every layout of the scaling page: 1-D meshes and HSDP with shard groups of 8 and 64.
LAYOUTS = (
    [(world, world) for world in (8, 64, 1024)]
    + [(world, 8) for world in (64, 128, 1024)]
    + [(world, 64) for world in (128, 1024)]
)


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "qwen3-30b-a3b"])
def test_newton_schulz_stays_within_two_percent_at_every_scale(name: str) -> None:
    model, active = _model(name)
    for world, shard in LAYOUTS:
        plan = plan_cluster(model, world, shard, active_parameters=active)
        assert plan.ns_overhead <= 0.02, (name, world, shard, plan.ns_overhead)
        # Every matrix is iterated once in the whole world, whatever the replicas.
        assert sum(r.ns_flops for r in plan.ranks) == sum(plan.owner_plan.loads) * 2 * 5
        # Within a replica, Z3: one call per boundary and direction (FSDP2 adds its root's);
        # between replicas, a reduce-scatter per boundary and an all-gather per GiB.
        assert plan.calls <= 2 * plan.fsdp2_calls, (name, world, shard, plan.calls)
        for rank in plan.ranks:
            assert sum(t.count for t in rank.shard_collectives.values()) == 3 * plan.boundaries


def test_llama_70b_workspace_at_shard_groups_of_8_fits_in_4_gib() -> None:
    model, active = _model("llama-3-70b")
    for world in (64, 1024):
        plan = plan_cluster(model, world, 8, active_parameters=active)
        assert max(r.workspace_bytes for r in plan.ranks) <= 4 * 1024**3


def test_no_sync_accumulation_that_cannot_fit_is_warned_with_what_to_do() -> None:
    model, active = _model("llama-3-70b")
    plan = plan_cluster(model, 64, 8, accum=8, no_sync=True, active_parameters=active)
    accumulator = plan.ranks[0].accumulator_bytes
    assert accumulator == 4 * plan.dedicated_elements > 250 * 1024**3
    assert any("accumulate without dmuon.no_sync" in w for w in plan.warnings)
    quiet = plan_cluster(model, 64, 8, accum=8, no_sync=False, active_parameters=active)
    assert not any("no_sync" in w for w in quiet.warnings)


@pytest.mark.parametrize("gram", [False, True])
def test_the_gram_iterations_flops_are_what_a_flop_counter_counts(gram: bool) -> None:
    """One process, float32 iteration: the plan's FLOPs against `FlopCounterMode` in
    ``optimizer.step()``, with the Gram iteration on the matrices it applies to (the
    4 x 1 and 1 x 3 aspect ratios) and the standard one on the square matrix."""
    from torch.utils.flop_counter import FlopCounterMode

    import dmuon

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Module()
        model.layers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(64, 256, bias=False),
                nn.Linear(256, 64, bias=False),
                nn.Linear(64, 64, bias=False),
                nn.Linear(64, 192, bias=False),
            )
            for _ in range(2)
        )
        return model

    plan = plan_cluster(
        build(), 1, tokens_per_step=1024, ns_dtype=torch.float32, ns_gram=gram, device_type="cpu"
    )
    model = build()
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, ns_dtype=torch.float32, ns_gram=gram)
    x = torch.randn(4, 64)
    sum(layer(x).square().mean() for layer in model.layers).backward()
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    assert plan.ranks[0].ns_flops == counter.get_total_flops() > 0
    # The formula, by hand: 8 matrices, 5 iterations (m the short side, n the long one).
    standard = [2 * m * m * n + m**3 for m, n in ((64, 256),) * 2 + ((64, 64), (64, 192))]
    grams = [2 * m * m * n + 17 * m**3 for m, n in ((64, 256),) * 2 + ((64, 192),)]
    by_hand = 2 * 2 * (sum(grams) + 5 * (64**3 * 3)) if gram else 2 * 2 * 5 * sum(standard)
    assert plan.ranks[0].ns_flops == by_hand


@pytest.mark.parametrize("reduce_bytes", [4, 2])
def test_the_step_against_fsdp2_and_adamw_follows_the_time_model(reduce_bytes: int) -> None:
    """The figures beside FSDP2 + AdamW's, by hand from the model's sizes and the calls the
    plan counts, each call costing the hardware's latency on top of its bytes: FSDP2's
    all-reduce between replicas (every parameter, 2 (R - 1)/R of the rank's shard, one
    call per layer and root) past backward; DMuon's updates past the next forward
    (bfloat16, the iteration's dtype, and a few scalars per row: within 1% of 2 bytes per
    owned element), its backward traffic (the owned gradients' reduce-scatter and FSDP2's
    all-reduce of the rest) past backward."""
    model, active = _model("qwen3-30b-a3b")
    plan = plan_cluster(model, 1024, 8, active_parameters=active, reduce_bytes=reduce_bytes)
    rate = plan.hardware.network_gbps * 1e9
    latency = plan.hardware.latency_us * 1e-6
    share = (plan.replicas - 1) / plan.replicas
    fb = plan.forward_backward_seconds
    units = plan.boundaries + 1
    fsdp2 = 2 * share * plan.parameters / plan.shard_size * reduce_bytes / rate + units * latency
    assert plan.fsdp2_reduce_seconds == pytest.approx(fsdp2)
    # Both sides pay the shard group's exposed gathers and reduce-scatters alike.
    between = max(0.0, fsdp2 - 2 * fb / 3) / fb
    assert plan.fsdp2_overhead == pytest.approx(between + plan.shard_overhead)
    rest = (plan.parameters - plan.dedicated_elements) / plan.shard_size
    worst_update = worst_reduce = 0.0
    for rank in plan.ranks:
        owned = rank.master_bytes / 4
        assert 2 * owned < rank.update_bytes < 2 * owned * 1.01
        shared = rank.replicate_collectives
        calls = sum(shared[k].count for k in ("broadcast", "all_gather") if k in shared)
        assert rank.update_seconds == pytest.approx(
            rank.update_bytes * share / rate + calls * latency
        )
        scattered = shared["reduce_scatter"].count
        backward = (owned * share + 2 * share * rest) * reduce_bytes / rate
        backward += (scattered + units) * latency
        assert rank.replicate_reduce_seconds == pytest.approx(backward)
        assert rank.tp_seconds == 0.0  # no tensor parallelism here
        worst_update = max(worst_update, rank.update_seconds - fb / 3)
        worst_reduce = max(worst_reduce, backward - 2 * fb / 3)
    assert plan.update_overhead == pytest.approx(max(0.0, worst_update) / fb)
    assert plan.reduce_overhead == pytest.approx(max(0.0, worst_reduce) / fb)
    assert plan.reduce_overhead > 0  # the MoE's reduces outlast backward: they show
    # The step waits for Newton-Schulz on its busiest rank and for the ranks' agreement
    # on non-finite gradients: one all-reduce of one number per mesh dimension, latency.
    dims = (plan.shard_size > 1) + (plan.replicas > 1)
    slowest = max(r.ns_seconds for r in plan.ranks) + dims * latency
    assert all(r.agreement_seconds == pytest.approx(dims * latency) for r in plan.ranks)
    assert plan.optimizer_overhead == pytest.approx(slowest / fb)
    dmuon_side = plan.optimizer_overhead + plan.update_overhead + plan.reduce_overhead
    expected = (1 + dmuon_side + plan.shard_overhead) / (1 + plan.fsdp2_overhead)
    assert plan.step_ratio == pytest.approx(expected)


def test_tensor_parallel_gathers_and_scatters_are_timed_inside_the_node() -> None:
    """Under tensor parallelism the rank that steps a split matrix waits for its float32
    gather and scatter inside the node, and their calls' latency: the step pays the
    slowest rank's Newton-Schulz plus that."""
    model, active = _model("llama-3-8b")
    plan = plan_cluster(model, 64, tp=8, active_parameters=active)
    node = plan.hardware.node_gbps * 1e9
    latency = plan.hardware.latency_us * 1e-6
    timed = [r for r in plan.ranks if r.tensor_collectives]
    assert timed
    for rank in plan.ranks:
        moved = sum(t.elements for t in rank.tensor_collectives.values()) * 4
        calls = sum(t.count for t in rank.tensor_collectives.values())
        assert rank.tp_seconds == pytest.approx(moved / node + calls * latency)
    slowest = max(r.ns_seconds + r.tp_seconds + r.agreement_seconds for r in plan.ranks)
    assert all(r.agreement_seconds == pytest.approx(2 * latency) for r in plan.ranks)  # dp, tp
    assert plan.optimizer_overhead == pytest.approx(slowest / plan.forward_backward_seconds)
    assert plan.optimizer_overhead > plan.ns_overhead


def test_memory_per_rank_is_counted_alike_for_both_sides() -> None:
    """DMuon's and FSDP2 + AdamW's memory per rank, by hand from the documented parts
    (`dmuon.plan._memory`): 16 bytes a sharded element, two bfloat16 layers, the
    micro-batch's activations; DMuon adds its rank's share and the averaged gradients of
    the matrices it steps (as many elements as its momentum)."""
    from dmuon.plan._memory import ACTIVATION_BYTES

    model, active = _model("llama-3-8b")
    plan = plan_cluster(
        model, 64, 8, accum=8, no_sync=True, no_sync_scope="replicas", active_parameters=active
    )
    config = model.config
    per_token = ACTIVATION_BYTES * config.hidden_size * config.num_hidden_layers
    assert plan.activation_bytes_per_token == per_token
    micro_tokens = plan.tokens_per_step / 64 / 8

    def common(elements: int) -> float:
        return 16 * elements / 8 + 4 * elements / plan.boundaries + micro_tokens * per_token

    assert plan.fsdp2_memory_bytes == int(common(plan.parameters))
    other = plan.parameters - plan.dedicated_elements
    dmuon = max(
        int(common(other) + r.added_bytes + r.momentum_bytes + r.update_bytes) for r in plan.ranks
    )
    assert plan.memory_bytes == dmuon
    assert plan.as_dict()["memory_bytes"] == dmuon


def test_recommend_ranks_the_layouts_that_fit_with_the_fewest_micro_batches() -> None:
    from dmuon.plan._recommend import WITHIN, Choice, layouts, recommend

    model, active = _model("llama-3-8b")
    choices, rejected, planned = recommend(plan_cluster, model, 16, active_parameters=active)
    assert layouts(16) == [8, 16] and choices and planned >= len(choices)
    # At most four plans per layout and mode: 1 micro-batch, 2 under no_sync, 2 each
    # reduced, then the fewest that fit, found from the 2-micro-batch plan's memory.
    assert planned <= 4 * 2 * len(layouts(16))
    fastest = min(c.step_seconds for c in choices)
    close = [c for c in choices if c.step_seconds <= fastest * (1 + WITHIN)]
    assert choices[: len(close)] == sorted(close, key=lambda c: -c.headroom_bytes)
    rest = [c.step_seconds for c in choices[len(close) :]]
    assert rest == sorted(rest)
    for choice in choices:
        plan = choice.plan
        assert plan.fits and plan.memory_bytes <= 80 * 1024**3
        assert choice.headroom_bytes == 80 * 1024**3 - plan.memory_bytes
        assert choice.micro_batch_tokens == 4_000_000 / 16 / plan.accum
        assert (plan.no_sync_scope == "replicas") == (
            plan.no_sync and plan.accum > 1 and plan.replicas > 1
        )
        if plan.accum > 1:  # the fewest micro-batches: one step down does not fit
            fewer = plan_cluster(
                model,
                16,
                plan.shard_size,
                mode=plan.mode,
                accum=plan.accum // 2,
                no_sync=plan.no_sync and plan.accum // 2 > 1,
                no_sync_scope=plan.no_sync_scope if plan.accum // 2 > 1 else "all",
                active_parameters=active,
            )
            assert not fewer.fits, choice.layout
        assert "GiB" in Choice(plan).why and "FSDP2 + AdamW" in choice.why
    # Every (layout, mode) is either a choice or left out with its reason.
    assert len(choices) + len(rejected) == 2 * len(layouts(16))
    for left in rejected:
        assert "does not fit by" in left.reason and "GiB" in left.reason, left


def test_the_planner_refuses_what_dedication_refuses_and_reports_its_imbalance() -> None:
    model, active = _model("llama-3-8b")
    with pytest.raises(ValueError, match=r"a 3-D mesh, which dmuon\.dedicate_params refuses"):
        plan_cluster(model, 32, 8, tp=2, active_parameters=active)
    plan = plan_cluster(model, 1024, 8, active_parameters=active)
    seconds = [r.ns_seconds for r in plan.ranks]
    assert plan.ns_imbalance == pytest.approx(max(seconds) / (sum(seconds) / len(seconds)))
    assert plan.ns_imbalance > 2  # fewer matrices than ranks: far from the mean
