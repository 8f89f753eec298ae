"""dmuon.Muon against independent oracles: torch.optim.Muon, torch.optim.AdamW, and the
Muon algorithm written out here in float32.

The dedication state is built by hand (one process, rank 0 owns everything) and the
"reduced" gradient is set from ``.grad`` after backward, so these tests do not depend on the
ownership hooks.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from dist_harness import spawn_ranks
from torch import nn

from dmuon._comm import Communicator
from dmuon._comm_audit import CommAudit
from dmuon._ownership.dedication_state import STATE_ATTR, DedicationState, get_dedication
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.runtime import DedicationRuntime
from dmuon.optim import Muon

KELLER = (3.4445, -4.7750, 2.0315)
PE_SAFE = [
    (a / 1.05, b / 1.05**3, c / 1.05**5)
    for a, b, c in [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    ]
]
DEDICATED = ["l1.weight", "l2.weight", "l3.weight", "up.weight", "down.weight"]


class Net(nn.Module):
    """Three same-shape matrices (batched path), a tall and a wide one, plus AdamW params."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.l1 = nn.Linear(32, 32)
        self.l2 = nn.Linear(32, 32)
        self.l3 = nn.Linear(32, 32)
        self.up = nn.Linear(32, 48)  # weight 48 x 32 (tall)
        self.down = nn.Linear(48, 32)  # weight 32 x 48 (wide)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in (self.l1, self.l2, self.l3):
            h = h + torch.tanh(layer(h))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(self.norm(h))


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def dedicate_by_hand(model: nn.Module, names: list[str] = DEDICATED) -> DedicationState:
    params = dict(model.named_parameters())
    dps = []
    for fqn in names:
        mod_name, attr = fqn.rsplit(".", 1)
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
            )
        )
    # A runtime without hook boundaries: the tests play the runtime's part by hand.
    comm = Communicator(None, torch.device("cpu"), CommAudit(sum(dp.numel for dp in dps)))
    runtime = DedicationRuntime(model, dps, [], comm, reshard_after_forward=True, param_dtype=None)
    state = DedicationState(rank=0, world_size=1, runtime=runtime, params=dps)
    setattr(model, STATE_ATTR, state)
    return state


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 64, (16, 16), generator=g)
    y = torch.randint(0, 64, (16, 16), generator=g)
    return x, y


def backward(model: nn.Module, step: int, reduce: bool = True) -> None:
    x, y = batch(step)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    state = get_dedication(model)
    if reduce and state is not None:
        # What the ownership runtime does: the owner gets the averaged gradient.
        for dp in state.owned():
            dp.param._reduced_grad = dp.param.grad.clone()
            dp.param.grad = None


def run_dmuon(model: nn.Module, opt: Muon, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        backward(model, s)
        opt.step()


def max_diff(a: nn.Module, b: nn.Module, names: list[str] | None = None) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    names = names if names is not None else list(pa)
    return max((pa[n] - pb[n]).abs().max().item() for n in names)


def others(names: list[str] = DEDICATED) -> list[str]:
    """The AdamW group's parameters: every other one, frozen ones included (they train once
    unfrozen, as with torch.optim.AdamW(model.parameters()))."""
    return [n for n in dict(make_model().named_parameters()) if n not in names]


# --------------------------------------------------------------------------- groups


def test_param_groups_layout() -> None:
    model = make_model()
    dedicate_by_hand(model)
    opt = Muon(model, lr=0.03, adamw_lr=4e-4, adamw_betas=(0.8, 0.9))
    muon, adam = opt.param_groups
    assert muon["algorithm"] == "muon" and adam["algorithm"] == "adamw"
    named = {id(p): n for n, p in model.named_parameters()}
    assert [named[id(p)] for p in muon["params"]] == DEDICATED
    assert sorted(named[id(p)] for p in adam["params"]) == sorted(others())
    assert muon["lr"] == 0.03 and adam["lr"] == 4e-4 and adam["betas"] == (0.8, 0.9)
    assert muon["ns_coefficients"] == "polar_express"
    assert muon["adjust_lr_fn"] == "match_rms_adamw"


def test_tied_parameter_appears_once() -> None:
    model = make_model()
    model.head.weight = model.emb.weight  # 64 x 32 both
    dedicate_by_hand(model)
    opt = Muon(model)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------- torch.optim oracles


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_matches_torch_muon_keller_bf16(adjust: str) -> None:
    hp = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1}
    ours = make_model()
    dedicate_by_hand(ours)
    opt = Muon(
        ours,
        **hp,
        ns_steps=5,
        ns_coefficients="keller",
        ns_dtype=torch.bfloat16,
        adjust_lr_fn=adjust,
        adamw_lr=1e-3,
    )
    run_dmuon(ours, opt, range(5))

    ref = make_model()
    pr = dict(ref.named_parameters())
    muon = torch.optim.Muon(
        [pr[n] for n in DEDICATED], **hp, ns_coefficients=KELLER, adjust_lr_fn=adjust
    )
    adamw = torch.optim.AdamW([pr[n] for n in others()], lr=1e-3)
    for s in range(5):
        muon.zero_grad()
        adamw.zero_grad()
        backward(ref, s, reduce=False)
        muon.step()
        adamw.step()
    # torch casts to bf16 before normalizing, we normalize in fp32 and then cast: the two
    # bf16 iterations start one rounding apart, so each orthogonalized entry (magnitude
    # <= 0.5 here) differs by a few bf16 ulps (2^-8 relative). Measured per step: <= 0.021 x
    # the adjusted lr after 1 step, <= 0.041 x after 5 (both adjust_lr_fn), every matrix.
    # Bound: 0.02 per step x 5 steps = 0.1 x adjusted lr; a full update moves entries by up
    # to ~0.5 x adjusted lr per step, so the bound is 4 % of 5 steps' travel.
    # (The model's gradients are full rank on purpose: in a rank-deficient gradient bf16
    # noise in the null space is amplified ~3.4445^5 = 485x by the Keller polynomial, and
    # ANY two bf16 implementations then differ by ~0.1 per entry.)
    po, pr = dict(ours.named_parameters()), dict(ref.named_parameters())
    for n in DEDICATED:
        rows, cols = pr[n].shape
        ratio = (
            math.sqrt(max(1, rows / cols))
            if adjust == "original"
            else 0.2 * math.sqrt(max(rows, cols))
        )
        assert (po[n] - pr[n]).abs().max() <= 0.1 * hp["lr"] * ratio, n
    # AdamW params only see the matrices' differences through the loss: measured 1.7e-5.
    assert max_diff(ours, ref, others()) <= 1e-4


def _newton_schulz_oracle(G: torch.Tensor, triples: list) -> torch.Tensor:
    X = G.float()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=1e-7)
    for a, b, c in triples:
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_float32_algorithm_written_out(nesterov: bool) -> None:
    lr, mom, wd, alr = 0.02, 0.9, 0.05, 2e-3
    ours = make_model()
    dedicate_by_hand(ours)
    opt = Muon(
        ours,
        lr=lr,
        momentum=mom,
        nesterov=nesterov,
        weight_decay=wd,
        ns_dtype=torch.float32,
        adjust_lr_fn="match_rms_adamw",
        adamw_lr=alr,
        adamw_weight_decay=0.02,
    )
    run_dmuon(ours, opt, range(5))

    ref = make_model()
    pr = dict(ref.named_parameters())
    bufs = {n: torch.zeros_like(pr[n]) for n in DEDICATED}
    adamw = torch.optim.AdamW([pr[n] for n in others()], lr=alr, weight_decay=0.02)
    for s in range(5):
        adamw.zero_grad()
        for n in DEDICATED:
            pr[n].grad = None
        backward(ref, s, reduce=False)
        with torch.no_grad():
            for n in DEDICATED:
                g = pr[n].grad
                bufs[n] = mom * bufs[n] + (1 - mom) * g
                u = g + mom * (bufs[n] - g) if nesterov else bufs[n]
                o = _newton_schulz_oracle(u, PE_SAFE)
                rows, cols = pr[n].shape
                pr[n].mul_(1 - lr * wd)
                pr[n].sub_(lr * 0.2 * math.sqrt(max(rows, cols)) * o)
        adamw.step()
    # Measured 1.2e-7 (float32 rounding of two orderings of the same arithmetic).
    assert max_diff(ours, ref) <= 1e-6


def test_adamw_group_bit_identical_to_torch_adamw() -> None:
    # Muon lr = 0 keeps the matrices fixed, so the AdamW params see identical gradients.
    ours = make_model()
    dedicate_by_hand(ours)
    kw = {"betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    opt = Muon(
        ours,
        lr=0.0,
        adamw_lr=3e-3,
        adamw_betas=kw["betas"],
        adamw_eps=kw["eps"],
        adamw_weight_decay=kw["weight_decay"],
    )
    run_dmuon(ours, opt, range(5))
    ref = make_model()
    pr = dict(ref.named_parameters())
    adamw = torch.optim.AdamW([pr[n] for n in others()], lr=3e-3, **kw)
    for s in range(5):
        adamw.zero_grad()
        backward(ref, s, reduce=False)
        adamw.step()
    assert max_diff(ours, ref) == 0.0  # tolerance 0: same functional implementation
    st_ours = opt.state[dict(ours.named_parameters())["head.weight"]]
    st_ref = adamw.state[pr["head.weight"]]
    assert torch.equal(st_ours["exp_avg_sq"], st_ref["exp_avg_sq"])
    assert st_ours["step"] == st_ref["step"] == 5


# ----------------------------------------------------------------- schedulers & state


def test_lr_scheduler_drives_both_groups() -> None:
    model = make_model()
    dedicate_by_hand(model)
    opt = Muon(model, lr=0.02, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    for s in range(2):
        run_dmuon(model, opt, range(s, s + 1))
        sched.step()
    factor = (1 + math.cos(math.pi * 2 / 4)) / 2  # oracle: the cosine formula, 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * factor, rel=1e-12)
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-3 * factor, rel=1e-12)

    # A scheduler that sets lr to 0 makes step() a no-op on every parameter.
    torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run_dmuon(model, opt, range(5, 6))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_state_dict_resume_is_identical() -> None:
    kw = {"lr": 0.02, "weight_decay": 0.01, "ns_coefficients": "keller", "adamw_lr": 2e-3}
    full = make_model()
    dedicate_by_hand(full)
    opt = Muon(full, **kw)
    run_dmuon(full, opt, range(6))

    first = make_model()
    dedicate_by_hand(first)
    opt1 = Muon(first, **kw)
    run_dmuon(first, opt1, range(3))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt1.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    resumed = make_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    dedicate_by_hand(resumed)
    opt2 = Muon(resumed, lr=0.5, adamw_lr=0.5)  # hyperparameters come from the checkpoint
    opt2.load_state_dict(ckpt["optim"])
    assert opt2.param_groups[0]["lr"] == 0.02 and opt2.param_groups[1]["lr"] == 2e-3
    assert opt2.param_groups[0]["ns_coefficients"] == "keller"
    run_dmuon(resumed, opt2, range(3, 6))
    assert max_diff(full, resumed) == 0.0  # tolerance 0: same arithmetic in the same order


def test_zero_grad_clears_dedicated_attributes() -> None:
    model = make_model()
    state = dedicate_by_hand(model)
    opt = Muon(model)
    backward(model, 0)
    for dp in state.params:
        dp.param._accumulated_grad = torch.ones_like(dp.param)
    opt.zero_grad(set_to_none=False)
    for dp in state.params:
        assert torch.count_nonzero(dp.param._reduced_grad) == 0
        assert torch.count_nonzero(dp.param._accumulated_grad) == 0
    assert torch.count_nonzero(model.head.weight.grad) == 0
    opt.zero_grad()
    for dp in state.params:
        assert dp.param._reduced_grad is None and dp.param._accumulated_grad is None
    assert model.head.weight.grad is None and model.emb.weight.grad is None


# ----------------------------------------------------------- ownership-specific behaviour


def test_non_owned_and_gradless_params_are_skipped() -> None:
    model = make_model()
    state = dedicate_by_hand(model, DEDICATED[:2])
    placeholder = nn.Parameter(torch.empty(0))
    model.remote = placeholder  # registered on its module, as dedicate_params leaves it
    state.params.append(
        DedicatedParam(
            fqn="remote.weight",
            module=model,
            attr="remote",
            owner=1,
            shape=torch.Size([32, 32]),
            param=placeholder,
            boundary="",
            is_owned=False,
        )
    )
    state.world_size = 2
    opt = Muon(model)
    assert opt.param_groups[0]["params"][-1] is placeholder  # same indices on every rank
    backward(model, 0)
    model.l2.weight._reduced_grad = None  # e.g. unused in this forward
    l1, l2 = model.l1.weight.detach().clone(), model.l2.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.l1.weight, l1)
    assert torch.equal(model.l2.weight, l2)
    assert placeholder.numel() == 0 and placeholder not in opt.state
    assert model.l2.weight not in opt.state


def test_step_marks_parameters_updated_and_issues_no_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make_model()
    state = dedicate_by_hand(model)
    opt = Muon(model)
    calls: list[int] = []
    monkeypatch.setattr(state.runtime, "step_finished", lambda: calls.append(1))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("step() issued a collective")

    for name in (
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "send",
        "recv",
        "barrier",
    ):
        monkeypatch.setattr(dist, name, forbidden)
    backward(model, 0)
    opt.step()
    assert calls == [1]


def test_closure_returns_loss() -> None:
    model = make_model()
    dedicate_by_hand(model)
    opt = Muon(model)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        x, y = batch(0)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        for dp in get_dedication(model).params:
            dp.param._reduced_grad = dp.param.grad.clone()
        return loss

    assert torch.isfinite(opt.step(closure))


def test_grad_norm_single_process() -> None:
    model = make_model()
    dedicate_by_hand(model)
    opt = Muon(model)
    backward(model, 0, reduce=False)
    # Oracle: the plain gradient norm over every trainable parameter, before "reduction".
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.double().flatten() for p in model.parameters() if p.requires_grad])
    ).item()
    for dp in get_dedication(model).params:
        dp.param._reduced_grad = dp.param.grad.clone()
        dp.param.grad = None
    # Each gradient's norm accumulates in float32 (as torch's clip_grad_norm_ does: no
    # float64 copy of any gradient); they are combined in float64.
    assert opt.grad_norm() == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------ errors


def test_requires_dedication() -> None:
    with pytest.raises(ValueError, match=r"dmuon\.dedicate_params\(model"):
        Muon(make_model())
    with pytest.raises(ValueError, match=r"nn\.Module"):
        Muon(list(make_model().parameters()))  # type: ignore[arg-type]


def test_rejects_non_matrix_dedicated_param() -> None:
    model = make_model()
    dedicate_by_hand(model, ["l1.weight", "l1.bias"])
    with pytest.raises(ValueError, match=r"'l1\.bias'.*matrices only"):
        Muon(model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, r"lr must be a finite number >= 0"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"momentum": -0.1}, r"momentum must be in \[0, 1\)"),
        ({"weight_decay": -0.1}, r"weight_decay must be a finite number >= 0"),
        ({"nesterov": "yes"}, r"nesterov must be True or False"),
        ({"ns_steps": 0}, r"ns_steps must be an integer >= 1"),
        ({"ns_coefficients": "polar"}, r"ns_coefficients: unknown .*'keller'"),
        ({"ns_coefficients": [(1.0, 2.0)]}, r"ns_coefficients: .*triple"),
        ({"ns_dtype": torch.int8}, r"ns_dtype must be None or a floating"),
        ({"eps": 0.0}, r"eps must be a finite number > 0"),
        ({"adjust_lr_fn": "rms"}, r"adjust_lr_fn must be one of"),
        ({"adamw_lr": -1e-3}, r"adamw_lr must be a finite number >= 0"),
        ({"adamw_betas": (0.9, 1.0)}, r"adamw_betas\[1\] must be in \[0, 1\)"),
        ({"adamw_betas": (-0.1, 0.9)}, r"adamw_betas\[0\] must be in \[0, 1\)"),
        ({"adamw_betas": (0.9,)}, r"adamw_betas must be a pair"),
        ({"adamw_eps": -1e-8}, r"adamw_eps must be a finite number >= 0"),
        ({"adamw_weight_decay": -0.01}, r"adamw_weight_decay must be a finite number >= 0"),
    ],
)
def test_invalid_hyperparameters(kwargs: dict, match: str) -> None:
    model = make_model()
    dedicate_by_hand(model)
    with pytest.raises(ValueError, match=match):
        Muon(model, **kwargs)


def test_a_torch_style_param_group_goes_where_the_constructor_puts_its_parameters() -> None:
    """add_param_group without "algorithm": one kind keeps torch's meaning of ``lr``; both
    kinds split as the constructor's param_groups split the same group (the oracle)."""
    from dmuon.optim._groups import route_group

    model = make_model()
    state = dedicate_by_hand(model)
    opt = Muon(model)
    extra = nn.Parameter(torch.zeros(4))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    added = opt.param_groups[-1]
    assert added["algorithm"] == "adamw" and added["lr"] == 0.5
    assert added["betas"] == (0.9, 0.999) and added["params"] == [extra]
    (only,) = route_group({"params": [model.l2.weight], "lr": 0.1}, state)
    assert only["algorithm"] == "muon" and only["lr"] == 0.1
    assert only["params"] == [model.l2.weight]
    user = {"params": [model.l1.weight, model.emb.weight], "lr": 0.05, "adamw_lr": 1e-4}
    routed = route_group(dict(user), state)
    constructed = Muon(model, param_groups=[user]).param_groups[:2]
    for mine, theirs in zip(routed, constructed, strict=True):
        assert mine["algorithm"] == theirs["algorithm"]
        assert [id(p) for p in mine["params"]] == [id(p) for p in theirs["params"]]
        assert mine["lr"] == theirs["lr"]
    with pytest.raises(ValueError, match=r"\['betas'\] are not among them"):
        route_group({"params": [model.l1.weight, model.emb.weight], "betas": (0.9, 0.95)}, state)


# ---------------------------------------------------------------- grad_norm on 2 ranks


def _grad_norm_worker(rank: int, world: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    state = dedicate_by_hand(model)
    state.rank, state.world_size = rank, world
    state.runtime.comm = Communicator(dist.group.WORLD, torch.device("cpu"), state.audit)
    for i, dp in enumerate(state.params):
        dp.owner = i % world
        dp.is_owned = dp.owner == rank
    # AdamW params: a Shard(0) DTensor, a Replicate DTensor, and plain (replicated) tensors.
    for mod, attr, placement in (
        (model.emb, "weight", Shard(0)),
        (model.head, "bias", Replicate()),
    ):
        full = getattr(mod, attr).detach()
        setattr(mod, attr, nn.Parameter(distribute_tensor(full, mesh, [placement])))
    opt = Muon(model)
    g = torch.Generator().manual_seed(7)
    expected = 0.0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = torch.randn(tuple(p.shape), generator=g, dtype=torch.float64)
        expected += full.square().sum().item()
        full = full.float()
        if name in DEDICATED:
            dp = next(d for d in state.params if d.fqn == name)
            p._reduced_grad = full if dp.is_owned else None
        elif isinstance(p.data, torch.distributed.tensor.DTensor):
            p.grad = distribute_tensor(full, mesh, p.placements)
        else:
            p.grad = full
    return {"got": opt.grad_norm(), "expected": math.sqrt(expected)}


def test_grad_norm_two_ranks() -> None:
    # Oracle: the L2 norm of the full (unsharded) gradients, identical on both ranks.
    for r in spawn_ranks(2, _grad_norm_worker):
        assert "error" not in r, r.get("error")
        assert r["got"] == pytest.approx(r["expected"], rel=1e-6)  # float32 grads, float64 sums


class WideNet(nn.Module):
    """A wide (16 x 64) and a tall (64 x 16) matrix: both take the Gram iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.up = nn.Linear(16, 64, bias=False)  # weight 64 x 16 (tall)
        self.down = nn.Linear(64, 16, bias=False)  # weight 16 x 64 (wide)
        self.head = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.down(torch.tanh(self.up(h))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_switch_matches_standard_iteration(dtype: torch.dtype) -> None:
    # Oracle: the same optimizer with the standard iteration (itself checked against the
    # written-out algorithm and torch.optim.Muon above). float32: the Gram iteration differs
    # from it by float32 rounding only, measured 2.2e-7 after 5 steps (bound 1e-5, i.e. 1e-3
    # of the adjusted lr 0.02 * 0.2 * sqrt(64) = 0.032 per step). Asked for in bfloat16,
    # the Gram path runs in float16 while the standard one runs in bfloat16: the runs differ
    # by bfloat16's rounding of the update, 2^-8 relative on entries of at most the
    # adjusted lr, a couple of ulps a step: bound 5 steps x 0.032 x 2 x 2^-8 = 1.25e-3
    # (measured 5.2e-4).
    names = ["up.weight", "down.weight"]
    models = []
    for gram in (True, False):
        torch.manual_seed(0)
        model = WideNet()
        dedicate_by_hand(model, names)
        run_dmuon(model, Muon(model, ns_dtype=dtype, ns_gram=gram, weight_decay=0.1), range(5))
        models.append(model)
    diff = max_diff(*models)
    if dtype == torch.float32:
        assert 0 < diff <= 1e-5
    else:
        assert 0 < diff <= 5 * 0.032 * 2 * 2**-8


def test_rejects_non_bool_ns_gram() -> None:
    model = make_model()
    dedicate_by_hand(model)
    with pytest.raises(ValueError, match="ns_gram must be True or False"):
        Muon(model, ns_gram="yes")  # type: ignore[arg-type]


class MatricesOnly(nn.Module):
    """A wide, a tall and a square matrix, nothing for AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)
        self.mix = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.down(torch.tanh(self.up(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_allocates_no_buffers_after_the_first(dtype: torch.dtype) -> None:
    # Oracle: torch.profiler's CPU memory records. After the first step (which creates the
    # momentum and Newton-Schulz buffers) a step allocates nothing matrix-sized: measured
    # only 4-byte scalar temporaries (at most 12 per step).
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = MatricesOnly()
    names = ["up.weight", "down.weight", "mix.weight"]
    dedicate_by_hand(model, names)
    opt = Muon(model, ns_dtype=dtype, ns_gram=True, weight_decay=0.1)
    model(torch.randn(8, 16)).square().sum().backward()
    for dp in get_dedication(model).owned():
        dp.param._reduced_grad = dp.param.grad
    opt.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(sizes, default=0) <= 8


def _buffer_bytes(ws: object) -> int:
    """Bytes of every buffer a workspace holds (each storage once)."""
    storages: dict[int, int] = {}
    for value in vars(ws).values():
        items = (
            value
            if isinstance(value, list)
            else list(value.values())
            if isinstance(value, dict)
            else [value]
        )
        for item in items:
            if isinstance(item, torch.Tensor):
                storage = item.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_workspaces_share_one_block_sized_for_the_largest_bucket(ns_dtype: torch.dtype) -> None:
    from dmuon.optim._blocks import Arena
    from dmuon.optim._orthogonalize import NewtonSchulzWorkspace

    model = make_model()
    dedicate_by_hand(model)
    opt = Muon(model, ns_dtype=ns_dtype)
    run_dmuon(model, opt, range(2))
    # The buckets of Net: three 32 x 32 matrices, one 48 x 32, one 32 x 48.
    alone = [
        _buffer_bytes(
            NewtonSchulzWorkspace(
                b, r, c, ns_dtype, torch.device("cpu"), gram=False, out_dtype=torch.float32
            )
        )
        for b, r, c in [(3, 32, 32), (1, 48, 32), (1, 32, 48)]
    ]
    slack = 16 * Arena.ALIGN  # alignment between a workspace's buffers
    assert max(alone) <= opt.workspace_bytes() <= max(alone) + slack
    assert opt.workspace_bytes() < sum(alone)


def test_workspace_cap_runs_a_bucket_in_chunks_with_the_same_result() -> None:
    """A cap below the three-matrix bucket's batched workspace: the bucket runs in chunks
    (two matrices, then one), the workspace stays within the cap, and the weights equal
    the uncapped optimizer's (the chunks run the same per-matrix products)."""
    from dmuon.optim import workspace_nbytes

    cpu = torch.device("cpu")
    two = workspace_nbytes(2, 32, 32, torch.float32, cpu, out_dtype=torch.float32)
    three = workspace_nbytes(3, 32, 32, torch.float32, cpu, out_dtype=torch.float32)
    tall = workspace_nbytes(1, 48, 32, torch.float32, cpu, out_dtype=torch.float32)
    assert two < three and tall <= two  # the cap binds only the 32 x 32 bucket
    capped, whole = make_model(), make_model()
    dedicate_by_hand(capped)
    dedicate_by_hand(whole)
    capped_opt = Muon(capped, ns_dtype=torch.float32, max_workspace_bytes=two)
    whole_opt = Muon(whole, ns_dtype=torch.float32)
    run_dmuon(capped, capped_opt, range(3))
    run_dmuon(whole, whole_opt, range(3))
    assert capped_opt.workspace_bytes() <= two < whole_opt.workspace_bytes()
    assert whole_opt.workspace_bytes() >= three
    assert max_diff(capped, whole) <= 1e-6
    assert max_diff(capped, make_model()) > 1e-3  # it trained


def test_workspace_cap_below_one_matrix_still_steps_one_at_a_time() -> None:
    model = make_model()
    dedicate_by_hand(model)
    opt = Muon(model, ns_dtype=torch.float32, max_workspace_bytes=1)
    run_dmuon(model, opt, range(2))
    from dmuon.optim import workspace_nbytes

    largest = max(
        workspace_nbytes(1, r, c, torch.float32, torch.device("cpu"), out_dtype=torch.float32)
        for r, c in [(32, 32), (48, 32), (32, 48)]
    )
    assert opt.workspace_bytes() == largest


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "2GiB"])
def test_workspace_cap_must_be_a_positive_byte_count(bad: object) -> None:
    model = make_model()
    dedicate_by_hand(model)
    with pytest.raises(ValueError, match="max_workspace_bytes must be a positive number"):
        Muon(model, max_workspace_bytes=bad)  # type: ignore[arg-type]
