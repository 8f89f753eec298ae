"""QK-clip (``dmuon.Muon(qk_clip=tau)``) against the published algorithm written out here.

Oracles:

- a single-process reference with its own attention code: it computes every logit in full
  (its own grouped-query gather and causal mask), records each head's maximum over the
  step's micro-batches, steps Muon written out (float32 Newton-Schulz) and
  ``torch.optim.AdamW`` on the global batch, then scales the query rows (and bias) of each
  head above tau by ``tau / max`` (grouped-query: the query head takes the whole factor) or,
  with one key head per query head, query and key rows by ``gamma ** alpha`` and
  ``gamma ** (1 - alpha)``. Parameters must agree within float32 rounding on 2 gloo ranks in
  Z2, Z3 and DDP and on a 2x2 HSDP mesh, with accumulation under ``no_sync``;
- with learning rates of zero the update changes nothing, so after the clip a head's
  largest logit on the same batch is exactly ``min(max, tau)`` (per layer for q/k norms),
  measured by that reference attention.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from dist_harness import run_in_order, spawn_ranks
from hf_models import config_of
from torch import nn

import dmuon

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, ACCUM, STEPS = 96, 10, 2, 2, 3
LR, ADAMW_LR, ADAMW_WD = 0.02, 3e-3, 0.01
TAU = 2.0
#: Larger initial weights than transformers' 0.02, so that logits reach TAU in a few steps.
INIT = 0.25

RECORDED: dict[str, torch.Tensor] = {}


def reference_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with every logit in full; records each head's maximum."""
    heads, kv_heads = query.shape[1], key.shape[1]
    shared = torch.arange(heads) // (heads // kv_heads)
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key[:, shared]) * scaling
    length = logits.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    if module.training:
        name = module._reference_name
        step_max = logits.detach().amax(dim=(0, 2, 3))
        RECORDED[name] = torch.maximum(RECORDED[name], step_max) if name in RECORDED else step_max
    probs = logits.softmax(-1)
    return (probs @ value[:, shared]).transpose(1, 2), probs


def _use_reference_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("qk_reference", reference_attention)
    AttentionMaskInterface.register("qk_reference", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation("qk_reference")
    for name, module in model.named_modules():
        if hasattr(module, "q_proj"):
            module._reference_name = name


def make_model(arch: str, **overrides: Any) -> nn.Module:
    torch.manual_seed(5)
    config = config_of(arch.split("-")[0], vocab=VOCAB, initializer_range=INIT, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config)


ARCHS = {
    "qwen2": {},  # 4 query heads, 2 key-value heads, q/k/v biases
    "llama-mha": {"num_key_value_heads": 4},
}


def global_batch(step: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(40 + step)
    return torch.randint(0, VOCAB, (world * ACCUM * MICRO, SEQ + 1), generator=gen)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


# ----- the reference ------------------------------------------------------------------------
def _clip_by_hand(model: nn.Module, alpha: float) -> tuple[dict[str, float], int]:
    """Scale each layer's heads above TAU, as published; return the layers' maxima and how
    many heads were clipped."""
    maxima = {}
    clipped = 0
    for name, module in model.named_modules():
        if name not in RECORDED:
            continue
        s = RECORDED.pop(name)
        maxima[name] = float(s.max())
        gamma = torch.where(s > TAU, TAU / s, torch.ones_like(s))
        clipped += int((s > TAU).sum())
        heads, dim = s.numel(), module.head_dim
        kv_heads = module.k_proj.weight.shape[0] // dim
        q_factor = gamma if kv_heads < heads else gamma**alpha
        k_factor = torch.ones(kv_heads) if kv_heads < heads else gamma ** (1 - alpha)
        for proj, factor in ((module.q_proj, q_factor), (module.k_proj, k_factor)):
            rows = factor.repeat_interleave(dim)
            proj.weight.data.mul_(rows[:, None])
            if proj.bias is not None:
                proj.bias.data.mul_(rows)
    return maxima, clipped


def reference_run(arch: str, world: int, alpha: float = 0.5) -> tuple[dict, list]:
    model = make_model(arch, **ARCHS[arch])
    probe = make_model(arch, **ARCHS[arch])
    dmuon.dedicate_params(probe)
    muon_names = {dp.fqn for dp in dmuon.dedicated_parameters(probe)}
    _use_reference_attention(model)
    params = dict(model.named_parameters())
    adamw = torch.optim.AdamW(
        [p for n, p in params.items() if n not in muon_names], lr=ADAMW_LR, weight_decay=ADAMW_WD
    )
    momentum = {n: torch.zeros_like(params[n]) for n in muon_names}
    reports = []
    for step in range(STEPS):
        tokens = global_batch(step, world)
        for micro in tokens.chunk(world * ACCUM):  # the same micro-batches the ranks see
            (_loss(model, micro) / (world * ACCUM)).backward()
        with torch.no_grad():
            for n in muon_names:
                p = params[n]
                momentum[n].lerp_(p.grad, 1 - 0.95)
                update = p.grad.lerp(momentum[n], 0.95)
                ortho = dmuon.newton_schulz(update, 5, "polar_express", dtype=torch.float32)
                p.add_(ortho, alpha=-LR * 0.2 * max(p.shape) ** 0.5)
                p.grad = None
        adamw.step()
        adamw.zero_grad()
        with torch.no_grad():
            reports.append(_clip_by_hand(model, alpha))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, reports


# ----- the distributed runs -----------------------------------------------------------------
def _data_parallel(layout: str, mesh_shape: tuple[int, ...]) -> int:
    """How many ranks split the batch: all of them, or the dp dimension under tp."""
    return mesh_shape[0] if layout == "tp" else math.prod(mesh_shape)


def _shard(model: nn.Module, mesh: Any, layout: str) -> nn.Module:
    """Dedicate and wrap: FSDP2 (after a tp plan under ``"tp"``) or DDP."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if layout == "tp":
        plan: dict[str, Any] = {}
        for i in range(len(model.model.layers)):
            for name in ("q_proj", "k_proj", "v_proj"):  # head rows and biases split over tp
                plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
            plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        mesh = mesh["dp"]
    z3 = layout != "z2"
    dmuon.dedicate_params(model, mesh, reshard_after_forward=z3)
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    return model


def _train(rank: int, world: int, arch: str, layout: str, mesh_shape: tuple[int, ...]) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh

    names = {"tp": ("dp", "tp")}.get(layout, ("replicate", "shard"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names[-len(mesh_shape) :])
    model = make_model(arch, **ARCHS[arch])
    wrapped = _shard(model, mesh, layout)
    optimizer = dmuon.Muon(
        wrapped,
        lr=LR,
        ns_dtype=torch.float32,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WD,
        qk_clip=TAU,
    )
    batch_ranks = _data_parallel(layout, mesh_shape)
    batch_rank = mesh["dp"].get_local_rank() if layout == "tp" else rank
    reports = []
    controls = []
    for step in range(STEPS):
        mine = global_batch(step, batch_ranks).chunk(batch_ranks)[batch_rank]
        for micro, tokens in enumerate(mine.chunk(ACCUM)):
            with dmuon.no_sync(wrapped) if micro + 1 < ACCUM else nullcontext():
                (_loss(wrapped, tokens) / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()
        report = optimizer.qk_clip_report
        reports.append((report.max_logits, report.clipped_heads))
        controls.append(dmuon.comm_audit(model).last_step().as_dict().get("control"))
    full = StateDictOptions(full_state_dict=True)
    params = {
        k: v.detach().clone() for k, v in dmuon.get_model_state_dict(model, options=full).items()
    }
    return {"params": params, "reports": reports, "controls": controls}


CASES = {
    2: [("qwen2", "z2", (2,)), ("qwen2", "z3", (2,)), ("qwen2", "ddp", (2,)),
        ("llama-mha", "z3", (2,))],
    4: [("qwen2", "z3", (2, 2)), ("qwen2", "tp", (2, 2))],
}  # fmt: skip


def _run_cases(rank: int, world: int, cases: list[tuple[str, str, tuple[int, ...]]]) -> dict:
    return run_in_order((case, lambda case=case: _train(rank, world, *case)) for case in cases)


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {world: spawn_ranks(world, _run_cases, cases) for world, cases in CASES.items()}


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], tuple[dict, list]]:
    return {
        (arch, _data_parallel(layout, shape)): reference_run(arch, _data_parallel(layout, shape))
        for cases in CASES.values()
        for arch, layout, shape in cases
    }


@pytest.mark.parametrize(
    ("world", "case"), [(world, case) for world, cases in CASES.items() for case in cases]
)
def test_parameters_match_the_written_out_algorithm(runs, references, world, case) -> None:
    arch, layout, shape = case
    expected, expected_reports = references[(arch, _data_parallel(layout, shape))]
    for rank, result in enumerate(runs[world]):
        assert "error" not in result[case], result[case]["error"]
        got = result[case]
        for name, value in expected.items():
            where = f"rank {rank} {name}"
            torch.testing.assert_close(
                got["params"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}"
            )
        for got_report, (want, want_clipped) in zip(got["reports"], expected_reports, strict=True):
            maxima, clipped = got_report
            assert maxima.keys() == want.keys() and clipped == want_clipped
            for layer, value in want.items():
                assert maxima[layer] == pytest.approx(value, rel=1e-5)
        # one MAX all-reduce of the 8 heads per mesh dimension, every step, on every rank
        # (under tp the step's own agreement on the tp-split matrices adds one more), and
        # one of one number per mesh dimension: whether a Muon gradient is not finite
        dims = len(shape)
        count = 2 * dims + (layout == "tp")
        assert [c["all_reduce"]["count"] for c in got["controls"]] == [count] * STEPS
    # the run is one where clipping happens, and not to every head
    clipped = [c for _, c in runs[world][0][case]["reports"]]
    heads = 2 * 4 * STEPS
    assert 0 < sum(clipped) < heads, clipped


# ----- exactness with a zero update, across families -----------------------------------------
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 8}),  # q_norm / k_norm
    "mistral": (transformers.MistralConfig, {}),
    "gemma": (transformers.GemmaConfig, {"head_dim": 8}),
    "gemma3": (transformers.Gemma3TextConfig, {"head_dim": 8, "query_pre_attn_scalar": 8}),
    "llama-mha": (transformers.LlamaConfig, {"num_key_value_heads": 4}),
}


def _family_model(family: str, layers: int = 2) -> nn.Module:
    make, extra = FAMILIES[family]
    torch.manual_seed(3)
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=INIT,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(make(**{**fields, **extra}))


def _reference_maxima(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each layer's per-head maxima on ``tokens``, by the reference attention."""
    implementation = model.config._attn_implementation
    _use_reference_attention(model)
    RECORDED.clear()
    with torch.no_grad():
        model(input_ids=tokens)
    model.set_attn_implementation(implementation)
    maxima = dict(RECORDED)
    RECORDED.clear()
    return maxima


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_clipped_head_ends_at_tau_on_the_batch_it_was_measured_on(family: str) -> None:
    # One layer: a clipped layer changes the inputs of the layers above it.
    model = _family_model(family, layers=1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(8))
    before = _reference_maxima(model, tokens)
    everything = torch.cat(list(before.values()))
    tau = float(everything.median())  # about half the heads are above it
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(
        model, lr=0.0, adamw_lr=0.0, adamw_weight_decay=0.0, weight_decay=0.0, qk_clip=tau
    )
    logits = model(input_ids=tokens).logits
    nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    report = optimizer.qk_clip_report
    assert report.max_logits == pytest.approx({n: float(s.max()) for n, s in before.items()})
    after = _reference_maxima(model, tokens)
    norms = hasattr(model.model.layers[0].self_attn, "q_norm")
    for name, s in before.items():
        if norms:  # one factor for the layer, from its largest head
            expected = s * min(1.0, tau / float(s.max()))
        else:
            expected = torch.minimum(s, torch.tensor(tau))
        torch.testing.assert_close(after[name], expected, rtol=2e-5, atol=1e-6)
    assert report.clipped_heads == int((everything > tau).sum())


def test_recording_counts_training_forwards_only() -> None:
    model = _family_model("qwen2")
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0, qk_clip=1e9)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(8))
    model.eval()
    with torch.no_grad():
        model(input_ids=tokens * 0 + 3)
    model.train()
    model(input_ids=tokens).logits.sum().backward()
    optimizer.step()
    expected = _reference_maxima(model, tokens)
    got = optimizer.qk_clip_report.max_logits
    assert got == pytest.approx({n: float(s.max()) for n, s in expected.items()}, rel=1e-5)
    optimizer.step()  # no forward since: nothing recorded, nothing clipped
    assert all(v == -math.inf for v in optimizer.qk_clip_report.max_logits.values())


def test_errors_say_what_to_do() -> None:
    model = _family_model("qwen2")
    dmuon.dedicate_params(model, predicate=lambda name, p: p.dim() == 2 and "mlp" in name)
    with pytest.raises(
        ValueError, match=r"q_proj\.weight and .*k_proj\.weight are not both dedicated"
    ):
        dmuon.Muon(model, qk_clip=100.0)
    model = _family_model("qwen2")
    dmuon.dedicate_params(model)
    with pytest.raises(ValueError, match="positive finite"):
        dmuon.Muon(model, qk_clip=0.0)
    with pytest.raises(ValueError, match=r"qk_clip_alpha must be in \[0, 1\]"):
        dmuon.Muon(model, qk_clip=100.0, qk_clip_alpha=1.5)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    dmuon.dedicate_params(plain, hook_boundary_strict=False)
    with pytest.raises(ValueError, match="no attention module"):
        dmuon.Muon(plain, qk_clip=100.0)


# ----- models of one's own ------------------------------------------------------------------
def test_the_recipes_own_model_records_through_record_attention_logits() -> None:
    """The preset transformer calls ``record_attention_logits``; its logits, computed by
    hand from the layer's input, are what the report shows and what the clip bounds."""
    from dataclasses import replace

    from dmuon.train.models.preset import PRESETS, build_model

    model = build_model(replace(PRESETS["tiny"], n_layers=1), seed=0)
    with torch.no_grad():  # larger query and key weights, so some heads pass tau
        for proj in (model.layers[0].attn.q_proj, model.layers[0].attn.k_proj):
            proj.weight.mul_(12.0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))

    @torch.no_grad()
    def by_hand() -> torch.Tensor:
        from dmuon.train.models.preset import _apply_rope

        attn, seen = model.layers[0].attn, []
        handle = attn.register_forward_pre_hook(lambda m, args: seen.append(args))
        model(tokens)
        handle.remove()
        x, cos, sin = seen[0]
        split = (2, 16, attn.n_heads, attn.head_dim)
        q = _apply_rope((x @ attn.q_proj.weight.T).view(split).transpose(1, 2), cos, sin)
        k = _apply_rope((x @ attn.k_proj.weight.T).view(split).transpose(1, 2), cos, sin)
        logits = q @ k.transpose(-1, -2) / attn.head_dim**0.5
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
        return logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))

    before = by_hand()
    tau = float(before.median())
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0, adamw_weight_decay=0.0, qk_clip=tau)
    logits = model(tokens)
    nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    assert optimizer.qk_clip_report.max_logits == {
        "layers.0.attn": pytest.approx(float(before.max()))
    }
    torch.testing.assert_close(
        by_hand(), torch.minimum(before, torch.tensor(tau)), rtol=2e-5, atol=1e-6
    )


def test_recording_is_left_out_of_compiled_layers_and_still_counts() -> None:
    """Under ``layer.compile()`` the recorder runs eagerly between compiled regions (it is
    built for ``torch.compiler.disable`` when the optimizer attaches it, not at import) and
    the report holds the same maxima as an eager forward of the same batch."""
    from dataclasses import replace

    import torch._dynamo

    from dmuon.train.models.preset import PRESETS, build_model

    model = build_model(replace(PRESETS["tiny"], n_layers=2), seed=0)
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0, adamw_weight_decay=0.0, qk_clip=1e9)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))

    def report() -> dict[str, float]:
        model(tokens).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return optimizer.qk_clip_report.max_logits

    eager = report()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        for layer in model.layers:
            layer.compile(backend="eager")
        compiled = report()
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
        breaks = list(torch._dynamo.utils.counters["graph_break"])
        assert any("function _record " in b and "compiler.disable" in b for b in breaks), breaks
    finally:
        torch._dynamo.reset()
    assert set(compiled) == {"layers.0.attn", "layers.1.attn"}
    assert compiled == pytest.approx(eager, rel=1e-6)


class _Silent(nn.Module):
    """Attention whose forward never reports its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 4
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) * self.k_proj(x)


def test_a_model_that_never_records_is_refused_before_anything_changes() -> None:
    model = nn.Sequential(_Silent(), nn.Linear(8, 8))
    dmuon.dedicate_params(model, hook_boundary_strict=False)
    optimizer = dmuon.Muon(model, qk_clip=10.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(ValueError, match="record_attention_logits"):
        optimizer.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_checkpoint_carries_nothing_extra_and_resumes_exactly() -> None:
    """Oracle: the uninterrupted run. QK-clip keeps no state across steps, so a run saved
    after step 2 and loaded into a fresh model and optimizer continues identically."""

    def build() -> tuple[nn.Module, dmuon.Muon]:
        model = make_model("qwen2")
        dmuon.dedicate_params(model)
        return model, dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, qk_clip=TAU)

    def step(model: nn.Module, optimizer: dmuon.Muon, index: int) -> int:
        _loss(model, global_batch(index, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return optimizer.qk_clip_report.clipped_heads

    straight, straight_opt = build()
    clipped = [step(straight, straight_opt, i) for i in range(3)]
    assert sum(clipped) > 0
    first, first_opt = build()
    for i in range(2):
        step(first, first_opt, i)
    model_sd, optim_sd = dmuon.get_state_dict(first, first_opt)
    assert not any("qk" in key for key in optim_sd.get("state", {}))
    resumed, resumed_opt = build()
    dmuon.set_state_dict(resumed, resumed_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert step(resumed, resumed_opt, 2) == clipped[2]
    for name, value in straight.named_parameters():
        torch.testing.assert_close(dict(resumed.named_parameters())[name], value, rtol=0, atol=0)
