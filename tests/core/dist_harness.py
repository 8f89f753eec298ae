"""The one multi-process harness of the core tests, and the DMuon scenarios run on it.

`spawn_ranks(world, fn, *args)` starts ``world`` fresh processes (forked from a fork server
on CPU, spawned on CUDA), joins them in a gloo (or NCCL) process group through a file store
(no TCP port to race for), runs ``fn(rank, world, *args)`` on each and returns the per-rank
results. An exception on a rank comes back as ``{"error": traceback}`` for that rank, so one
failing check fails its own test instead of the whole module.

A scenario trains `TinyLlama` for a few optimizer steps on a fixed global batch. The
distributed run uses the three-line integration (dedicate_params, fully_shard, Muon,
no_sync); the reference trains the plain model on the whole global batch with Muon math
written out here (float32 Newton-Schulz) and torch.optim.AdamW for everything else.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from collectives import recorded_collectives
from tiny_llama import TinyLlama

# The naive FSDP2 + Muon baseline lives with the benchmarks that compare against it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from naive_muon import NaiveMuon

from dmuon._ownership.fsdp_integration import fsdp_param_groups

#: Modules the CPU ranks' fork server imports once, so that each rank starts in a few
#: hundredths of a second of CPU instead of importing them itself: torch (several seconds
#: on a 2-core machine), what a rank unpickling its function imports with this module
#: (DTensor, DMuon's runtime and optimizer, 0.9 s), what ``dedicate_params`` loads
#: (torch's compiler, for ``torch.compiler.disable``) and the Hugging Face model code the
#: tests build (3 s). None of them starts a thread, so a fork of the server stays clean.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "dmuon",
    "dmuon._ownership.runtime",
    "dmuon.optim._muon",
    "dmuon.checkpoint",
    "dmuon.train.loop",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "dist_harness",
    "tiny_llama",
    "collectives",
    "hf_models",
]

#: How long a collective may wait before the ranks give up (a hang becomes an error).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)

VOCAB, SEQ, MICRO = 64, 12, 2
LR, ADAMW_LR = 0.02, 3e-3


@dataclass(frozen=True)
class Scenario:
    """One distributed training configuration."""

    name: str
    mode: str = "z3"
    accum: int = 1
    use_no_sync: bool = True
    steps: int = 3
    checkpoint: bool = False
    dataclass_output: bool = False
    bf16: bool = False
    #: With ``bf16``: leave ``dedicate_params``' dtypes unset, so the dedicated matrices
    #: follow FSDP2's ``MixedPrecisionPolicy`` (the configuration users copy from FSDP2).
    bf16_from_policy: bool = False
    naive: bool = False
    #: A layer whose parameters are all frozen (layers below it still train).
    frozen_layer: int | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    #: ``(replicas, shard size)`` of a 2-D HSDP mesh; ``None`` for a 1-D mesh of the world.
    #: A mesh smaller than the world runs once per group of that many ranks.
    mesh_shape: tuple[int, int] | None = None
    #: How the rest of the model is distributed: ``"fsdp"`` (fully_shard) or ``"ddp"``.
    layout: str = "fsdp"
    #: ``dedicate_params``'s communication dtypes (``None``: float32).
    reduce_dtype: torch.dtype | None = None
    broadcast_dtype: torch.dtype | None = None
    #: Build the model on the meta device, dedicate and shard it there, then materialise
    #: it (``to_empty``) and load rank 0's full state dict with ``broadcast_from_rank0``,
    #: as torchtitan initialises large models.
    meta_init: bool = False


def make_model(scenario: Scenario) -> TinyLlama:
    """The scenario's model, identically initialised on every rank."""
    torch.manual_seed(1234)
    model = TinyLlama(
        vocab=VOCAB,
        use_checkpoint=scenario.checkpoint,
        dataclass_output=scenario.dataclass_output,
        **scenario.model_kwargs,
    )
    if scenario.frozen_layer is not None:
        model.layers[scenario.frozen_layer].requires_grad_(False)
    return model


def global_batch(step: int, world: int, accum: int) -> torch.Tensor:
    """Token ids of one optimizer step: world x accum x MICRO sequences of SEQ + 1."""
    gen = torch.Generator().manual_seed(99 + step)
    return torch.randint(0, VOCAB, (world * accum * MICRO, SEQ + 1), generator=gen)


#: A batch no training step sees: the forward after the last step is checked on it.
EVAL_TOKENS = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1], tokens[:, 1:])
    return out.loss if hasattr(out, "loss") else out


# ----- reference: one process, the whole global batch --------------------------------------
def reference_train(
    model: torch.nn.Module,
    muon_names: set[str],
    step_batches: list[torch.Tensor],
    bf16: bool = False,
    before_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Train ``model`` one step per global batch: Muon written out here, AdamW for the rest.

    Muon (float32 Newton-Schulz, Nesterov momentum 0.95, ``match_rms_adamw`` scaling) on
    the parameters named in ``muon_names``; ``torch.optim.AdamW`` on every other one
    (frozen ones included: they train once unfrozen). ``before_step(step, model)`` runs
    before each step's forward. Returns the final parameters.
    """
    from dmuon import newton_schulz

    params = dict(model.named_parameters())
    muon_params = {n: params[n] for n in muon_names}
    others = [p for n, p in params.items() if n not in muon_names]
    adamw = torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=0.01)
    momentum = {n: torch.zeros_like(p) for n, p in muon_params.items()}
    for step, tokens in enumerate(step_batches):
        if before_step is not None:
            before_step(step, model)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = _loss(model, tokens)
        loss.backward()
        with torch.no_grad():
            for n, p in muon_params.items():
                if p.grad is None:
                    continue  # unused in this step (an idle expert): torch.optim skips it
                buf = momentum[n]
                buf.lerp_(p.grad, 1 - 0.95)
                update = p.grad.lerp(buf, 0.95)
                ortho = newton_schulz(update, 5, "polar_express", dtype=torch.float32)
                scale = 0.2 * max(p.shape) ** 0.5
                p.add_(ortho, alpha=-LR * scale)
                p.grad = None
        adamw.step()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_eval_loss(scenario: Scenario, params: dict[str, torch.Tensor]) -> float:
    """Loss of the evaluation batch for the scenario's model holding ``params``."""
    model = make_model(scenario)
    model.load_state_dict(params)
    with torch.no_grad():
        return _loss(model, EVAL_TOKENS).item()


def reference_run(scenario: Scenario, world: int) -> dict[str, torch.Tensor]:
    """Train the plain model on the global batch; return its final parameters."""
    from dmuon import default_predicate

    model = make_model(scenario)
    muon_names = {
        n
        for n, p in model.named_parameters()
        if default_predicate(n, p) and "lm_head" not in n and n.startswith("layers.")
    }
    batches = [global_batch(step, world, scenario.accum) for step in range(scenario.steps)]
    return reference_train(model, muon_names, batches, bf16=scenario.bf16)


# ----- distributed worker -------------------------------------------------------------------
def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor on every rank (collective)."""
    from torch.distributed.tensor import DTensor

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication

    records: dict[str, list[Any]] = {}
    for dp in _dedicated(model):
        records.setdefault(dp.fqn, []).append(dp)  # a stack split by experts: its ranges
    state = get_dedication(model)
    group = state.runtime.comm.group if state is not None else None  # owners' shard group
    if state is not None:
        dmuon.wait_for_updates(model)  # it reads the masters itself
    full = {}
    for name, param in model.named_parameters():
        if name in records:
            pieces = []
            for dp in records[name]:
                # Under HSDP with a bfloat16 forward only the replica that steps a matrix
                # holds its float32 master: every owner takes that one.
                tensor = (
                    state.runtime.replica_updates.exact_master(dp).clone()
                    if dp.is_owned
                    else torch.empty(dp.shape, dtype=dp.param.dtype, device=dp.param.device)
                )
                if group is not None:
                    dist.broadcast(tensor, src=dist.get_global_rank(group, dp.owner), group=group)
                pieces.append(tensor.cpu())
            full[name] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        elif isinstance(param, DTensor):
            full[name] = param.full_tensor().detach().cpu()
        else:
            full[name] = param.detach().cpu()
    return full


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as a full tensor on every rank (collective); dedicated ones come from
    their owners' ``_reduced_grad`` (matrices no rank had a gradient for are absent)."""
    from torch.distributed.tensor import DTensor

    from dmuon._ownership.dedication_state import get_dedication

    state = get_dedication(model)
    group = state.runtime.comm.group if state is not None else None
    dedicated = {dp.fqn: dp for dp in _dedicated(model)}
    grads = {}
    for name, param in model.named_parameters():
        if name in dedicated:
            dp = dedicated[name]
            reduced = state.runtime.reduced_grad(dp) if dp.is_owned else None
            box = torch.tensor([0 if reduced is None else 1])
            full = reduced.clone() if reduced is not None else torch.zeros(dp.shape)
            if group is not None:
                src = dist.get_global_rank(group, dp.owner)
                dist.broadcast(box, src=src, group=group)
                dist.broadcast(full, src=src, group=group)
            if box.item():
                grads[name] = full
        elif isinstance(param.grad, DTensor):
            grads[name] = param.grad.full_tensor()
        elif param.grad is not None:
            grads[name] = param.grad.clone()
    return grads


def _dedicated(model: torch.nn.Module) -> list[Any]:
    from dmuon._ownership.dedication_state import get_dedication

    state = get_dedication(model)
    return state.params if state is not None else []


def _memory_report(model: torch.nn.Module) -> dict[str, Any]:
    from dmuon._ownership.dedication_state import get_dedication

    state = get_dedication(model)
    assert state is not None and state.runtime is not None
    groups = list(state.runtime.buffers())
    return {
        "buffer_bytes": sum(g.buffer.untyped_storage().size() for g in groups),
        "packed_bytes": sum(g.numel * g.buffer.element_size() for g in groups),
        "placeholder_elements": sum(dp.param.numel() for dp in state.params if not dp.is_owned),
        "master_ok": all(
            dp.param.dtype == torch.float32 and tuple(dp.param.shape) == tuple(dp.shape)
            for dp in state.params
            if dp.is_owned
        ),
        "groups": len(groups),
        # Per buffer: how many ranks own its matrices (one collective call per direction
        # either way: a broadcast and a reduce for one owner, else an all-gather and a
        # reduce-scatter).
        "owners": [len({span.owner for span in g.spans}) for g in groups],
    }


@contextmanager
def count_collectives() -> Iterator[list[tuple[str, int]]]:
    """Record every collective issued inside the block as ``(name, elements)``, read once
    the block is left (see `collectives.recorded_collectives`: an independent count, not
    any audit)."""
    pairs: list[tuple[str, int]] = []
    with recorded_collectives(functional=True) as seen:
        yield pairs
    pairs.extend((kind, numel) for _, kind, numel, _ in seen)


def run_scenario(
    scenario: Scenario, rank: int, world: int, device_type: str = "cpu"
) -> dict[str, Any]:
    """Train one scenario on this rank; return what the tests check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.flop_counter import FlopCounterMode

    import dmuon

    if scenario.mesh_shape is None:
        mesh = init_device_mesh(device_type, (world,))
    elif math.prod(scenario.mesh_shape) == world:
        mesh = init_device_mesh(
            device_type, scenario.mesh_shape, mesh_dim_names=("replicate", "shard")
        )
    else:
        # A mesh smaller than the world: independent runs side by side, each on its own
        # 2-D sub-mesh, each training as if its ranks were the whole world.
        size = math.prod(scenario.mesh_shape)
        runs = init_device_mesh(
            device_type,
            (world // size, *scenario.mesh_shape),
            mesh_dim_names=("runs", "replicate", "shard"),
        )
        mesh = runs["replicate", "shard"]
        rank, world = rank % size, size
    if scenario.meta_init:
        # Rank 0 holds the pretrained weights (here: the seeded model), as a checkpoint
        # loaded on rank 0 only would; every rank builds the model itself on meta.
        full = make_model(scenario).state_dict() if rank == 0 else {}
        with torch.device("meta"):
            model = make_model(scenario)
        setup = _peak_cpu_bytes()
        setup.__enter__()
    else:
        model = make_model(scenario).to(device_type)
    if not scenario.naive:
        dmuon.dedicate_params(
            model,
            mesh,
            reshard_after_forward=scenario.mode == "z3",
            param_dtype=torch.bfloat16 if scenario.bf16 and not scenario.bf16_from_policy else None,
            reduce_dtype=scenario.reduce_dtype,
            broadcast_dtype=scenario.broadcast_dtype,
        )
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if scenario.bf16
        else MixedPrecisionPolicy()
    )
    wrapped: torch.nn.Module = model
    if scenario.layout == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    setup_memory: dict[str, int] = {}
    if scenario.meta_init:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        model.to_empty(device=device_type)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        dmuon.set_model_state_dict(model, full, options=options)
        setup.__exit__(None, None, None)
        setup_memory = {"peak": setup.peak, **_share_bytes(model)}
    make_optimizer = NaiveMuon if scenario.naive else dmuon.Muon
    optimizer = make_optimizer(
        wrapped, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
    )
    audit = optimizer.audit if scenario.naive else dmuon.comm_audit(model)
    memory_after_forward: dict[str, Any] = {}
    step_issued: list[int] = []
    step_flops: list[int] = []
    first_grad_norm = None
    for step in range(scenario.steps):
        tokens = global_batch(step, world, scenario.accum)
        per_rank = tokens.chunk(world)[rank].to(device_type)
        for micro, chunk in enumerate(per_rank.chunk(scenario.accum)):
            accumulating = micro + 1 < scenario.accum
            ctx = dmuon.no_sync(wrapped) if accumulating and scenario.use_no_sync else nullcontext()
            with ctx:
                loss = _loss(wrapped, chunk) / scenario.accum
                if step == 0 and micro == 0 and not scenario.naive:
                    memory_after_forward = _memory_report(model)
                loss.backward()
        if step == 0 and (scenario.mesh_shape is not None or scenario.layout == "ddp"):
            # Clipping with a bound no gradient reaches returns the global norm, unchanged.
            first_grad_norm = float(dmuon.clip_grad_norm_(wrapped, max_norm=1e9))
        with count_collectives() as issued, FlopCounterMode(display=False) as flops:
            optimizer.step()
        step_issued.append(issued)
        step_flops.append(flops.get_total_flops())
        optimizer.zero_grad()
    leftover = [
        dp.fqn
        for dp in _dedicated(model)
        if getattr(dp.param, "_reduced_grad", None) is not None
        or getattr(dp.param, "_accumulated_grad", None) is not None
    ]
    params = full_parameters(model)  # before the eval forward: FSDP2 keeps the root unsharded
    with torch.no_grad():
        eval_loss = _loss(model, EVAL_TOKENS.to(device_type)).item()
    return {
        "params": params,
        "eval_loss": eval_loss,
        "comm": [s.as_dict() for s in audit.steps],
        "step_issued": step_issued,
        "step_flops": step_flops,
        "memory": memory_after_forward,
        "leftover_grads": leftover,
        "owners": {dp.fqn: dp.owner for dp in _dedicated(model)},
        "first_grad_norm": first_grad_norm,
        "setup_memory": setup_memory,
    }


class _peak_cpu_bytes:
    """The most CPU memory allocated at once inside the block beyond what was there at its
    start, from the profiler's allocation and free events in the allocator's order.

    The profiler sees only this thread's frees. A gloo worker thread sometimes drops the
    last reference to a received buffer, and that free goes unrecorded; an address the
    allocator hands out again must have been freed, so a new block at a live address
    replaces the old one rather than adding to it."""

    def __enter__(self) -> _peak_cpu_bytes:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import json
        import tempfile

        self._profile.__exit__(*exc)
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            self._profile.export_chrome_trace(trace.name)
            with open(trace.name) as f:
                events = json.load(f)["traceEvents"]
        changes = sorted(
            (e["args"]["Ev Idx"], e["args"]["Addr"], e["args"]["Bytes"])
            for e in events
            if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
        )
        blocks: dict[int, int] = {}
        live = self.peak = 0
        for _, address, change in changes:
            live -= blocks.pop(address, 0)
            if change > 0:
                blocks[address] = change
                live += change
            self.peak = max(self.peak, live)


def _share_bytes(model: torch.nn.Module) -> dict[str, int]:
    """What a rank holds after set-up: its FSDP2 shards, its owned float32 masters, the
    largest boundary's buffer (allocated one at a time), the largest single tensor of the
    model (what a load from rank 0 broadcasts at once) and the whole model, in bytes."""
    from torch.distributed.tensor import DTensor

    from dmuon._ownership.dedication_state import get_dedication

    state = get_dedication(model)
    assert state is not None and state.runtime is not None
    shards = sum(
        p.to_local().numel() * p.element_size()
        for p in model.parameters()
        if isinstance(p, DTensor)
    )
    masters = sum(dp.param.numel() * 4 for dp in state.params if dp.is_owned)
    boundary = max(g.numel * g.buffer.element_size() for g in state.runtime.buffers())
    full_sizes = [p.numel() for p in model.parameters() if isinstance(p, DTensor)]
    largest = 4 * max(full_sizes + [dp.shape.numel() for dp in state.params])
    whole = 4 * (sum(full_sizes) + sum(dp.shape.numel() for dp in state.params))
    return {
        "shards": shards,
        "masters": masters,
        "boundary": boundary,
        "largest": largest,
        "whole": whole,
    }


def hsdp_model(
    mesh: Any, mode: str, name: str, model: torch.nn.Module | None = None, **settings: Any
) -> tuple[torch.nn.Module, Any]:
    """The scenarios' model (or ``model``) on ``mesh``, dedicated in ``mode``, every layer
    and the root under ``fully_shard``, with the reference's optimizer settings updated by
    ``settings``."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model(Scenario(name)) if model is None else model
    dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reference = {"lr": LR, "ns_dtype": torch.float32, "adamw_lr": ADAMW_LR}
    optimizer = dmuon.Muon(model, **{**reference, "adamw_weight_decay": 0.01, **settings})
    return model, optimizer


def _error_checks(rank: int, world: int) -> dict[str, str]:
    """User errors that need a process group: each returns its message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    messages = {}
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("errors"))
    fully_shard(model, mesh=mesh)
    try:
        dmuon.dedicate_params(model, mesh)
    except ValueError as exc:
        messages["after_fully_shard"] = str(exc)
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    try:
        dmuon.dedicate_params(make_model(Scenario("errors")), mesh2d)
    except ValueError as exc:
        messages["mesh_2d"] = str(exc)
    # no_sync restores FSDP2's flags and DMuon's sync flag, also when the block raises.
    model = make_model(Scenario("no_sync"))
    dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.layers[0].set_requires_gradient_sync(False, recurse=False)
    runtime = dmuon._ownership.dedication_state.get_dedication(model).runtime

    def flags() -> list[bool]:
        return [
            group.reduce_grads
            for module in model.modules()
            if hasattr(module, "_get_fsdp_state")
            for group in fsdp_param_groups(module)
        ] + [runtime.sync_grads]

    before = flags()
    inside: list[bool] = []
    try:
        with dmuon.no_sync(model):
            inside = flags()
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    messages["no_sync_flags"] = repr((before, inside, flags()))
    return messages


def join_group(
    rank: int,
    world: int,
    store_file: str,
    environ: dict[str, str],
    device_type: str = "cpu",
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> None:
    """Set up a freshly started rank: the test's environment (a fork server's children
    inherit the server's, not the test's current one), one thread, its device, and the
    process group through the file store ``store_file``."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def _rank_main(
    rank: int,
    world: int,
    store_file: str,
    out_dir: str,
    device_type: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    join_group(rank, world, store_file, environ, device_type)
    try:
        result: Any = fn(rank, world, *args)
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_ranks(
    world: int, fn: Callable[..., Any], *args: Any, device_type: str = "cpu"
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes; return their results.

    CPU ranks are forked from a fork server that has imported torch and dmuon (a process
    without threads or a process group, so a fork of it is as clean as a new interpreter);
    CUDA ranks are spawned.
    """
    if device_type == "cpu":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        store_file = os.path.join(out_dir, "store")
        mp.start_processes(
            _rank_main,
            args=(world, store_file, out_dir, device_type, fn, args, dict(os.environ)),
            nprocs=world,
            start_method="forkserver" if device_type == "cpu" else "spawn",
        )
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)
        ]


def run_in_order(cases: Iterable[tuple[Hashable, Callable[[], Any]]]) -> dict[Hashable, Any]:
    """Run each ``(key, case)`` in turn on this rank; a case that raises gets ``{"error":
    traceback}`` and the ones after it ``{"error": "not run: ..."}``, since the ranks may now
    disagree on the collective schedule."""
    results: dict[Hashable, Any] = {}
    failed: Hashable | None = None
    for key, case in cases:
        if failed is not None:
            results[key] = {"error": f"not run: {failed!r} failed before it"}
            continue
        try:
            results[key] = case()
        except Exception:
            results[key] = {"error": f"{key}:\n{traceback.format_exc()}"}
            failed = key
    return results


def _run_scenarios(
    rank: int, world: int, scenarios: list[Scenario], device_type: str
) -> dict[str, Any]:
    results = run_in_order(
        (s.name, partial(run_scenario, s, rank, world, device_type)) for s in scenarios
    )
    if device_type == "cpu" and all("error" not in r for r in results.values()):
        try:
            results["__errors__"] = _error_checks(rank, world)
        except Exception:
            results["__errors__"] = {"error": traceback.format_exc()}
    return results


def run_distributed(
    world: int, scenarios: list[Scenario], device_type: str = "cpu"
) -> list[dict[str, Any]]:
    """Run every scenario on ``world`` ranks spawned once (gloo on CPU, NCCL on CUDA)."""
    return spawn_ranks(world, _run_scenarios, scenarios, device_type, device_type=device_type)


__all__ = [
    "Scenario",
    "asdict",
    "count_collectives",
    "full_gradients",
    "full_parameters",
    "reference_eval_loss",
    "reference_run",
    "reference_train",
    "run_distributed",
    "run_in_order",
    "spawn_ranks",
]
