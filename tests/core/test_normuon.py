"""dmuon.Muon(variant="normuon") against NorMuon written out here in plain torch.

The oracle is independent of dmuon's code: Newton-Schulz with the published Polar Express
coefficients in float32, Nesterov momentum, the per-neuron second moment
(``s = lerp(s, mean(O**2 over inputs), 1 - beta2)``, ``O / (sqrt(s) + 1e-10)``, rescaled to
O's Frobenius norm), the learning-rate adjustment and decoupled weight decay. One process
(matrices batched by shape, a split matrix, a transposed one, a 3-D stack), then two gloo
ranks (FSDP2 in Z2 and Z3, and DDP) against the one-process run on the global batch, a DCP
checkpoint written at two ranks and resumed at one, and expert stacks split over the two
ranks saving and loading their second moments.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_scenarios import ACCUM, K, M, batch, train
from dist_harness import ADAMW_LR, LR, VOCAB, _loss, full_parameters, spawn_ranks
from test_muon_optimizer import PE_SAFE, _newton_schulz_oracle
from tiny_llama import TinyLlama
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon
from dmuon._comm import Communicator
from dmuon._comm_audit import CommAudit
from dmuon._ownership.dedication_state import STATE_ATTR, DedicationState, get_dedication
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.runtime import DedicationRuntime
from dmuon.optim import Muon

BETA2, WD = 0.95, 0.1
MODES = ("z2", "z3", "ddp")


def normuon_oracle(
    o: torch.Tensor, s: torch.Tensor, beta2: float, per_column: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon on one orthogonalized matrix ``o``: the normalized update and the new ``s``.

    ``per_column``: the matrix is stored ``(in, out)``, so its output neurons are columns.
    """
    v = (o * o).mean(dim=0 if per_column else 1, keepdim=True)
    s = beta2 * s + (1 - beta2) * v
    n = o / (torch.sqrt(s) + 1e-10)
    return n * (o.norm() / n.norm()), s


# ----- one process ------------------------------------------------------------------------
class Net(nn.Module):
    """Same-shape matrices, one split into two parts, a transposed one, a stack of three."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.l1 = nn.Linear(32, 32)
        self.l2 = nn.Linear(32, 32)
        self.up = nn.Linear(32, 48)  # split into two 24 x 32 parts
        self.conv = nn.Parameter(torch.randn(48, 32) / 7)  # stored (in, out): y = h @ conv
        self.experts = nn.Parameter(torch.randn(3, 16, 32) / 6)  # (matrices, out, in)
        self.head = nn.Linear(32 + 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in (self.l1, self.l2):
            h = h + torch.tanh(layer(h))
        h = h + torch.tanh(self.up(h)) @ self.conv
        e = sum(torch.tanh(h @ w.T) for w in self.experts.unbind(0))
        return self.head(torch.cat([h, e], dim=-1))


#: name -> (stored as (in, out), split sizes of the output dimension)
DEDICATED = {
    "l1.weight": (False, None),
    "l2.weight": (False, None),
    "up.weight": (False, (24, 24)),
    "conv": (True, None),
    "experts": (False, None),
}


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def dedicate_by_hand(model: nn.Module) -> None:
    """Rank 0 owns every matrix; the tests play the ownership runtime's part."""
    params = dict(model.named_parameters())
    dps = []
    for fqn, (transposed, _) in DEDICATED.items():
        mod_name, _, attr = fqn.rpartition(".")
        p = params[fqn]
        dps.append(
            DedicatedParam(
                fqn=fqn,
                module=model.get_submodule(mod_name),
                attr=attr,
                owner=0,
                shape=p.shape,
                param=p,
                boundary=mod_name,
                is_owned=True,
                transposed=transposed,
            )
        )
    comm = Communicator(None, torch.device("cpu"), CommAudit(sum(dp.numel for dp in dps)))
    runtime = DedicationRuntime(model, dps, [], comm, reshard_after_forward=True, param_dtype=None)
    setattr(model, STATE_ATTR, DedicationState(rank=0, world_size=1, runtime=runtime, params=dps))


def backward(model: nn.Module, step: int, reduce: bool = True) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 64, (8, 12), generator=g)
    y = torch.randint(0, 64, (8, 12), generator=g)
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    state = get_dedication(model)
    if reduce and state is not None:
        for dp in state.owned():
            dp.param._reduced_grad = dp.param.grad.clone()
            dp.param.grad = None


def normuon(model: nn.Module, **kwargs: Any) -> Muon:
    settings = dict(
        lr=0.02,
        weight_decay=WD,
        ns_dtype=torch.float32,
        split={"up": 2},
        adamw_lr=2e-3,
        variant="normuon",
        beta2=BETA2,
    )
    return Muon(model, **{**settings, **kwargs})


def run(model: nn.Module, opt: Muon, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        backward(model, step)
        opt.step()


def oracle_run(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The plain model trained with NorMuon written out: final parameters, second moments."""
    ref = make_net()
    params = dict(ref.named_parameters())
    adamw = torch.optim.AdamW(
        [p for n, p in params.items() if n not in DEDICATED], lr=2e-3, weight_decay=0.01
    )
    bufs = {n: torch.zeros_like(params[n]) for n in DEDICATED}
    seconds: dict[tuple[str, int], torch.Tensor] = {}
    for step in range(steps):
        adamw.zero_grad()
        for n in DEDICATED:
            params[n].grad = None
        backward(ref, step, reduce=False)
        with torch.no_grad():
            for n, (transposed, sizes) in DEDICATED.items():
                p, g = params[n], params[n].grad
                bufs[n] = 0.95 * bufs[n] + 0.05 * g
                u = g + 0.95 * (bufs[n] - g)
                matrices = list(u.unbind(0)) if u.dim() == 3 else [u]
                pieces = [part for m in matrices for part in m.split(list(sizes or [len(m)]))]
                updates = []
                for i, piece in enumerate(pieces):
                    o = _newton_schulz_oracle(piece, PE_SAFE)
                    s = seconds.get((n, i), torch.zeros(1))
                    o, seconds[(n, i)] = normuon_oracle(o, s, BETA2, transposed)
                    rows, cols = piece.shape[::-1] if transposed else piece.shape
                    updates.append(o * 0.2 * math.sqrt(max(rows, cols)))
                if sizes:
                    update = torch.cat(updates)
                elif p.dim() == 3:
                    update = torch.stack(updates)
                else:
                    update = updates[0]
                p.mul_(1 - 0.02 * WD).sub_(0.02 * update)
        adamw.step()
    moments = {}
    for n, (transposed, sizes) in DEDICATED.items():
        parts = [s for (name, _), s in seconds.items() if name == n]
        if transposed:
            moments[n] = parts[0].T
        elif sizes:
            moments[n] = torch.cat(parts)
        elif params[n].dim() == 3:
            moments[n] = torch.stack(parts)
        else:
            moments[n] = parts[0]
    return {n: p.detach().clone() for n, p in params.items()}, moments


def test_matches_normuon_written_out() -> None:
    ours = make_net()
    dedicate_by_hand(ours)
    opt = normuon(ours)
    run(ours, opt, range(5))
    expected, moments = oracle_run(5)
    got = dict(ours.named_parameters())
    initial = dict(make_net().named_parameters())
    # Measured 1.4e-7: float32 rounding of two orderings of the same arithmetic.
    for n, want in expected.items():
        assert (got[n] - want).abs().max().item() <= 1e-6, n
    for n, want in moments.items():
        state = opt.state[got[n]]["second_moment_buffer"]
        assert state.shape == want.shape, n  # (out, 1) per matrix, whatever the layout
        assert (state - want).abs().max().item() <= 1e-5 * want.abs().max().item(), n
    assert min((got[n] - initial[n]).abs().max().item() for n in DEDICATED) > 1e-3
    # NorMuon is not Muon: the same run without it ends elsewhere.
    plain = make_net()
    dedicate_by_hand(plain)
    run(plain, normuon(plain, variant="muon"), range(5))
    assert (dict(plain.named_parameters())["l1.weight"] - got["l1.weight"]).abs().max() > 1e-4


def test_param_groups_choose_their_variant_and_state_dict_resumes_exactly() -> None:
    mixed = make_net()
    dedicate_by_hand(mixed)
    opt = normuon(
        mixed, variant="muon", param_groups=[{"params": [mixed.l1.weight], "variant": "normuon"}]
    )
    run(mixed, opt, range(1))
    assert "second_moment_buffer" in opt.state[mixed.l1.weight]
    assert "second_moment_buffer" not in opt.state[mixed.l2.weight]
    # The first step of a matrix depends on its own gradient only: l1 steps as NorMuon, l2 as Muon.
    for variant, name in (("normuon", "l1.weight"), ("muon", "l2.weight")):
        alone = make_net()
        dedicate_by_hand(alone)
        run(alone, normuon(alone, variant=variant), range(1))
        diff = (dict(alone.named_parameters())[name] - dict(mixed.named_parameters())[name]).abs()
        assert diff.max().item() <= 1e-6, name
    # A per-rank state_dict() round trip continues bit for bit.
    model = make_net()
    dedicate_by_hand(model)
    opt = normuon(model)
    run(model, opt, range(2))
    saved_weights, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, range(2, 4))
    resumed = make_net()
    resumed.load_state_dict(saved_weights)
    dedicate_by_hand(resumed)
    resumed_opt = normuon(resumed)
    resumed_opt.load_state_dict(saved_state)
    run(resumed, resumed_opt, range(2, 4))
    for (n, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), n
    # ...and a Muon optimizer refuses NorMuon's state, naming both variants.
    muon = make_net()
    dedicate_by_hand(muon)
    with pytest.raises(ValueError, match=r"variant 'muon', the checkpoint's is 'normuon'"):
        normuon(muon, variant="muon").load_state_dict(saved_state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"variant": "adam"}, r"variant must be 'muon' or 'normuon'.*got 'adam'"),
        ({"variant": None}, r"variant must be 'muon' or 'normuon'"),
        ({"beta2": 1.0}, r"beta2 must be in \[0, 1\)"),
        ({"beta2": -0.1}, r"beta2 must be in \[0, 1\)"),
        ({"beta2": "0.9"}, r"beta2 must be in \[0, 1\)"),
        (
            {"param_groups": [{"params": [], "variant": "nor"}]},
            r"variant must be 'muon' or 'normuon'",
        ),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    model = make_net()
    dedicate_by_hand(model)
    if "param_groups" in kwargs:
        kwargs["param_groups"][0]["params"] = [model.l1.weight]
    with pytest.raises(ValueError, match=match):
        normuon(model, **kwargs)


def test_tensor_parallel_matrices_are_refused() -> None:
    model = make_net()
    dedicate_by_hand(model)
    dp = get_dedication(model).params[0]
    dp.tp = SimpleNamespace(shard_dim=0, global_shape=dp.shape)  # what a tp-split matrix has
    with pytest.raises(ValueError, match=r"normuon' does not support matrices split by tensor"):
        normuon(model)
    normuon(model, variant="muon")  # Muon handles them


# ----- two ranks and a checkpoint ----------------------------------------------------------
def build(world: int, mode: str, variant: str = "normuon") -> tuple[nn.Module, Muon]:
    """TinyLlama dedicated and wrapped (FSDP2 in Z2 or Z3, or DDP) at ``world`` ranks,
    NorMuon over it; returns the wrapper under DDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)
    model = TinyLlama(vocab=VOCAB)
    mesh = init_device_mesh("cpu", (world,))
    reshard = mode == "z3"
    dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard)
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WD,
        ns_dtype=torch.float32,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=0.01,
        variant=variant,
    )
    return model, optimizer


def split_stacks(rank: int, world: int) -> dict[str, Any]:
    """A Mixtral whose expert stacks are split over the ranks: the second moments' state dict.

    Returns each owner's own ranges, the full state dict's stacks, and the full stacks
    again after the sharded state dict was loaded into a fresh split and unsplit model.
    """
    from test_moe_experts import _step, tiny_mixtral
    from torch.distributed.device_mesh import init_device_mesh

    def build_moe(split: bool) -> tuple[nn.Module, Muon]:
        from torch.distributed.fsdp import fully_shard

        model = tiny_mixtral()
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, split_expert_stacks=split)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(True)
        return model, dmuon.Muon(model, ns_dtype=torch.float32, variant="normuon")

    def full_seconds(model: nn.Module, optimizer: Muon) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True)
        osd = dmuon.get_optimizer_state_dict(model, optimizer, options=options)
        return {
            n: v["second_moment_buffer"].detach().cpu().clone()
            for n, v in osd["state"].items()
            if "second_moment_buffer" in v
        }

    model, optimizer = build_moe(split=True)
    for step in range(2):
        _step(model, optimizer, step, rank, world)
    own = {
        dp.name: optimizer.state[dp.param]["second_moment_buffer"].clone()
        for dp in dmuon.dedicated_parameters(model)
        if dp.is_range and dp.is_owned
    }
    out: dict[str, Any] = {"own": own, "full": full_seconds(model, optimizer)}
    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    for split in (True, False):
        fresh, fresh_opt = build_moe(split)
        dmuon.set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        out[f"loaded_split={split}"] = full_seconds(fresh, fresh_opt)
    return out


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Z2, Z3 and DDP for K + M steps; Z3 saves a DCP checkpoint after K. Then
    `split_stacks`."""
    out: dict[str, Any] = {"split_stacks": split_stacks(rank, world)}
    for mode in MODES:
        model, optimizer = build(world, mode)
        train(model, optimizer, range(K), rank, world)
        if mode == "z3":
            model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
            out["second_type"] = type(
                next(v for v in optim_sd["state"].values() if "second_moment_buffer" in v)[
                    "second_moment_buffer"
                ]
            ).__name__
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
        train(model, optimizer, range(K, K + M), rank, world)
        out[mode] = full_parameters(model.module if mode == "ddp" else model)
    return out


def one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume the two-rank checkpoint at one rank; load it into Muon, strict and not."""
    model, optimizer = build(world, "z3")
    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    dmuon.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, optimizer, range(K, K + M), rank, world)
    out: dict[str, Any] = {"resumed": full_parameters(model)}
    muon_model, muon = build(world, "z3", variant="muon")
    sd = dmuon.get_optimizer_state_dict(muon_model, muon)
    dcp.load({"optim": sd}, checkpoint_id=root)
    try:
        dmuon.set_optimizer_state_dict(muon_model, muon, sd)
    except ValueError as exc:
        out["strict_error"] = str(exc)
    dmuon.set_optimizer_state_dict(muon_model, muon, sd, options=StateDictOptions(strict=False))
    out["lenient_state"] = sorted({k for v in muon.state.values() for k in v})
    out["lenient_variant"] = muon.param_groups[0]["variant"]
    return out


def oracle_tiny_llama(steps: int) -> dict[str, torch.Tensor]:
    """TinyLlama on the global batches, NorMuon written out, AdamW for the rest."""
    torch.manual_seed(1234)
    model = TinyLlama(vocab=VOCAB)
    params = dict(model.named_parameters())
    muon_names = {
        n
        for n, p in params.items()
        if dmuon.default_predicate(n, p) and n.startswith("layers.") and "lm_head" not in n
    }
    adamw = torch.optim.AdamW(
        [p for n, p in params.items() if n not in muon_names], lr=ADAMW_LR, weight_decay=0.01
    )
    bufs = {n: torch.zeros_like(params[n]) for n in muon_names}
    seconds = {n: torch.zeros(params[n].shape[0], 1) for n in muon_names}
    for step in range(steps):
        for chunk in batch(step).chunk(ACCUM):
            (_loss(model, chunk) / ACCUM).backward()
        with torch.no_grad():
            for n in muon_names:
                p, g = params[n], params[n].grad
                bufs[n] = 0.95 * bufs[n] + 0.05 * g
                o = _newton_schulz_oracle(g + 0.95 * (bufs[n] - g), PE_SAFE)
                o, seconds[n] = normuon_oracle(o, seconds[n], BETA2, False)
                p.mul_(1 - LR * WD).sub_(LR * 0.2 * math.sqrt(max(p.shape)) * o)
                p.grad = None
        adamw.step()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}


def _ok(results: list[Any]) -> list[Any]:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """The two-rank spawn, once for the module: its checkpoint folder and results."""
    root = str(tmp_path_factory.mktemp("normuon") / "checkpoint")
    return root, _ok(spawn_ranks(2, two_ranks, root))


def test_two_ranks_fsdp2_and_ddp_match_the_oracle_and_a_checkpoint_resumes_at_one_rank(
    spawned,
) -> None:
    root, ranks = spawned
    expected = oracle_tiny_llama(K + M)
    assert any(n.startswith("layers.") for n in expected)
    for rank, result in enumerate(ranks):
        for mode in MODES:
            for n, want in expected.items():
                diff = (result[mode][n] - want).abs().max().item()
                assert diff <= 1e-5, f"rank {rank} {mode} {n}: {diff:.3g}"
    assert ranks[0]["second_type"] == "DTensor"  # sharded like the momentum
    (single,) = _ok(spawn_ranks(1, one_rank, root))
    # Resharded 2 -> 1 and resumed: the uninterrupted two-rank run within 1e-6.
    for n, want in ranks[0]["z3"].items():
        diff = (single["resumed"][n] - want).abs().max().item()
        assert diff <= 1e-6, f"{n}: {diff:.3g}"
    assert "variant 'normuon', this optimizer's is 'muon'" in single["strict_error"]
    assert single["lenient_state"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
    assert single["lenient_variant"] == "muon"


def test_split_expert_stacks_save_and_load_their_second_moments(spawned) -> None:
    _, ranks = spawned
    results = [r["split_stacks"] for r in ranks]
    own = {name: t for r in results for name, t in r["own"].items()}
    ranged = sorted({name.split("[")[0] for name in own})
    assert ranged, "no stack was split over the two ranks"
    for result in results:
        for stack in ranged:
            pieces = sorted(
                (int(n.split("[")[1].split(":")[0]), t)
                for n, t in own.items()
                if n.startswith(stack + "[")
            )
            assert len(pieces) == 2  # one range per rank
            whole = torch.cat([t for _, t in pieces])
            assert torch.equal(result["full"][stack], whole), stack
            assert whole.abs().max() > 0  # trained, not the zeros it started at
        for split in (True, False):
            loaded = result[f"loaded_split={split}"]
            assert sorted(loaded) == sorted(result["full"])
            for name, want in result["full"].items():
                assert torch.equal(loaded[name], want), (split, name)
