"""What the step allocates beyond torch.optim.Muon's: the Newton-Schulz workspace never
holds two generations of its block, and clipping copies no gradient into float64.

When a bucket needs a larger workspace than the optimizer holds, the old block (and every
workspace carved from it) is released before the new one is allocated: the peak is the
new block, not the old plus the new. Before the fix, a model whose buckets grow step by
step held both (232.6 MiB against 113.1 MiB on a scaled model). Oracle: the allocator's
own events (torch.profiler's memory records), summed in time order, against the sizes
`workspace_nbytes` computes on the meta device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from memory import PeakTensorMemory

from dmuon.optim._muon_step import Workspaces, workspace_nbytes

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
