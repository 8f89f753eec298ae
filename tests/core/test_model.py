"""The recipe's transformer: Llama naming, preset sizes, shapes, deterministic init."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dmuon.train import PRESETS, ModelConfig, build_model, lm_loss
from dmuon.train.models.preset import _apply_rope

# The table in dmuon.train.models.preset's docstring, computed by hand:
# 2*256*dim (embed + lm_head) + L * (4*dim^2 + mlp + 2*dim) + dim, where the MLP has
# 3*dim*ffn parameters, or experts * (3*dim*ffn + dim) with the router.
DOCUMENTED = {
    "tiny": (2, 64, 4, 192, 0, 139_584),
    "small": (4, 256, 4, 768, 0, 3_541_248),
    "base": (8, 512, 8, 1536, 0, 27_533_824),
    "moe": (2, 64, 4, 128, 4, 262_976),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_preset_sizes_match_documentation(name: str) -> None:
    layers, dim, heads, ffn, experts, params = DOCUMENTED[name]
    cfg = PRESETS[name]
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.ffn_dim) == (layers, dim, heads, ffn)
    assert cfg.n_experts == experts
    mlp = experts * (3 * dim * ffn + dim) if experts else 3 * dim * ffn
    by_formula = 2 * 256 * dim + layers * (4 * dim * dim + mlp + 2 * dim) + dim
    assert cfg.num_params == by_formula == params


def test_docstring_table_is_the_documented_one() -> None:
    import dmuon.train.models.preset as module

    rows = {}
    for line in (module.__doc__ or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in DOCUMENTED:
            layers, dim, heads, ffn = (int(c) for c in cells[1:5])
            experts = 0 if cells[5] == "-" else int(cells[5].split(",")[0])
            count = int(cells[6].split("(")[1].rstrip(")").replace(",", ""))
            rows[cells[0]] = (layers, dim, heads, ffn, experts, count)
    assert rows == DOCUMENTED


@pytest.mark.parametrize("name", ["tiny", "small", "moe"])
def test_built_model_has_documented_parameter_count(name: str) -> None:
    model = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == DOCUMENTED[name][5]


def test_parameter_names_follow_llama() -> None:
    model = build_model("tiny")
    expected = {"embed.weight", "norm.weight", "lm_head.weight"}
    for i in range(PRESETS["tiny"].n_layers):
        expected |= {f"layers.{i}.attn_norm.weight", f"layers.{i}.mlp_norm.weight"}
        expected |= {f"layers.{i}.attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert {n for n, _ in model.named_parameters()} == expected
    assert isinstance(model.layers, nn.ModuleList)
    assert isinstance(model.embed, nn.Embedding)
    # Untied head: a separate tensor from the embedding.
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()


def test_muon_targets_are_exactly_the_hidden_linears() -> None:
    """The hidden 2-D Linear weights are q/k/v/o and gate/up/down; nothing else is."""
    model = build_model("tiny")
    linears = {
        f"{name}.weight"
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name != "lm_head"
    }
    assert linears == {n for n, _ in model.named_parameters() if n.endswith("_proj.weight")}
    assert len(linears) == 7 * PRESETS["tiny"].n_layers


def test_default_predicate_of_dedicate_params_selects_the_projections() -> None:
    import dmuon

    model = build_model("tiny")
    owners = dmuon.dedicate_params(model)
    assert set(owners) == {f"layers.{i}.{m}_proj.weight" for i in range(2) for m in [
        "attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"]}  # fmt: skip
    assert set(owners.values()) == {0}


def test_moe_preset_layout_and_what_the_default_predicate_selects() -> None:
    """Fused 3-D stacks in transformers' layout, dedicated whole; the router stays out."""
    import dmuon

    model = build_model("moe")
    cfg = PRESETS["moe"]
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (cfg.n_experts, 2 * cfg.ffn_dim, cfg.dim)
    assert experts.down_proj.shape == (cfg.n_experts, cfg.dim, cfg.ffn_dim)
    assert model.layers[0].mlp.gate.weight.shape == (cfg.n_experts, cfg.dim)
    owners = dmuon.dedicate_params(model)
    stacks = {
        f"layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }
    attention = {f"layers.{i}.attn.{m}_proj.weight" for i in range(2) for m in "qkvo"}
    assert set(owners) == stacks | attention


def test_moe_forward_equals_a_per_token_reference() -> None:
    """Oracle: every token's output written out by hand from its top-k experts."""
    cfg = ModelConfig(n_layers=1, dim=8, n_heads=2, ffn_dim=6, n_experts=3, top_k=2)
    moe = build_model(cfg, seed=4).layers[0].mlp
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = moe(x)
        gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
        for b in range(2):
            for t in range(5):
                token = x[b, t]
                probs = torch.softmax(moe.gate.weight @ token, dim=0)
                top = sorted(range(3), key=lambda e: -probs[e].item())[:2]
                expected = torch.zeros(8)
                for e in top:
                    h = gate_up[e] @ token
                    g, u = h[:6], h[6:]
                    weight = probs[e] / sum(probs[i] for i in top)
                    expected += weight * (down[e] @ (g * torch.sigmoid(g) * u))
                torch.testing.assert_close(out[b, t], expected, rtol=1e-5, atol=1e-6)


def test_moe_config_errors() -> None:
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(n_layers=1, dim=8, n_heads=2, ffn_dim=4, n_experts=2, top_k=3)


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    model = build_model("tiny", max_seq_len=32)
    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (3, 32, 256)
    assert logits.dtype == torch.float32
    # Small init: predictions are close to uniform, loss within 0.1 of ln(256).
    assert abs(lm_loss(logits, tokens).item() - math.log(256)) < 0.1


def test_too_long_sequence_is_a_clear_error() -> None:
    model = build_model("tiny", max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = build_model("tiny", max_seq_len=24)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, 256, (2, 24), generator=gen)
    b = a.clone()
    b[:, 12:] = torch.randint(0, 256, (2, 12), generator=gen)
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :12], lb[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_rotary_embedding_is_a_rotation() -> None:
    """RoPE preserves norms and makes q.k depend only on the position difference."""
    cfg = ModelConfig(n_layers=1, dim=16, n_heads=2, ffn_dim=8, max_seq_len=64)
    model = build_model(cfg)
    cos, sin = model.rope_cos, model.rope_sin
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(8, generator=gen), torch.randn(8, generator=gen)

    def at(x: torch.Tensor, pos: int) -> torch.Tensor:
        return _apply_rope(x, cos[pos], sin[pos])

    torch.testing.assert_close(at(q, 7).norm(), q.norm())
    torch.testing.assert_close(at(q, 5) @ at(k, 2), at(q, 40) @ at(k, 37), rtol=1e-5, atol=1e-5)


def test_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b, c = build_model("tiny", seed=5), build_model("tiny", seed=5), build_model("tiny", seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_scales() -> None:
    model = build_model("small")
    n_layers = PRESETS["small"].n_layers
    assert model.norm.weight.eq(1).all()
    assert abs(model.layers[0].attn.q_proj.weight.std().item() - 0.02) < 0.002
    out_std = 0.02 / math.sqrt(2 * n_layers)
    assert abs(model.layers[0].mlp.down_proj.weight.std().item() - out_std) < 0.1 * out_std


def test_unknown_preset_and_bad_config() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_model("huge")
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(n_layers=1, dim=10, n_heads=3, ffn_dim=4)
