"""HSDP with a bfloat16 forward: float32 masters and momentum live once per world.

The owners of a matrix in the replicas that do not step it keep only a bfloat16 copy (what
their forward broadcasts); after each step the stepping owner sends its new values in
bfloat16. Checked on gloo, HSDP 2x2 (Z3 and Z2) and 3x2 (Z3), under FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, against two
oracles:

* the same run with every replica's owner holding a float32 master and applying the
  stepping owner's update (the transport a float32 forward keeps): the stepping owners'
  masters and the losses are the same bits, and every other replica's copy is the
  bfloat16 cast of that master;
* one process on the global batch under autocast (bfloat16): the update within 0.1
  relative error, the bound of every other bfloat16 run (rounding the forward's
  inputs differently moves it by about 3e-2).

Also: a full state dict read between steps gives every rank the stepping owner's float32
master bit for bit; a rank's owned matrices take 4 bytes an element where it steps them
and 2 elsewhere; the bytes between replicas per step are each record's bfloat16 values,
16-byte aligned, with no header; ``dmuon.parameters_updated`` after an edit by hand makes
every copy the cast of its stepping owner's edited master.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from dist_harness import ADAMW_LR, LR, Scenario, _loss, global_batch, reference_run, spawn_ranks

STEPS = 3
CASES = {"2x2-z3": ((2, 2), "z3"), "2x2-z2": ((2, 2), "z2"), "3x2-z3": ((3, 2), "z3")}
#: Relative error of the update against the autocast oracle (test_distributed's bound).
TOLERANCE = 0.1
#: A QK-clip threshold the tiny Mixtral's logits exceed.
QK_TAU = 0.05


def _train(rank: int, world: int, shape: tuple[int, int], mode: str, narrow: bool) -> dict:
    from dist_harness import make_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication
    from dmuon._ownership.replica_updates import ReplicaUpdates

    hold_narrow = ReplicaUpdates.hold_narrow
    if not narrow:  # the oracle: float32 masters on every replica's owner
        ReplicaUpdates.hold_narrow = lambda self, wire_dtype: None  # type: ignore[method-assign]
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model = make_model(Scenario("masters"))
        dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = dmuon.Muon(
            model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
        )
        state = get_dedication(model)
        owned = [dp for dp in state.params if dp.is_owned]
        losses, moved, read = [], [], {}
        for step in range(STEPS):
            tokens = global_batch(step, world, 1).chunk(world)[rank]
            loss = _loss(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
            shared = dmuon.comm_audit(model).last_step().replicate
            moved.append(sum(shared[k].bytes for k in ("broadcast", "all_gather") if k in shared))
            if step == 1:  # a state dict read while the updates are on their way
                full = dmuon.get_model_state_dict(
                    model, options=StateDictOptions(full_state_dict=True)
                )
                read = {dp.fqn: full[dp.fqn].clone() for dp in state.params}
                masters_at_read = {dp.name: dp.param.detach().clone() for dp in owned}
        dmuon.wait_for_updates(model)
        held = {dp.name: dp.param.detach().clone() for dp in owned}
        with torch.no_grad():  # an edit by hand, the same on every rank
            for dp in owned:
                dp.param.mul_(0.9)
        dmuon.parameters_updated(model)
        edited = {dp.name: dp.param.detach().clone() for dp in owned}
        full = dmuon.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {
            "losses": losses,
            "moved": moved,
            "read": read,
            "masters_at_read": masters_at_read,
            "held": held,
            "edited": edited,
            "final": {name: value.clone() for name, value in full.items()},
            "steps_here": {dp.name: bool(dp.updates_here) for dp in owned},
            "stepper": {dp.name: dp.update_replica * shape[1] + dp.owner for dp in state.params},
        }
    finally:
        ReplicaUpdates.hold_narrow = hold_narrow  # type: ignore[method-assign]


def _worker(rank: int, world: int, case: str) -> dict[str, Any]:
    shape, mode = CASES[case]
    return {
        "narrow": _train(rank, world, shape, mode, narrow=True),
        "everywhere": _train(rank, world, shape, mode, narrow=False),
    }


@functools.cache
def _spawned(case: str) -> list[dict[str, Any]]:
    shape, _ = CASES[case]
    return spawn_ranks(shape[0] * shape[1], _worker, case)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_masters_live_on_the_stepping_replica_and_the_step_is_the_same_bits(case: str) -> None:
    per_rank = _spawned(case)
    for rank, result in enumerate(per_rank):
        narrow, everywhere = result["narrow"], result["everywhere"]
        assert narrow["held"], rank
        for a, b in zip(narrow["losses"], everywhere["losses"], strict=True):
            assert torch.equal(_bits(a.float()), _bits(b.float())), rank
        for name, value in narrow["held"].items():
            reference = everywhere["held"][name]
            assert reference.dtype == torch.float32
            if narrow["steps_here"][name]:
                assert value.dtype == torch.float32, (rank, name)
                assert torch.equal(_bits(value), _bits(reference)), (rank, name)
            else:
                assert value.dtype == torch.bfloat16, (rank, name)
                assert torch.equal(_bits(value), _bits(reference.bfloat16())), (rank, name)
        held = sum(v.numel() * v.element_size() for v in narrow["held"].values())
        stepped = sum(v.numel() for n, v in narrow["held"].items() if narrow["steps_here"][n])
        total = sum(v.numel() for v in narrow["held"].values())
        assert held == 4 * stepped + 2 * (total - stepped), rank


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dicts_and_edits_follow_the_stepping_owner(case: str) -> None:
    per_rank = _spawned(case)
    stepper = per_rank[0]["narrow"]["stepper"]
    for rank, result in enumerate(per_rank):
        narrow = result["narrow"]
        for fqn, value in narrow["read"].items():
            master = per_rank[stepper[fqn]]["narrow"]["masters_at_read"][fqn]
            assert value.dtype == torch.float32
            assert torch.equal(_bits(value), _bits(master)), (rank, fqn)
        for name, value in narrow["edited"].items():
            master = per_rank[stepper[name]]["narrow"]["edited"][name]
            assert master.dtype == torch.float32
            assert torch.equal(_bits(value), _bits(master.to(value.dtype))), (rank, name)
            assert torch.equal(_bits(narrow["final"][name]), _bits(master)), (rank, name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_travel_in_bfloat16_without_headers(case: str) -> None:
    per_rank = _spawned(case)
    for rank, result in enumerate(per_rank):
        narrow, everywhere = result["narrow"], result["everywhere"]
        expected = sum(-(-v.numel() * 2 // 16) * 16 for v in narrow["held"].values())
        assert narrow["moved"] == [expected] * STEPS, rank
        assert narrow["moved"][0] < 0.55 * everywhere["moved"][0], rank  # float32 updates


@pytest.mark.parametrize("case", ["2x2-z3", "3x2-z3"])
def test_training_matches_one_process_under_autocast(case: str) -> None:
    per_rank = _spawned(case)
    world = len(per_rank)
    start = reference_run(Scenario("masters", steps=0), world)
    reference = reference_run(Scenario("masters", steps=STEPS, bf16=True), world)
    for rank, result in enumerate(per_rank):
        # final holds the edited (x 0.9) masters: undo the edit on the values compared.
        final = result["narrow"]["final"]
        for fqn, value in final.items():
            if fqn not in result["narrow"]["stepper"]:
                continue
            trained = value / 0.9
            moved = (reference[fqn] - start[fqn]).norm()
            error = (trained - reference[fqn]).norm() / moved
            assert error < TOLERANCE, (rank, fqn, error.item())


def _mixtral_worker(rank: int, world: int) -> dict[str, Any]:
    import transformers
    from hf_models import config_of
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_of("mixtral"))
    dmuon.dedicate_params(model, mesh, split_expert_stacks=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = dmuon.Muon(
        model, lr=LR, split="auto", weight_decay=0.1, qk_clip=QK_TAU, adamw_lr=ADAMW_LR
    )
    generator = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(2):
        ids = torch.randint(0, 64, (world, 1, 17), generator=generator)[rank]
        model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = optimizer.qk_clip_report
        clipped += report.clipped_heads if report is not None else 0
    state = get_dedication(model)
    full = dmuon.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "clipped": clipped,
        "full": {dp.fqn: full[dp.fqn] for dp in state.params},
        "held": {
            dp.name: (dp.param.detach().clone(), dp.experts, bool(dp.updates_here))
            for dp in state.params
            if dp.is_owned
        },
    }


def test_expert_ranges_export_their_stepping_owners_masters() -> None:
    """A Mixtral whose expert stacks are split across owners, HSDP 2x2 under a bfloat16
    policy, with weight decay and QK-clip scaling heads: every rank's full state dict
    holds each range as its stepping owner's float32 master, and the other replica's owner
    holds that master's bfloat16 cast (the values travel after QK-clip)."""
    per_rank = spawn_ranks(4, _mixtral_worker)
    ranges = 0
    for rank, result in enumerate(per_rank):
        assert result["clipped"] > 0, rank  # QK-clip scaled heads
        for fqn, value in result["full"].items():
            assert value.dtype == torch.float32
            assert torch.equal(_bits(value), _bits(per_rank[0]["full"][fqn])), (rank, fqn)
        for name, (value, experts, steps_here) in result["held"].items():
            whole = result["full"][name.split("[", 1)[0]]
            master = whole[experts[0] : experts[1]] if experts is not None else whole
            ranges += experts is not None
            assert value.dtype == (torch.float32 if steps_here else torch.bfloat16), name
            assert torch.equal(_bits(value), _bits(master.to(value.dtype))), (rank, name)
    assert ranges > 0  # the split path ran


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cluster_plan_predicts_the_bytes_held_and_sent(case: str) -> None:
    """`plan_cluster(param_bytes=2)` on the same model and mesh, rank by rank: the bytes of
    its masters (float32 where it steps them, bfloat16 elsewhere), of its momentum, and of
    the values it sends and receives between replicas per step."""
    from dist_harness import make_model

    from dmuon.plan import plan_cluster

    (replicas, shard), mode = CASES[case]
    plan = plan_cluster(
        make_model(Scenario("masters")),
        replicas * shard,
        shard,
        mode=mode,
        ns_dtype=torch.float32,
        param_bytes=2,
        device_type="cpu",
    )
    for rank, result in enumerate(_spawned(case)):
        narrow, predicted = result["narrow"], plan.ranks[rank]
        held = sum(v.numel() * v.element_size() for v in narrow["held"].values())
        stepped = sum(v.numel() for n, v in narrow["held"].items() if narrow["steps_here"][n])
        assert predicted.master_bytes == held, rank
        assert predicted.momentum_bytes == 4 * stepped, rank
        assert [predicted.update_bytes] * STEPS == narrow["moved"], rank
