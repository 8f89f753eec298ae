"""torch's own DCP state-dict calls on a dedicated model raise at once, naming DMuon's.

torch's ``get_model_state_dict(full_state_dict=True)`` would return the 0-element
placeholders of the matrices other ranks own, and ``get_state_dict`` + ``dcp.save`` would
fail inside the planner. Oracles: the unwrapped model's shapes (DMuon's full state dict
must have every one, non-empty) and the exact error on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from dist_harness import Scenario, make_model, spawn_ranks


def _torchs_calls(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint import state_dict as torch_sd
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("state-dict"))
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    errors = {}
    for name, call in (
        ("get_model_state_dict", lambda: torch_sd.get_model_state_dict(model, options=full)),
        ("get_state_dict", lambda: torch_sd.get_state_dict(model, optimizer)),
    ):
        try:
            call()
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    model.state_dict()  # plain state_dict() (per-rank saves) still works
    ours = dmuon.get_model_state_dict(model, options=full)
    return {
        "errors": errors,
        "shapes": shapes,
        "ours": {name: tuple(v.shape) for name, v in ours.items()},
        "nonempty": all(v.numel() > 0 for v in ours.values()),
    }


def test_torchs_state_dict_functions_raise_naming_dmuons_own() -> None:
    results = spawn_ranks(2, _torchs_calls)
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        for function, message in result["errors"].items():
            assert f"torch.distributed.checkpoint.state_dict.{function} cannot read" in message
            assert f"Call dmuon.{function} instead" in message, (rank, message)
    # DMuon's full state dict on rank 0: every key, every shape, nothing empty.
    assert results[0]["ours"] == results[0]["shapes"]
    assert results[0]["nonempty"]
    assert results[1]["ours"] == {}  # cpu_offload: rank 0 only, as torch's
    assert torch.Size(results[0]["shapes"]["layers.0.attn.q_proj.weight"]).numel() > 0
