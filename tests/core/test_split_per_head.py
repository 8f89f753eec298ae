"""``dmuon.Muon(split="per_head")``: each attention head's q, k and v rows orthogonalized on
their own, from the model's Hugging Face config.

Oracle: the same step with the head counts given by hand as a ``{pattern: parts}`` mapping
(whose equality with separate parameters is tested with the other splits), value for value.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import config_of
from torch import nn

import dmuon

transformers = pytest.importorskip("transformers")


def _stepped(split: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_of("llama"))  # 4 heads, 2 kv heads, dim 8
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.05, ns_dtype=torch.float32, split=split)
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_per_head_is_the_head_counts_of_the_config_given_by_hand() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_of("llama"))
    dmuon.dedicate_params(model)
    sizes = dmuon.Muon(model, split="per_head").split_sizes
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        assert sizes[f"{attn}.q_proj.weight"] == (8,) * 4
        assert sizes[f"{attn}.k_proj.weight"] == sizes[f"{attn}.v_proj.weight"] == (8,) * 2
    assert not any("o_proj" in name or "mlp" in name for name in sizes)
    per_head = _stepped("per_head")
    by_hand = _stepped({"q_proj": 4, "k_proj": 2, "v_proj": 2})
    whole = _stepped(None)
    assert all(torch.equal(per_head[n], by_hand[n]) for n in per_head)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(per_head[q], whole[q])  # the split changed the update


def test_gpt2s_fused_c_attn_splits_into_every_head_of_q_k_and_v() -> None:
    model = transformers.GPT2LMHeadModel(config_of("gpt2"))  # 4 heads of 8
    dmuon.dedicate_params(model)
    sizes = dmuon.Muon(model, split="per_head").split_sizes
    assert sizes["transformer.h.0.attn.c_attn.weight"] == (8,) * 12


def test_per_head_without_a_config_says_what_to_pass() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    dmuon.dedicate_params(model, hook_boundary_strict=False)
    with pytest.raises(ValueError, match=r"model\.config\.num_attention_heads"):
        dmuon.Muon(model, split="per_head")


def _muon_first_step(grad: torch.Tensor, lr: float) -> torch.Tensor:
    """Muon's first update of a separate parameter with gradient ``grad`` (zero momentum,
    Nesterov 0.95, float32 Newton-Schulz, ``match_rms_adamw``), written out."""
    momentum = torch.zeros_like(grad).lerp(grad, 1 - 0.95)
    ortho = dmuon.newton_schulz(grad.lerp(momentum, 0.95), 5, "polar_express", dtype=torch.float32)
    return -lr * 0.2 * max(grad.shape) ** 0.5 * ortho


def test_per_head_equals_each_head_as_its_own_parameter() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_of("llama"))  # 4 heads, 2 kv heads, dim 8
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.05, ns_dtype=torch.float32, split="per_head")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, labels=tokens).loss.backward()
    grads = {dp.fqn: dp.param._reduced_grad.clone() for dp in dmuon.dedicated_parameters(model)}
    optimizer.step()
    after = dict(model.named_parameters())
    for layer in range(2):
        for name in ("q_proj", "k_proj", "v_proj"):
            fqn = f"model.layers.{layer}.self_attn.{name}.weight"
            heads = grads[fqn].split(8)  # each head's (8, 32) rows, as a parameter of its own
            expected = torch.cat([_muon_first_step(rows, 0.05) for rows in heads])
            change = after[fqn].detach() - before[fqn]
            torch.testing.assert_close(change, expected, rtol=1e-5, atol=1e-6)
