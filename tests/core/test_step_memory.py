"""What the step allocates beyond torch.optim.Muon's: in one process, at most the
Newton-Schulz workspace it keeps; the workspace never holds two generations of its
block, and clipping copies no gradient into float64.

When a bucket needs a larger workspace than the optimizer holds, the old block (and every
workspace carved from it) is released before the new one is allocated: the peak is the
new block, not the old plus the new. Before the fix, a model whose buckets grow step by
step held both (232.6 MiB against 113.1 MiB on a scaled model). Oracle: the allocator's
own events (torch.profiler's memory records), summed in time order, against the sizes
`workspace_nbytes` computes on the meta device.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from memory import PeakTensorMemory, cpu_memory_events, span_memory

from dmuon.optim._muon_step import Workspaces
from dmuon.optim._orthogonalize import workspace_nbytes

CPU = torch.device("cpu")


def test_growing_the_workspace_frees_the_old_block_first() -> None:
    small = (4, (64, 96))
    large = (4, (128, 192))
    workspaces = Workspaces()
    with PeakTensorMemory(cuda=False) as memory:
        workspaces.get(small[0], small[1], torch.float32, CPU, False, torch.float32)
        with memory.window():
            workspaces.get(large[0], large[1], torch.float32, CPU, False, torch.float32)
    old = workspace_nbytes(small[0], *small[1], torch.float32, CPU)
    new = workspace_nbytes(large[0], *large[1], torch.float32, CPU)
    assert memory.peak is not None
    # Everything allocated since recording began and still alive at the peak: the new
    # block alone (plus the small tensors the measurement itself makes).
    assert new <= memory.peak < new + old // 2, (memory.peak, old, new)


def test_clipping_makes_no_wide_copy_of_any_gradient() -> None:
    """`dmuon.clip_grad_norm_` used to take each norm through a float64 copy of the
    gradient (``vector_norm(..., dtype=torch.float64)``): twice a float32 gradient's bytes
    at its peak. Oracle: the allocator's events during the clip, against the largest
    gradient's bytes; the norm still equals the plain model's (float64 sum, 1e-6
    relative)."""
    from dist_harness import _loss, global_batch
    from tiny_llama import TinyLlama

    import dmuon

    torch.manual_seed(0)
    model = TinyLlama(vocab=64, dim=64, hidden=256, n_layers=2)
    plain = TinyLlama(vocab=64, dim=64, hidden=256, n_layers=2)
    plain.load_state_dict(model.state_dict())
    dmuon.dedicate_params(model)
    tokens = global_batch(0, 1, 1)
    _loss(model, tokens).backward()
    _loss(plain, tokens).backward()
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    with PeakTensorMemory(cuda=False) as memory, memory.window():
        total = dmuon.clip_grad_norm_(model, max_norm=1e9)
    assert memory.peak is not None and memory.peak < largest // 4, (memory.peak, largest)
    expected = torch.sqrt(sum(p.grad.double().square().sum() for p in plain.parameters()))
    assert abs(total.item() - expected.item()) <= 1e-6 * expected.item()


def _step_peaks(contender: str, accum: int, cap: int) -> tuple[list[int], int]:
    """Each of 3 steps' peak tensor bytes (inside the step), counted from before the model
    is built (its weights, gradients, optimizer states, activations and workspaces), and
    the bytes of DMuon's Newton-Schulz workspace at the end (0 for torch.optim.Muon)."""
    from tiny_llama import TinyLlama
    from torch.profiler import ProfilerActivity, profile, record_function

    import dmuon

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = TinyLlama(vocab=256, dim=128, heads=4, hidden=512, n_layers=4)
        if contender == "torch":
            names = {n for n, p in model.named_parameters() if p.ndim == 2 and "layers." in n}
            muon = [p for n, p in model.named_parameters() if n in names]
            rest = [p for n, p in model.named_parameters() if n not in names]
            optimizers: list[torch.optim.Optimizer] = [
                torch.optim.Muon(muon, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.01, fused=True),
            ]
        else:
            dmuon.dedicate_params(model)
            optimizers = [dmuon.Muon(model, lr=0.02, weight_decay=0.01, max_workspace_bytes=cap)]
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            with record_function(f"step {step}"):
                for micro in range(accum):
                    tokens = torch.randint(0, 256, (4, 65), generator=generator)
                    last = micro == accum - 1
                    quiet = contender == "dmuon" and not last
                    with dmuon.no_sync(model) if quiet else nullcontext():
                        (model(tokens[:, :-1], tokens[:, 1:]) / accum).backward()
                for optimizer in optimizers:
                    optimizer.step()
                for optimizer in optimizers:
                    optimizer.zero_grad()
    held = 0
    if contender == "dmuon":
        held = optimizers[0].workspace_bytes()
    events = prof.profiler.kineto_results.events()
    memory = cpu_memory_events(events)
    spans = [next(e for e in events if e.name() == f"step {step}") for step in range(3)]
    peaks = [span_memory(memory, span.start_ns(), span.end_ns())[1] for span in spans]
    return peaks, held


@pytest.mark.parametrize("accum", [1, 3])
def test_one_process_peaks_at_torch_muon_plus_its_workspace(accum: int) -> None:
    """Issue 57's bound, in one process: a dedicated model stepped by `dmuon.Muon` peaks
    at most at torch.optim.Muon + fused AdamW's peak plus the Newton-Schulz workspace it
    keeps (at most ``max_workspace_bytes``), at every step, the first included, with and
    without accumulation under ``no_sync``. Before, the last micro-batch's backward held
    the boundary's fresh gradients beside their totals and a packed copy of the boundary
    (+1 MiB here at 2 micro-batches). Oracle: the allocator's events, from before the
    model exists, of both runs."""
    cap = 4 << 20
    scalars = 4096  # one-element step factors and counters: 224 to 336 bytes measured
    torch_peaks, _ = _step_peaks("torch", accum, cap)
    dmuon_peaks, workspace = _step_peaks("dmuon", accum, cap)
    assert 0 < workspace <= cap
    for step, (ours, theirs) in enumerate(zip(dmuon_peaks, torch_peaks, strict=True)):
        assert ours <= theirs + workspace + scalars, (step, ours - theirs, workspace)


def _step_transients(rank: int, world: int, cap: int) -> dict[str, Any]:
    """On one rank of FSDP2 + DMuon (Z3, 2 micro-batches under no_sync), each step's
    transient: the peak inside ``optimizer.step()`` above what is alive both before and
    after it (new state such as the momenta is kept, not transient)."""
    from tiny_llama import TinyLlama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile, record_function

    import dmuon

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = TinyLlama(vocab=256, dim=128, heads=4, hidden=512, n_layers=4)
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(model, lr=0.02, weight_decay=0.01, max_workspace_bytes=cap)
        generator = torch.Generator().manual_seed(rank)
        for step in range(3):
            for micro in range(2):
                tokens = torch.randint(0, 256, (2, 33), generator=generator)
                with dmuon.no_sync(model) if micro == 0 else nullcontext():
                    (model(tokens[:, :-1], tokens[:, 1:]) / 2).backward()
            with record_function(f"optimizer step {step}"):
                optimizer.step()
            optimizer.zero_grad()
    events = prof.profiler.kineto_results.events()
    memory = cpu_memory_events(events)
    transients = []
    for step in range(3):
        span = next(e for e in events if e.name() == f"optimizer step {step}")
        before, peak, after = span_memory(memory, span.start_ns(), span.end_ns())
        transients.append(peak - max(before, after))
    return {"transients": transients, "workspace": optimizer.workspace_bytes()}


def test_the_busiest_ranks_step_transient_stays_within_its_workspace() -> None:
    """Issue 57's bound on 2 gloo ranks (FSDP2 + DMuon, Z3, accumulation under
    ``no_sync``): what a rank allocates during ``optimizer.step()`` and frees before it
    ends is at most the Newton-Schulz workspace it keeps (at most ``max_workspace_bytes``)
    plus its one-element step scalars, on every rank and at every step, the first
    included. Oracle: each rank's allocator events."""
    from dist_harness import spawn_ranks

    cap = 4 << 20
    scalars = 4096
    results = spawn_ranks(2, _step_transients, cap)
    for rank, result in enumerate(results):
        assert result["workspace"] <= cap
        for step, transient in enumerate(result["transients"]):
            assert transient <= result["workspace"] + scalars, (rank, step, transient, result)
    assert max(max(r["transients"]) for r in results) > 0  # the measurement sees the step


def test_one_process_reads_the_device_once_per_step() -> None:
    """Issue 57: at most one host synchronisation per step beyond AdamW's. Counted on CPU
    as every ``Tensor.item`` and ``Tensor.tolist`` (each a device-to-host read on a GPU)
    that DMuon's own code makes during ``optimizer.step()`` in one process: the norms and
    first elements of the owned gradients, read together. The NaN check that agrees across
    ranks made a second read with nobody to agree with (before: 2)."""
    from host_reads import counted_host_reads
    from tiny_llama import TinyLlama

    import dmuon

    torch.manual_seed(0)
    model = TinyLlama(vocab=64, dim=32, hidden=64, n_layers=2)
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.02)
    tokens = torch.randint(0, 64, (2, 9))
    for step in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        with counted_host_reads() as reads:
            optimizer.step()
        optimizer.zero_grad()
        assert len(reads) == 1, (step, reads)


def _trained_with_and_without_folding(rank: int, world: int) -> dict[str, bool]:
    """FSDP2 + DMuon (Z3) trained 2 steps of 3 micro-batches under ``no_sync``, with each
    gradient folded into its total as it arrives and with folding switched off, per
    compute dtype: whether every parameter came out with the same bits."""
    from tiny_llama import TinyLlama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon
    from dmuon._ownership import gradients

    folding = gradients.fold_into_total
    same = {}
    for dtype in (torch.float32, torch.bfloat16):
        trained = []
        for fold in (folding, lambda holder, leaf: None):
            gradients.fold_into_total = fold
            torch.manual_seed(0)
            model = TinyLlama(vocab=64, dim=32, hidden=64, n_layers=2)
            mesh = init_device_mesh("cpu", (world,))
            dmuon.dedicate_params(model, mesh)
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            optimizer = dmuon.Muon(model, lr=0.02)
            generator = torch.Generator().manual_seed(rank)
            for _ in range(2):
                for micro in range(3):
                    tokens = torch.randint(0, 64, (2, 9), generator=generator)
                    with dmuon.no_sync(model) if micro < 2 else nullcontext():
                        (model(tokens[:, :-1], tokens[:, 1:]) / 3).backward()
                optimizer.step()
                optimizer.zero_grad()
            state = dmuon.get_model_state_dict(model)
            trained.append(
                {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in state.items()}
            )
        gradients.fold_into_total = folding
        same[str(dtype)] = all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    return same


def test_folding_gradients_into_their_totals_changes_no_bit() -> None:
    """Adding each fresh gradient into its ``no_sync`` total as it arrives (to save memory)
    sums what the boundary's reduce summed before: on 2 gloo ranks, float32 and bfloat16
    compute, every parameter has the same bits with folding on and off."""
    from dist_harness import spawn_ranks

    for rank, same in enumerate(spawn_ranks(2, _trained_with_and_without_folding)):
        assert same == {"torch.float32": True, "torch.bfloat16": True}, (rank, same)
