"""PEFT LoRA adapters on a dedicated Hugging Face model: exact, and paying for the factors only.

The default predicate dedicates the frozen base matrices along with the LoRA factors (so
that a base matrix unfrozen later trains with Muon). Frozen matrices are broadcast for the
forward but never reduced. Oracles: the same training in one process (the global batch),
and the element count of the factors that carry gradients.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import pytest
import torch
from dist_harness import full_parameters, spawn_ranks

# Imported where used: ``import peft`` takes 3.4 s (it loads transformers), which every
# pytest worker would pay at collection.
pytestmark = pytest.mark.skipif(find_spec("peft") is None, reason="peft is not installed")

STEPS, MICRO, SEQ = 2, 2, 16


def _lora_model() -> torch.nn.Module:
    import peft
    import transformers
    from hf_models import config_of

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config_of("llama"))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,  # random B as well: every factor gets a gradient at once
    )  # fmt: skip
    return peft.get_peft_model(base, config)


def _batch(step: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 320, (world * MICRO, SEQ), generator=gen)


def _train(rank: int, world: int, global_world: int) -> dict[str, Any]:
    import dmuon

    model = _lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        owners = dmuon.dedicate_params(model, mesh)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        owners = dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
    for step in range(STEPS):
        tokens = _batch(step, global_world).chunk(world)[rank]
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    params = full_parameters(model)
    shapes = {n: p.numel() for n, p in params.items()}
    audit = dmuon.comm_audit(model).steps[-1]
    return {
        "lora": {n: params[n] for n in trainable},
        "frozen_dedicated": sorted(n for n in owners if n not in trainable),
        "trainable_dedicated_elements": sum(shapes[n] for n in owners if n in trainable),
        "reduced_elements": (
            sum(
                audit.by_kind[k].elements
                for k in ("reduce", "reduce_scatter")
                if k in audit.by_kind
            )
            if world > 1
            else None
        ),
    }


def test_lora_trains_exactly_and_reduces_only_the_factors() -> None:
    one = spawn_ranks(1, _train, 2)[0]  # the global batch of the two ranks
    two = spawn_ranks(2, _train, 2)
    assert "error" not in one, one.get("error")
    assert len(one["frozen_dedicated"]) == 14  # the 7 base matrices of each of 2 layers
    assert len(one["lora"]) == 8  # A and B of q_proj and v_proj, 2 layers
    assert one["lora"] and all("lora_" in n for n in one["lora"])
    for rank, result in enumerate(two):
        assert "error" not in result, result.get("error")
        for name, expected in one["lora"].items():
            diff = (result["lora"][name] - expected).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {name}: {diff:.3g}"
        # Every rank takes part in each reduce: the factors' elements, not the base's.
        assert result["reduced_elements"] == result["trainable_dedicated_elements"]
    initial = {n: p.detach() for n, p in _lora_model().named_parameters() if n in one["lora"]}
    assert max((one["lora"][n] - p).abs().max().item() for n, p in initial.items()) > 1e-3
