"""Which parameters are dedicated, where their hook boundaries are, and who owns them.

Everything here is pure: no process group, no hooks. `plan_owners` can be called for any
world size to see what a run would do before launching it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from torch import nn

from dmuon._ownership.split_iterations import plan_split_iterations

#: Attribute names of ``nn.ModuleList`` containers whose elements are hook boundaries
#: (Llama ``layers``, ViT ``blocks``, GPT-2 ``h``).
BOUNDARY_CONTAINER_NAMES: tuple[str, ...] = ("layers", "blocks", "h")

#: Module names that mark an output head or an embedding; never dedicated by default.
_EXCLUDED_NAME_PARTS: tuple[str, ...] = ("lm_head", "output", "embed", "wte", "wpe", "norm")

#: Module names that wrappers insert into parameter paths, and that state dicts leave out
#: (torch's activation-checkpoint wrapper, torch.compile, FSDP1).
WRAPPER_NAMES: tuple[str, ...] = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def state_dict_name(path: str) -> str:
    """A parameter's name as torch's state dicts give it: ``path`` without wrapper modules."""
    return ".".join(part for part in path.split(".") if part not in WRAPPER_NAMES)


ParamPredicate = Callable[[str, nn.Parameter], bool]
ModulePredicate = Callable[[nn.Module], bool]


def default_predicate(name: str, param: nn.Parameter) -> bool:
    """Select 2-D ``weight`` matrices that are not embeddings, norms or output heads.

    ``dedicate_params`` applies this predicate only to parameters owned by ``nn.Linear``
    modules and skips parameters tied to another name, so together they select the hidden
    linear layers of a transformer (attention projections and MLP matrices) and leave the
    embedding, the ``lm_head``/``output`` head, norms and biases to AdamW. Besides, it
    selects the fused 3-D expert stacks of mixture-of-experts layers by their layout (see
    `dmuon._ownership.experts`), and leaves routers and the gates next to them to AdamW.

    Args:
        name: Fully qualified parameter name, e.g. ``"layers.0.attn.q_proj.weight"``.
        param: The parameter.

    Returns:
        ``True`` when the parameter should be trained with Muon.
    """
    if param.ndim != 2 or not name.endswith("weight"):
        return False
    parts = name.split(".")[:-1]
    return not any(excluded in part for part in parts for excluded in _EXCLUDED_NAME_PARTS)


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration: ``2 * m**2 * n + m**3`` per matrix.

    ``m`` is the short side and ``n`` the long side of an ``m x n`` matrix: the iteration
    computes ``A = X Xᵀ`` (``m² n``), ``A @ A`` (``m³``) and ``B @ X`` (``m² n``) on the
    short side. A 3-D shape ``(k, m, n)`` is a stack of ``k`` matrices and costs ``k``
    times as much. Twice this, times the number of iterations, is the FLOP count a
    `torch.utils.flop_counter.FlopCounterMode` reports for the standard iteration.
    """
    count = int(shape[0]) if len(shape) == 3 else 1
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    return count * (2 * m * m * n + m**3)


def newton_schulz_flops(
    shape: Sequence[int], steps: int, gram: bool = False, restarts: int = 0
) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on a matrix (or a 3-D stack), as
    `torch.utils.flop_counter.FlopCounterMode` counts them: 2 per multiply-add.

    The standard iteration costs ``steps`` times `newton_schulz_cost`. The Gram iteration
    (``gram``: `dmuon.Muon(ns_gram=True)` where `dmuon.optim.uses_gram` says so) forms
    ``R = X Xᵀ`` once (``m² n``), runs on ``m x m`` matrices (``m³`` for the first step,
    ``4 m³`` for each later one) and applies the result to ``X`` once (``m² n``):
    ``2 m² n + (4 steps - 3) m³`` multiply-adds per matrix. Each of ``restarts`` (a 16-bit
    Gram iteration's, `dmuon.optim.GRAM_RESTARTS`) applies ``Q`` to ``X`` and forms ``R``
    afresh (``2 m² n``) and skips one update of ``R`` and one of ``Q`` (``3 m³``).
    """
    if not gram:
        return 2 * steps * newton_schulz_cost(shape)
    count = int(shape[0]) if len(shape) == 3 else 1
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    return 2 * count * (2 * (1 + restarts) * m * m * n + (4 * steps - 3 - 3 * restarts) * m**3)


#: ``split_expert_stacks`` values: always split stacks, never, or when it balances better.
SplitStacks = Literal["auto"] | bool


class ExpertRange(NamedTuple):
    """Experts ``start`` to ``stop - 1`` of a split stack, and the rank that owns them."""

    start: int
    stop: int
    owner: int


def range_name(fqn: str, start: int, stop: int) -> str:
    """The name a plan gives experts ``start:stop`` of the stack ``fqn``: ``fqn[start:stop]``."""
    return f"{fqn}[{start}:{stop}]"


@dataclass(frozen=True)
class OwnerPlan:
    """The result of `plan_owners`.

    Ranks of the whole mesh are numbered as an HSDP mesh numbers them: replica ``r`` and
    shard rank ``s`` are rank ``r * shard_size + s`` (a 1-D mesh has one replica).

    Attributes:
        owners: ``{name: owner_rank}`` in the order the parameters were given: the shard
            rank that holds the matrix's master in every replica, broadcasts it and
            receives its gradient. A stack split by experts appears as one entry per
            range, named ``fqn[start:stop]`` (experts ``start`` to ``stop - 1``), in
            expert order.
        loads: Newton-Schulz cost (`newton_schulz_cost`) of the matrices each rank of the
            whole mesh orthogonalizes.
        imbalance: ``max(loads) / mean(loads)``; 1.0 is perfect balance.
        expert_ranges: ``{fqn: (ExpertRange, ...)}`` of every stack split by experts;
            empty when no stack is split.
        workers: ``{name: replica}``: the replica whose owner runs the matrix's
            Newton-Schulz iteration and keeps its momentum (0 on a 1-D mesh).
        elements: Elements of the matrices each rank of the whole mesh orthogonalizes:
            the elements of its momentum (4 bytes each).
        shard_size: Ranks per replica.
        split: The matrices whose iteration is split over their block of ``ns_split``
            ranks (`dmuon._ownership.split_iterations`); ``loads`` counts each member's
            share.
        ns_split: Ranks per block that may share an iteration (1: none is split).
    """

    owners: dict[str, int]
    loads: tuple[int, ...]
    imbalance: float
    expert_ranges: dict[str, tuple[ExpertRange, ...]] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)
    elements: tuple[int, ...] = ()
    shard_size: int = 0
    split: frozenset[str] = frozenset()
    ns_split: int = 1

    @property
    def replicas(self) -> int:
        """Replicas of the mesh the plan is for (1 on a 1-D mesh)."""
        return len(self.loads) // self.shard_size if self.shard_size else 1

    @property
    def element_imbalance(self) -> float:
        """``max(elements) / mean(elements)`` over the ranks; 1.0 is perfect balance."""
        mean = sum(self.elements) / len(self.elements) if self.elements else 0.0
        return max(self.elements) / mean if mean > 0 else 1.0

    def owned_elements(self) -> tuple[int, ...]:
        """Elements of the masters each shard rank holds (the same in every replica)."""
        size = self.shard_size or len(self.loads)
        return tuple(sum(self.elements[shard::size]) for shard in range(size))


@dataclass(frozen=True)
class _Item:
    """One unit of ownership: a whole tensor, or a range of a split stack's experts."""

    name: str
    fqn: str
    cost: int
    elements: int
    boundary: str
    experts: tuple[int, int] | None = None


def _expert_ranges(experts: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` contiguous ranges of ``experts`` whose sizes differ by at most one."""
    base, extra = divmod(experts, pieces)
    ranges, start = [], 0
    for index in range(pieces):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _items(
    shapes: Mapping[str, Sequence[int]],
    boundaries: Mapping[str, str],
    pieces: Mapping[str, int],
) -> list[_Item]:
    items = []
    for fqn, shape in shapes.items():
        boundary = boundaries.get(fqn, "")
        count = pieces.get(fqn, 1)
        if count == 1:
            items.append(_Item(fqn, fqn, newton_schulz_cost(shape), _numel(shape), boundary))
            continue
        per_expert = newton_schulz_cost(tuple(shape)[1:])
        per_expert_elements = _numel(tuple(shape)[1:])
        for start, stop in _expert_ranges(int(shape[0]), count):
            name = range_name(fqn, start, stop)
            size = stop - start
            items.append(
                _Item(
                    name,
                    fqn,
                    size * per_expert,
                    size * per_expert_elements,
                    boundary,
                    (start, stop),
                )
            )
    return items


class _Assignment(NamedTuple):
    ranks: dict[str, int]
    loads: list[int]
    elements: list[int]


def _assign(items: list[_Item], shard_size: int, replicas: int, block: int = 1) -> _Assignment:
    """Longest-processing-time first over every rank of the mesh; the ranges of one stack
    go to different ranks.

    Among the ranks within one item's cost of the least loaded: with blocks of ``block``
    ranks that may share an iteration, the least loaded block first (matrices spread over
    blocks, so a block's other ranks are free to help); then the shard rank that holds
    the fewest matrices of the item's boundary (one layer's broadcasts come from several
    ranks), then the fewest elements (momentum and master memory), then the least load,
    then the lowest rank. The ranks are compared as arrays, one criterion after the
    other, so a plan of thousands of ranks takes milliseconds per matrix.
    """
    world = shard_size * replicas
    ranks = np.arange(world)
    position = ranks % shard_size
    block_of = ranks // block
    block_loads = np.zeros(world // block, dtype=np.int64)
    position_elements = np.zeros(shard_size, dtype=np.int64)
    loads = np.zeros(world, dtype=np.int64)
    elements = np.zeros(world, dtype=np.int64)
    per_boundary: dict[str, np.ndarray] = {}
    holders: dict[str, list[int]] = {}
    order = {item.name: index for index, item in enumerate(items)}
    assigned: dict[str, int] = {}
    for item in sorted(items, key=lambda i: (-i.cost, order[i.name])):
        taken = holders.setdefault(item.fqn, []) if item.experts is not None else []
        free = np.ones(world, dtype=bool)
        free[taken] = False
        lightest = loads[free].min()
        chosen = np.flatnonzero(free & (loads <= lightest + item.cost))
        counts = per_boundary.setdefault(item.boundary, np.zeros(shard_size, dtype=np.int64))
        criteria: list[Callable[[np.ndarray], np.ndarray]] = [
            lambda r, counts=counts: counts[position[r]],
            lambda r: elements[r],
            lambda r: loads[r],
        ]
        if block > 1:
            # With blocks, whole replicas start empty: balance what each shard position
            # holds in every replica (masters, gathers, reduces) first.
            criteria[:0] = [lambda r: block_loads[block_of[r]]]
            criteria[2:2] = [lambda r: position_elements[position[r]]]
        for criterion in criteria:
            if len(chosen) == 1:
                break
            values = criterion(chosen)
            chosen = chosen[values == values.min()]
        rank = int(chosen[0])
        assigned[item.name] = rank
        taken.append(rank)
        loads[rank] += item.cost
        block_loads[rank // block] += item.cost
        position_elements[rank % shard_size] += item.elements
        elements[rank] += item.elements
        counts[rank % shard_size] += 1
    return _Assignment(assigned, loads.tolist(), elements.tolist())


def _split_candidates(
    shapes: Mapping[str, Sequence[int]], ranks: int, split: SplitStacks
) -> list[str]:
    """Stacks the planner may split: every stack (``True``), dominant ones (``"auto"``)."""
    if split is False or ranks < 2:
        return []
    stacks = [fqn for fqn, shape in shapes.items() if len(shape) == 3 and int(shape[0]) >= 2]
    if split is True:
        return stacks
    share = sum(newton_schulz_cost(shape) for shape in shapes.values()) / ranks
    return [fqn for fqn in stacks if newton_schulz_cost(shapes[fqn]) > share]


def plan_owners(
    shapes: Mapping[str, Sequence[int]],
    world_size: int,
    boundaries: Mapping[str, str] | None = None,
    split_expert_stacks: SplitStacks = "auto",
    replicas: int = 1,
    ns_split: int = 1,
) -> OwnerPlan:
    """Assign every matrix to one owner rank and one rank of the whole mesh that
    orthogonalizes it, balancing Newton-Schulz cost.

    The plan is made over every rank of the mesh, ``world_size`` shard ranks times
    ``replicas`` replicas (HSDP): each matrix's Newton-Schulz iteration and momentum
    live on exactly one of them, rank ``r * world_size + s``. Its owner is that rank's
    shard rank ``s``: in every replica, the rank at shard position ``s`` holds the master,
    broadcasts it for forward and receives its gradient; only replica ``r``'s runs the
    iteration, and it hands the result to the others (see `dmuon.dedicate_params`).

    Longest-processing-time first: matrices are taken in decreasing cost
    (`newton_schulz_cost`, the iteration's multiply-adds) and each goes to a least-loaded
    rank. Among ranks whose load is within one matrix of the least loaded, the shard rank
    that owns the fewest matrices of the same hook boundary wins, so one layer's broadcasts
    come from several ranks, then the rank with the fewest elements, so the momentum and
    masters spread too. Ties break on input order and rank, so the plan is deterministic
    and identical on every rank.

    A 3-D stack of matrices (fused experts) is one item with one owner, its cost the sum
    of its matrices' costs, unless it is split by experts: its experts are then cut into
    contiguous ranges of nearly equal size, each range an item of its own, and the ranges
    of one stack go to different ranks. With ``split_expert_stacks="auto"`` a stack is a
    candidate when its cost exceeds the per-rank share ``S`` (total cost / ranks of the
    mesh), so one rank would carry more than its share. The planner compares the plan
    without splits with plans that cut every candidate of cost ``C`` into ``ceil(C / S)``,
    one more, or two more ranges (at most ``min(experts, ranks)``), and keeps the one whose
    heaviest rank is lightest (the fewest items on a tie). ``True`` splits every stack into
    at least 2 ranges the same way; ``False`` never splits.

    Args:
        shapes: ``{fqn: (rows, cols)}`` of the dedicated matrices, or ``(matrices, rows,
            cols)`` of dedicated stacks.
        world_size: Ranks that share the owners: the shard group's size (at least 1).
        boundaries: Optional ``{fqn: boundary_name}``; matrices of one boundary are spread.
        split_expert_stacks: ``"auto"`` (default), ``True`` or ``False``; see above.
        replicas: Replicas of an HSDP mesh (1 for a 1-D mesh).
        ns_split: Ranks per block that may share a matrix's iteration (a divisor of
            ``world_size``); with more than 1, matrices spread over blocks first, and the
            iterations that lighten the busiest ranks are split over their block
            (`dmuon._ownership.split_iterations`).

    Returns:
        The `OwnerPlan`.

    Raises:
        ValueError: If ``world_size`` or ``replicas`` is below 1, a shape is neither 2-D
            nor 3-D, ``split_expert_stacks`` is not ``"auto"``, ``True`` or ``False``, or
            ``ns_split`` does not divide ``world_size``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if not (split_expert_stacks == "auto" or isinstance(split_expert_stacks, bool)):
        raise ValueError(
            'split_expert_stacks must be "auto", True (split every expert stack across '
            f"owners) or False (one owner per stack), got {split_expert_stacks!r}"
        )
    for fqn, shape in shapes.items():
        if len(shape) not in (2, 3):
            raise ValueError(
                f"plan_owners needs 2-D matrix or 3-D stack shapes; {fqn!r} has shape "
                f"{tuple(shape)}"
            )
    check_ns_split(ns_split, world_size)
    boundaries = boundaries or {}
    ranks = world_size * replicas
    candidates = _split_candidates(shapes, ranks, split_expert_stacks)
    fewest = 2 if split_expert_stacks is True else 1
    share = sum(newton_schulz_cost(shape) for shape in shapes.values()) / ranks
    options: list[dict[str, int]] = [{}] if split_expert_stacks == "auto" else []
    for extra in (0, 1, 2):
        pieces = {}
        for fqn in candidates:
            most = min(int(shapes[fqn][0]), ranks)
            wanted = math.ceil(newton_schulz_cost(shapes[fqn]) / share) + extra
            pieces[fqn] = max(fewest, min(most, wanted))
        if pieces not in options:
            options.append(pieces)
    best: tuple[tuple[int, int], list[_Item], _Assignment, frozenset[str]] | None = None
    for pieces in options:
        items = _items(shapes, boundaries, pieces)
        assignment = _assign(items, world_size, replicas, ns_split)
        split, loads = plan_split_iterations(
            assignment.ranks,
            {item.name: item.cost for item in items},
            {item.name: shapes[item.fqn] for item in items if item.experts is None},
            assignment.loads,
            ns_split,
        )
        assignment = assignment._replace(loads=loads)
        score = (max(loads), len(items))  # the lightest heaviest rank, then fewest items
        if best is None or score < best[0]:
            best = (score, items, assignment, split)
    assert best is not None
    _, items, assignment, split = best
    owner_of = {name: rank % world_size for name, rank in assignment.ranks.items()}
    ranges: dict[str, list[ExpertRange]] = {}
    for item in items:
        if item.experts is not None:
            start, stop = item.experts
            ranges.setdefault(item.fqn, []).append(ExpertRange(start, stop, owner_of[item.name]))
    loads = assignment.loads
    mean = sum(loads) / ranks
    imbalance = max(loads) / mean if mean > 0 else 1.0
    return OwnerPlan(
        owners={item.name: owner_of[item.name] for item in items},
        loads=tuple(loads),
        imbalance=imbalance,
        expert_ranges={fqn: tuple(r) for fqn, r in ranges.items()},
        workers={item.name: assignment.ranks[item.name] // world_size for item in items},
        elements=tuple(assignment.elements),
        shard_size=world_size,
        split=split,
        ns_split=ns_split,
    )


def check_ns_split(ns_split: object, shard_size: int) -> None:
    """Refuse an ``ns_split`` that is not a positive integer dividing the shard size."""
    if isinstance(ns_split, bool) or not isinstance(ns_split, int) or ns_split < 1:
        raise ValueError(f"ns_split must be a positive integer, got {ns_split!r}")
    if shard_size % ns_split:
        raise ValueError(
            f"ns_split={ns_split} does not divide the {shard_size} ranks of a shard group: a "
            "block of ranks that share an iteration stays inside one replica (one node at "
            "best); pass a divisor of the shard size, such as the GPUs per node"
        )


def find_hook_boundary(
    model: nn.Module,
    fqn: str,
    hook_boundary_predicate: ModulePredicate | None = None,
) -> str | None:
    """Return the module name of the hook boundary of parameter ``fqn``, or ``None``.

    The boundary is the lowest ancestor module that is either an element of an
    ``nn.ModuleList`` named like `BOUNDARY_CONTAINER_NAMES` or a module for which
    ``hook_boundary_predicate(module)`` is true.
    """
    parts = fqn.split(".")[:-1]
    modules = [model]  # modules[d] is the ancestor at depth d; modules[0] is the model
    for part in parts:
        modules.append(modules[-1].get_submodule(part))
    for depth in range(len(parts), 0, -1):
        name = ".".join(parts[:depth])
        if hook_boundary_predicate is not None and hook_boundary_predicate(modules[depth]):
            return name
        in_list = isinstance(modules[depth - 1], nn.ModuleList)
        if in_list and depth >= 2 and parts[depth - 2] in BOUNDARY_CONTAINER_NAMES:
            return name
    return None


def spread_over_tp(costs: Sequence[int], size: int) -> list[int]:
    """The tp rank that orthogonalizes each of one owner's tp-sharded matrices (their
    Newton-Schulz ``costs`` in dedication order): largest first, each to the least-loaded
    tp rank (ties: the lowest). `assign_workers` and the cluster planner use it."""
    loads = [0] * size
    workers = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        worker = min(range(size), key=lambda r: (loads[r], r))
        workers[index] = worker
        loads[worker] += costs[index]
    return workers
