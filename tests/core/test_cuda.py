"""DMuon on CUDA (skipped without a GPU).

* The NCCL transport: the distributed scenarios on one rank per GPU, against the
  single-process CPU run on the global batch (`dist_harness.reference_run`). GPU kernels
  sum in other orders than the CPU ones, so the tolerance is 1e-4.
* The optimizer on one GPU at its CUDA default (bfloat16 Newton-Schulz) against
  ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same GPU.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dist_harness import Scenario, reference_run, run_distributed
from tiny_llama import TinyLlama

import dmuon
from dmuon.optim import default_ns_dtype

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with NCCL"),
]

SCENARIOS = [
    Scenario("cuda-z2-accum4", "z2", 4),
    Scenario("cuda-z3-accum4", "z3", 4),
    Scenario("cuda-z3-checkpoint", "z3", 2, checkpoint=True),
]


@pytest.fixture(scope="module")
def cuda_results():
    world = min(2, torch.cuda.device_count())
    return world, run_distributed(world, SCENARIOS, device_type="cuda")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_nccl_matches_single_process(cuda_results, scenario: Scenario) -> None:
    world, results = cuda_results
    reference = reference_run(scenario, world)
    for rank, per_rank in enumerate(results):
        result = per_rank[scenario.name]
        assert "error" not in result, result.get("error")
        for fqn, expected in reference.items():
            diff = (result["params"][fqn] - expected).abs().max().item()
            assert diff <= 1e-4, f"rank {rank} {fqn}: {diff}"
        units = [step["units"] for step in result["comm"]]
        if world > 1:
            expected_units = 2.0 if scenario.mode == "z2" else 2 * scenario.accum + 1.0
            assert units == [pytest.approx(expected_units)] * scenario.steps


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # 8 x 12 = 96 tokens per step, more than any matrix side: the gradients are full rank,
    # so the two bfloat16 iterations are compared where bfloat16 noise is not amplified.
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 64, (8, 13), generator=gen).cuda()
    return tokens[:, :-1], tokens[:, 1:]


def test_default_muon_on_cuda_matches_torch_muon() -> None:
    """One GPU, no process group: ``dmuon.Muon`` at its CUDA default (bfloat16, here with
    torch's Keller coefficients and scaling) against ``torch.optim.Muon`` + AdamW."""
    assert default_ns_dtype(torch.device("cuda")) == torch.bfloat16
    hp = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1}
    torch.manual_seed(0)
    ours = TinyLlama().cuda()
    ref = copy.deepcopy(ours)
    dedicated = dmuon.dedicate_params(ours)
    opt = dmuon.Muon(
        ours, **hp, ns_steps=5, ns_coefficients="keller", adjust_lr_fn="original", adamw_lr=1e-3
    )
    params = dict(ref.named_parameters())
    muon = torch.optim.Muon(
        [params[n] for n in dedicated], **hp, ns_coefficients=(3.4445, -4.7750, 2.0315)
    )
    adamw = torch.optim.AdamW([p for n, p in params.items() if n not in dedicated], lr=1e-3)
    for step in range(5):
        ours(*_tokens(step)).backward()
        opt.step()
        opt.zero_grad()
        ref(*_tokens(step)).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    ours_params = dict(ours.named_parameters())
    for fqn in dedicated:
        rows, cols = params[fqn].shape
        # The CPU test's bound (test_muon_optimizer.py): the two bf16 iterations start one
        # rounding apart; 0.02 of the scaled rate per step, over 5 steps.
        bound = 0.1 * hp["lr"] * math.sqrt(max(1, rows / cols))
        diff = (ours_params[fqn] - params[fqn]).abs().max().item()
        assert diff <= bound, f"{fqn}: {diff} > {bound}"
    rest = max(
        (ours_params[n] - p).abs().max().item() for n, p in params.items() if n not in dedicated
    )
    assert rest <= 1e-4, rest


def test_memory_snapshot_on_cuda_is_the_allocators(tmp_path, cache_dir: str) -> None:
    """``--memory-snapshot`` on a GPU writes the CUDA caching allocator's snapshot of step 1
    (what pytorch.org/memory_viz reads: its segments and traces), and the run trains."""
    import pickle

    from dmuon.train import TrainConfig, run

    summary = run(
        TrainConfig(
            model="tiny",
            seq_len=32,
            micro_batch_size=2,
            steps=2,
            eval_every=0,
            progress="plain",
            cache_dir=cache_dir,
            device="cuda",
            memory_snapshot=True,
            tracking_dir=str(tmp_path / "runs"),
            metrics_file=str(tmp_path / "m.jsonl"),
        )
    )
    assert summary["steps"] == 2
    snapshot = pickle.loads(
        (tmp_path / "runs" / "memory" / "step_1-1" / "rank0.pickle").read_bytes()
    )
    assert snapshot["segments"] and snapshot["device_traces"]
    assert any(trace for trace in snapshot["device_traces"])


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_a_replicas_update_gives_the_steppers_bits_on_cuda(master_dtype: torch.dtype) -> None:
    """The stepping owner's path (`decay_`, `scale_update_` by a `step_scalar`,
    `add_updates_`, CUDA's foreach add over many matrices) against another replica's
    `UpdateSlot.apply` of the same header: both go through
    `dmuon._ownership.step_arithmetic`, so the bits agree, and the decay is 0.998 rounded
    once in float32 (a 0-dim factor would be rounded to bfloat16 first on CUDA:
    0.99609375). ``test_step_bits.py`` runs the same on CPU with CUDA's rounding emulated."""
    from types import SimpleNamespace

    from dmuon._ownership.replica_updates import UpdateSlot
    from dmuon._ownership.step_arithmetic import add_updates_, scale_update_, step_scalar
    from dmuon.optim._muon_step import decay_

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(256, 512), (512, 256), (3, 128, 384)]
    masters = [torch.randn(s, device="cuda", generator=gen).to(master_dtype) for s in shapes]
    updates = [torch.randn(s, device="cuda", generator=gen).bfloat16() for s in shapes]
    decay, multipliers = 1 - 0.02 * 0.1, [-0.02 * 0.2 * 512**0.5, -0.004, -0.02 * 0.2 * 384**0.5]
    stepped = [m.clone() for m in masters]
    f32_decay = torch.tensor(decay, dtype=torch.float32).item()
    asked = [(m.double() * f32_decay).float().to(master_dtype) for m in masters]
    decay_(stepped, decay)
    for got, want in zip(stepped, asked, strict=True):
        assert torch.equal(got, want), "the decay is not the one asked for"
    widened = [u.to(master_dtype, copy=True) for u in updates]
    for w, k in zip(widened, multipliers, strict=True):
        scale_update_(w, step_scalar(k, master_dtype, w.device))
    add_updates_(stepped, widened)
    for master, update, k, expected in zip(masters, updates, multipliers, stepped, strict=True):
        out = master.shape[-2]
        header = torch.tensor([decay, *[k] * out, *[1.0] * out], device="cuda")
        dp = SimpleNamespace(param=master, shape=master.shape, transposed=False)
        UpdateSlot(dp, header, update).apply()  # type: ignore[arg-type]
        assert torch.equal(
            master.view(torch.int16 if master_dtype == torch.bfloat16 else torch.int32),
            expected.view(torch.int16 if master_dtype == torch.bfloat16 else torch.int32),
        )


def test_adamw_half_is_torchs_fused_adamw_on_cuda() -> None:
    """`dmuon.Muon`'s AdamW group runs torch's fused kernel on CUDA: three steps of a
    model's other parameters equal ``torch.optim.AdamW(fused=True)``'s bit for bit, and the
    step counters live on the GPU as torch's fused optimizer keeps them."""
    torch.manual_seed(0)
    plain = TinyLlama(vocab=64, dim=32, hidden=64, n_layers=2).cuda()
    ours = copy.deepcopy(plain)
    dmuon.dedicate_params(ours)
    names = {d.fqn for d in dmuon.dedicated_parameters(ours)}
    # Muon at lr 0: the matrices stay as the plain model's, so both see the same gradients.
    optimizer = dmuon.Muon(ours, lr=0.0, weight_decay=0.0, adamw_lr=1e-3, adamw_weight_decay=0.01)
    others = [p for n, p in plain.named_parameters() if n not in names]
    reference = torch.optim.AdamW(others, lr=1e-3, weight_decay=0.01, fused=True)
    tokens = torch.randint(0, 64, (2, 12), device="cuda")
    for _ in range(3):
        for model in (plain, ours):
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    mine = dict(ours.named_parameters())
    for name, p in plain.named_parameters():
        if name not in names:
            assert torch.equal(mine[name], p), name
    steps = [s["step"] for p, s in optimizer.state.items() if "step" in s]
    assert steps and all(step.is_cuda for step in steps)
