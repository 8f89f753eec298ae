"""Per-block ``torch.compile`` (torchtitan compiles each decoder layer) on a dedicated model.

``layer.compile()`` before or after ``fully_shard``, and ``torch.compile(layer)`` put in
the layer's place, with gradient accumulation under ``no_sync`` (the second forward meets
the gradients the first left), in Z2 and Z3 on 2 ranks. Oracle: the same training in
eager mode; inductor may reorder float32 arithmetic, nothing more.
"""

from __future__ import annotations

from typing import Any

import torch
from dist_harness import full_parameters, spawn_ranks

STEPS, ACCUM, MICRO, SEQ = 2, 2, 2, 16
#: Inductor's fused float32 kernels round differently from eager ones (about 1e-7
#: relative); Newton-Schulz amplifies that a little. Measured on the update each parameter
#: made: ||compiled - eager|| / ||eager - initial||.
TOLERANCE = 1e-3

RUNS = [
    ("eager", "z3"),
    ("eager", "z2"),
    ("compile-before-fully_shard", "z3"),
    ("compile-after-fully_shard", "z2"),
    ("torch.compile-in-place", "z3"),
]


def _run(rank: int, world: int, style: str, mode: str) -> dict[str, torch.Tensor]:
    import transformers
    from hf_models import config_of
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_of("llama"))
    layers = model.model.layers
    dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
    if style == "compile-before-fully_shard":
        for layer in layers:
            layer.compile()
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if style == "compile-after-fully_shard":
        for layer in layers:
            layer.compile()
    if style == "torch.compile-in-place":
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 + step)
        tokens = torch.randint(0, 320, (world * ACCUM * MICRO, SEQ), generator=gen)
        for micro, chunk in enumerate(tokens.chunk(world)[rank].chunk(ACCUM)):
            last = micro == ACCUM - 1
            with dmuon.no_sync(model) if not last else torch.enable_grad():
                (model(input_ids=chunk, labels=chunk).loss / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()
    for i, layer in enumerate(layers):  # the names the dedication knows
        layers[i] = getattr(layer, "_orig_mod", layer)
    return full_parameters(model)


def _all_runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for style, mode in RUNS:
        try:
            out[f"{style}/{mode}"] = _run(rank, world, style, mode)
        except Exception as e:  # one style's failure must not hide the others'
            out[f"{style}/{mode}"] = f"{type(e).__name__}: {e}"
    return out


def _initial() -> dict[str, torch.Tensor]:
    import transformers
    from hf_models import config_of

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_of("llama"))
    return {n: p.detach() for n, p in model.named_parameters()}


def test_per_block_compile_matches_eager_in_z2_and_z3() -> None:
    initial = _initial()
    for rank, result in enumerate(spawn_ranks(2, _all_runs)):
        assert "error" not in result, result.get("error")
        for style, mode in RUNS:
            got = result[f"{style}/{mode}"]
            assert isinstance(got, dict), f"rank {rank} {style} {mode}: {got}"
            eager = result[f"eager/{mode}"]
            assert got.keys() == eager.keys()
            for n in eager:
                update = (eager[n] - initial[n]).norm()
                error = ((got[n] - eager[n]).norm() / update).item()
                assert update > 0 and error <= TOLERANCE, (
                    f"rank {rank} {style} {mode} {n}: {error:.3g}"
                )
        z2, z3 = result["eager/z2"], result["eager/z3"]
        assert max((z2[n] - z3[n]).abs().max().item() for n in z2) <= 1e-6
