"""Owner planning and parameter selection (pure functions, no process group)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tiny_llama import TinyLlama
from torch import nn

import dmuon
from dmuon._ownership.planner import find_hook_boundary, newton_schulz_cost


def llama_shapes(layers: int, dim: int = 512, ffn: int = 1376, kv: int = 256):
    """Shapes and boundaries of a Llama-style model with grouped-query attention."""
    shapes, boundaries = {}, {}
    for i in range(layers):
        for name, shape in {
            "attn.q_proj": (dim, dim),
            "attn.k_proj": (kv, dim),
            "attn.v_proj": (kv, dim),
            "attn.o_proj": (dim, dim),
            "mlp.gate_proj": (ffn, dim),
            "mlp.up_proj": (ffn, dim),
            "mlp.down_proj": (dim, ffn),
        }.items():
            fqn = f"layers.{i}.{name}.weight"
            shapes[fqn] = shape
            boundaries[fqn] = f"layers.{i}"
    return shapes, boundaries


def test_every_matrix_has_exactly_one_valid_owner() -> None:
    shapes, boundaries = llama_shapes(8)
    plan = dmuon.plan_owners(shapes, 4, boundaries)
    assert list(plan.owners) == list(shapes)
    assert set(plan.owners.values()) <= set(range(4))
    loads = [0] * 4
    for fqn, owner in plan.owners.items():
        loads[owner] += newton_schulz_cost(shapes[fqn])
    assert tuple(loads) == plan.loads  # the reported loads are the real ones


def test_plan_is_deterministic() -> None:
    shapes, boundaries = llama_shapes(8)
    plans = [dmuon.plan_owners(dict(shapes), 4, dict(boundaries)) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]


def test_imbalance_on_eight_layers_at_four_ranks() -> None:
    shapes, boundaries = llama_shapes(8)
    plan = dmuon.plan_owners(shapes, 4, boundaries)
    assert plan.imbalance == pytest.approx(max(plan.loads) / (sum(plan.loads) / 4))
    assert plan.imbalance <= 1.15


def test_same_layer_matrices_are_spread_over_ranks() -> None:
    shapes, boundaries = llama_shapes(8)
    plan = dmuon.plan_owners(shapes, 4, boundaries)
    for i in range(8):
        owners = {o for f, o in plan.owners.items() if boundaries[f] == f"layers.{i}"}
        # seven matrices per layer over four ranks: every rank serves each layer
        assert len(owners) == 4, (i, owners)


def test_single_rank_owns_everything() -> None:
    shapes, boundaries = llama_shapes(2)
    plan = dmuon.plan_owners(shapes, 1, boundaries)
    assert set(plan.owners.values()) == {0}
    assert plan.imbalance == 1.0


@pytest.mark.parametrize(
    ("shapes", "world", "match"),
    [({"w": (4, 4)}, 0, "world_size"), ({"w": (4,)}, 2, "2-D")],
)
def test_plan_errors(shapes, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dmuon.plan_owners(shapes, world)


def test_default_selection_is_hidden_linears_only() -> None:
    model = TinyLlama(n_layers=2)
    owners = dmuon.dedicate_params(model)
    expected = {
        f"layers.{i}.{m}.weight"
        for i, m in itertools.product(
            range(2),
            [
                "attn.q_proj",
                "attn.k_proj",
                "attn.v_proj",
                "attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ],
        )
    }
    assert set(owners) == expected  # no embed, lm_head, norms or biases


def test_default_predicate_rules() -> None:
    weight = nn.Parameter(nn.Linear(4, 4).weight.detach())
    assert dmuon.default_predicate("layers.0.mlp.up_proj.weight", weight)
    assert not dmuon.default_predicate("lm_head.weight", weight)
    assert not dmuon.default_predicate("model.output.weight", weight)
    assert not dmuon.default_predicate("embed_tokens.weight", weight)
    assert not dmuon.default_predicate("layers.0.attn_norm.weight", weight)
    assert not dmuon.default_predicate("layers.0.attn.o_proj.bias", weight)
    assert not dmuon.default_predicate("layers.0.x.weight", nn.Parameter(weight[0]))


def test_tied_parameter_is_skipped_by_default_and_rejected_by_predicate() -> None:
    model = TinyLlama(n_layers=1)
    model.layers[0].mlp.up_proj.weight = model.layers[0].mlp.gate_proj.weight
    owners = dmuon.dedicate_params(TinyLlama(n_layers=1))
    assert "layers.0.mlp.gate_proj.weight" in owners
    tied_default = dmuon.dedicate_params(model)
    assert "layers.0.mlp.gate_proj.weight" not in tied_default
    model = TinyLlama(n_layers=1)
    model.layers[0].mlp.up_proj.weight = model.layers[0].mlp.gate_proj.weight
    with pytest.raises(ValueError, match=r"tied to 'layers\.0\.mlp\.up_proj\.weight'"):
        dmuon.dedicate_params(model, predicate=lambda n, p: "proj" in n and p.ndim == 2)


def test_predicate_matching_nothing_lists_candidates() -> None:
    with pytest.raises(ValueError, match=r"matched no parameter.*layers\.0\.attn\.q_proj"):
        dmuon.dedicate_params(TinyLlama(n_layers=1), predicate=lambda n, p: False)


def test_non_matrix_selection_is_rejected() -> None:
    with pytest.raises(ValueError, match="2-D"):
        dmuon.dedicate_params(TinyLlama(n_layers=1), predicate=lambda n, p: "norm" in n)


def test_dedicating_twice_is_rejected() -> None:
    model = TinyLlama(n_layers=1)
    dmuon.dedicate_params(model)
    with pytest.raises(ValueError, match="already called"):
        dmuon.dedicate_params(model)


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x):
        return self.body(x)


def test_hook_boundaries() -> None:
    model = TinyLlama(n_layers=2)
    assert find_hook_boundary(model, "layers.1.mlp.up_proj.weight") == "layers.1"
    flat = Flat()
    assert find_hook_boundary(flat, "body.0.weight") is None
    assert find_hook_boundary(flat, "body.0.weight", lambda m: isinstance(m, nn.Linear)) == (
        "body.0"
    )
    assert find_hook_boundary(flat, "body.0.weight", lambda m: isinstance(m, nn.Sequential)) == (
        "body"
    )


def test_strict_boundary_error_names_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"'body\.0\.weight' has no hook boundary"):
        dmuon.dedicate_params(Flat())


def test_non_strict_boundary_hooks_the_model_itself() -> None:
    model = Flat()
    reference = copy.deepcopy(model)
    owners = dmuon.dedicate_params(model, hook_boundary_strict=False)
    assert set(owners) == {"body.0.weight", "body.1.weight"}
    assert {dp.boundary for dp in dmuon.dedicated_parameters(model)} == {""}
    x = torch.randn(3, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    for dp in dmuon.dedicated_parameters(model):
        expected = reference.get_parameter(dp.fqn).grad
        assert torch.allclose(dp.param._reduced_grad, expected, atol=1e-7)


def test_deepcopy_of_a_dedicated_model_says_what_to_do() -> None:
    model = TinyLlama(n_layers=1)
    dmuon.dedicate_params(model)
    with pytest.raises(ValueError, match="Copy the model before calling dedicate_params"):
        copy.deepcopy(model)


def test_owner_plan_of_a_dedicated_model_matches_plan_owners() -> None:
    model = TinyLlama(n_layers=2)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    owners = dmuon.dedicate_params(model)
    plan = dmuon.owner_plan(model)
    assert plan.owners == owners
    boundaries = {f: ".".join(f.split(".")[:2]) for f in owners}
    assert plan == dmuon.plan_owners({f: shapes[f] for f in owners}, 1, boundaries)
    with pytest.raises(ValueError, match=r"call dmuon\.dedicate_params"):
        dmuon.owner_plan(TinyLlama(n_layers=1))
