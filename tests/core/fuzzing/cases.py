"""What one generated case is (`Case`), and the hypothesis strategy that draws cases.

A case is a plain, frozen description: the model (`ModelSpec`), the training (steps, global
batch, freezing schedule, clipping, parameter groups, Muon's settings) and one or two
distributed phases (`Phase`): the run, and, when it saves a checkpoint, a resume at another
world size and layout. Its ``repr`` is valid Python: a shrunk counterexample can be pasted
into the regression list as it is printed.

The strategy draws the simplest choices first (hypothesis shrinks towards the first
element of each ``sampled_from`` and towards small integers), so a shrunk case is a small
FSDP2 run unless the failure needs more.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import strategies as st

from fuzzing.models import Decoder, LayerSpec, ModelSpec, muon_matrices

LAYOUTS = ("fsdp", "ddp", "hsdp", "tp")
#: Layouts that run bfloat16 (``param_dtype`` needs FSDP2's MixedPrecisionPolicy, so not
#: DDP; under tensor parallelism a row-parallel layer sums bfloat16 partial products over
#: the tp ranks, which one process does not round alike, so the oracle cannot follow).
BF16_LAYOUTS = ("fsdp", "hsdp")
MAX_WORLD = 4

#: Before `dedicate_params` / after it (before the wrapper); steps count from 0.
BEFORE_DEDICATION, AFTER_DEDICATION = -2, -1


@dataclass(frozen=True)
class Freeze:
    """``param`` is frozen at ``at`` (a step, or before / after dedication) until ``until``."""

    param: str
    at: int
    until: int | None = None

    def frozen_at(self, step: int) -> bool:
        """Whether the parameter is frozen during step ``step``."""
        return self.at <= step and (self.until is None or step < self.until)


@dataclass(frozen=True)
class Phase:
    """One distributed run of a case: world, layout, ZeRO mode, accumulation."""

    world: int = 1
    layout: str = "fsdp"
    #: ``(replicate, shard)`` for HSDP, ``(dp, tp)`` for tensor parallelism.
    mesh: tuple[int, int] | None = None
    mode: str = "z3"
    #: ``fully_shard(reshard_after_forward=...)`` of the other parameters.
    fsdp_reshard: bool = True
    accum: int = 1
    #: Per step run, per micro-batch but the last: whether it runs under `dmuon.no_sync`.
    no_sync: tuple[tuple[bool, ...], ...] = ()
    forwards: int = 1
    bf16: bool = False
    check_collectives: bool = False
    #: ``dmuon.no_sync(scope=...)``: ``"replicas"`` (HSDP) still sums inside each replica.
    no_sync_scope: str = "all"
    #: ``dedicate_params(ns_split=...)``: ranks per block that may share an iteration.
    ns_split: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks (the tensor-parallel ones share their batch)."""
        return self.world // self.mesh[1] if self.layout == "tp" and self.mesh else self.world


@dataclass(frozen=True)
class Case:
    """A model, its training, and the phases that train it."""

    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)
    steps: int = 1
    rows: int = 4
    seq: int = 4
    run: Phase = field(default_factory=Phase)
    freezes: tuple[Freeze, ...] = ()
    clip: float | None = None
    #: ``None``, ``"decay"`` (`dmuon.weight_decay_groups`) or ``"custom"`` (plus a group
    #: with layer 0's matrices at other Muon settings and another AdamW rate).
    groups: str | None = None
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    adjust_lr_fn: str = "match_rms_adamw"
    #: After how many steps the run saves a DCP checkpoint (``None``: it does not).
    save_at: int | None = None
    resume: Phase | None = None

    @property
    def bf16(self) -> bool:
        """Whether any phase runs with ``param_dtype=torch.bfloat16``."""
        return self.run.bf16 or (self.resume is not None and self.resume.bf16)

    def phases(self) -> list[tuple[str, Phase, range]]:
        """``(name, phase, steps it trains)``: the run, and the resume if there is one."""
        out = [("run", self.run, range(self.steps))]
        if self.resume is not None and self.save_at is not None:
            out.append(("resume", self.resume, range(self.save_at, self.steps)))
        return out

    def without_resume(self) -> Case:
        """The same case without its checkpoint (what shrinking tries first)."""
        return replace(self, save_at=None, resume=None)


# ----- the strategy ------------------------------------------------------------------------
@st.composite
def layer_specs(draw: st.DrawFn) -> LayerSpec:
    mlp = draw(st.sampled_from(("dense", "experts", "fused")))
    hidden = draw(st.integers(2, 12))
    if mlp == "dense":
        return LayerSpec("dense", hidden)
    experts = draw(st.integers(2, 4))
    return LayerSpec(
        mlp,
        hidden,
        experts,
        top_k=draw(st.integers(1, 2)),
        idle=draw(st.integers(0, experts - 1)),
    )


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    family = draw(st.sampled_from(("llama", "gpt2")))
    heads = draw(st.integers(1, 4))
    kv_heads = heads
    if family == "llama":
        kv_heads = draw(st.sampled_from([d for d in range(heads, 0, -1) if heads % d == 0]))
    return ModelSpec(
        family=family,
        vocab=draw(st.integers(5, 24)),
        heads=heads,
        kv_heads=kv_heads,
        # At least 4 wide: a norm over 2 features is a sign (its input gradient is rounding
        # noise, which AdamW turns into full steps), over 3 nearly so.
        head_dim=draw(st.integers(-(-4 // heads), 6)),
        layers=tuple(draw(st.lists(layer_specs(), min_size=1, max_size=3))),
        tied=draw(st.booleans()),
        attn_bias=family == "llama" and draw(st.booleans()),
    )


def tensor_parallel_sizes(model: ModelSpec, world: int) -> list[int]:
    """Tensor-parallel sizes a world allows: divisors >= 2 of the world that divide what
    the plan shards (head counts, dense hidden sizes): torch's ``RowwiseParallel`` takes
    its input's global width as the local one times the tp size, so uneven shards fail."""
    sizes = [t for t in range(2, world + 1) if world % t == 0]
    if model.family == "llama":
        widths = [model.heads, model.kv_heads]
        widths += [layer.hidden for layer in model.layers if layer.mlp == "dense"]
        sizes = [t for t in sizes if all(w % t == 0 for w in widths)]
    return sizes


@st.composite
def phases(draw: st.DrawFn, model: ModelSpec, steps: int) -> Phase:
    world = draw(st.integers(1, MAX_WORLD))
    layouts = [
        layout for layout in LAYOUTS if layout != "tp" or tensor_parallel_sizes(model, world)
    ]
    layout = draw(st.sampled_from(layouts))
    mesh = None
    if layout == "hsdp":
        shard = draw(st.sampled_from([s for s in range(world, 0, -1) if world % s == 0]))
        mesh = (world // shard, shard)
    elif layout == "tp":
        tp = draw(st.sampled_from(tensor_parallel_sizes(model, world)))
        mesh = (world // tp, tp)
    accum = draw(st.integers(1, 4))
    pattern = tuple(
        tuple(draw(st.lists(st.booleans(), min_size=accum - 1, max_size=accum - 1)))
        for _ in range(steps)
    )
    return Phase(
        world=world,
        layout=layout,
        mesh=mesh,
        mode=draw(st.sampled_from(("z3", "z2"))),
        fsdp_reshard=draw(st.booleans()),
        accum=accum,
        no_sync=pattern,
        forwards=draw(st.sampled_from((1, 2, 3))),
        bf16=layout in BF16_LAYOUTS and draw(st.booleans()),
        check_collectives=draw(st.booleans()),
        # Drawn last, so the draws above stay what they were for a given seed.
        no_sync_scope=draw(st.sampled_from(("all", "replicas"))) if layout == "hsdp" else "all",
        ns_split=draw(st.sampled_from(_ns_splits(layout, world, mesh))),
    )


def _ns_splits(layout: str, world: int, mesh: tuple[int, int] | None) -> list[int]:
    """``dedicate_params(ns_split=...)`` values a layout takes: divisors of the shard size
    (none with tensor parallelism)."""
    if layout == "tp":
        return [1]
    shard = mesh[1] if mesh is not None else world
    return [d for d in range(1, shard + 1) if shard % d == 0]


@st.composite
def freezes(draw: st.DrawFn, model: ModelSpec, seed: int, steps: int) -> tuple[Freeze, ...]:
    """Dedicated matrices frozen before or after dedication or at a step (and perhaps
    unfrozen later), and other parameters frozen from the start."""
    plain = Decoder(model, seed)
    matrices = sorted(muon_matrices(plain))
    others = sorted(n for n, _ in plain.named_parameters() if n not in matrices)
    chosen = draw(st.lists(st.sampled_from(matrices), max_size=3, unique=True))
    out = []
    for name in chosen:
        at = draw(st.integers(BEFORE_DEDICATION, steps - 1))
        until = draw(st.one_of(st.none(), st.integers(max(at + 1, 0), steps)))
        out.append(Freeze(name, at, None if until == steps else until))
    for name in draw(st.lists(st.sampled_from(others), max_size=2, unique=True)):
        out.append(Freeze(name, BEFORE_DEDICATION))
    return tuple(out)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A random case (see the module docstring)."""
    seed = draw(st.integers(0, 2**16))
    model = draw(model_specs())
    steps = draw(st.integers(1, 4))
    run = draw(phases(model, steps))
    save_at = resume = None
    if steps >= 2 and draw(st.booleans()):
        save_at = draw(st.integers(1, steps - 1))
        resume = draw(phases(model, steps - save_at))
    used = [p for p in (run, resume) if p is not None]
    need = max(p.dp * p.accum * p.forwards for p in used)
    return Case(
        seed=seed,
        model=model,
        steps=steps,
        rows=need + draw(st.integers(0, 3)),
        seq=draw(st.integers(3, 8)),
        run=run,
        freezes=draw(freezes(model, seed, steps)),
        clip=draw(st.one_of(st.none(), st.sampled_from((0.5, 0.05, 2.0)))),
        groups=draw(st.sampled_from((None, "decay", "custom"))),
        momentum=draw(st.sampled_from((0.95, 0.9))),
        nesterov=draw(st.booleans()),
        weight_decay=draw(st.sampled_from((0.0, 0.1))),
        adjust_lr_fn=draw(st.sampled_from(("match_rms_adamw", "original"))),
        save_at=save_at,
        resume=resume,
    )
