"""Which parameters are dedicated, where their hook boundaries are, and who owns them.

Everything here is pure: no process group, no hooks. `plan_owners` can be called for any
world size to see what a run would do before launching it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

#: Attribute names of ``nn.ModuleList`` containers whose elements are hook boundaries
#: (Llama ``layers``, ViT ``blocks``, GPT-2 ``h``).
BOUNDARY_CONTAINER_NAMES: tuple[str, ...] = ("layers", "blocks", "h")

#: Module names that mark an output head or an embedding; never dedicated by default.
_EXCLUDED_NAME_PARTS: tuple[str, ...] = ("lm_head", "output", "embed", "wte", "wpe", "norm")

ParamPredicate = Callable[[str, nn.Parameter], bool]
ModulePredicate = Callable[[nn.Module], bool]


def default_predicate(name: str, param: nn.Parameter) -> bool:
    """Select 2-D ``weight`` matrices that are not embeddings, norms or output heads.

    ``dedicate_params`` applies this predicate only to parameters owned by ``nn.Linear``
    modules and skips parameters tied to another name, so together they select the hidden
    linear layers of a transformer (attention projections and MLP matrices) and leave the
    embedding, the ``lm_head``/``output`` head, norms and biases to AdamW. Besides, it
    selects the fused 3-D expert stacks of mixture-of-experts layers by their layout (see
    `dmuon.ownership.experts`), and leaves routers and the gates next to them to AdamW.

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
    """Approximate Newton-Schulz cost: ``min(m, n)**2 * max(m, n)`` per ``m x n`` matrix.

    A 3-D shape ``(k, m, n)`` is a stack of ``k`` matrices and costs ``k`` times as much.
    """
    count = int(shape[0]) if len(shape) == 3 else 1
    m, n = int(shape[-2]), int(shape[-1])
    return count * min(m, n) ** 2 * max(m, n)


@dataclass(frozen=True)
class OwnerPlan:
    """The result of `plan_owners`.

    Attributes:
        owners: ``{fqn: owner_rank}`` in the order the parameters were given.
        loads: Newton-Schulz cost assigned to each rank.
        imbalance: ``max(loads) / mean(loads)``; 1.0 is perfect balance.
    """

    owners: dict[str, int]
    loads: tuple[int, ...]
    imbalance: float


def plan_owners(
    shapes: Mapping[str, Sequence[int]],
    world_size: int,
    boundaries: Mapping[str, str] | None = None,
) -> OwnerPlan:
    """Assign every matrix to exactly one rank, balancing Newton-Schulz cost.

    Longest-processing-time first: matrices are taken in decreasing cost and each goes to
    a least-loaded rank. Among ranks whose load is within one matrix of the least loaded,
    the rank that owns the fewest matrices of the same hook boundary wins, so one layer's
    broadcasts come from several ranks. Ties break on input order and rank, so the plan is
    deterministic and identical on every rank.

    A 3-D stack of matrices (fused experts) is one item with one owner, its cost the sum
    of its matrices' costs; stacks are not split across ranks.

    Args:
        shapes: ``{fqn: (rows, cols)}`` of the dedicated matrices, or ``(matrices, rows,
            cols)`` of dedicated stacks.
        world_size: Number of ranks (at least 1).
        boundaries: Optional ``{fqn: boundary_name}``; matrices of one boundary are spread.

    Returns:
        The `OwnerPlan`.

    Raises:
        ValueError: If ``world_size < 1`` or a shape is neither 2-D nor 3-D.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    for fqn, shape in shapes.items():
        if len(shape) not in (2, 3):
            raise ValueError(
                f"plan_owners needs 2-D matrix or 3-D stack shapes; {fqn!r} has shape "
                f"{tuple(shape)}"
            )
    boundaries = boundaries or {}
    order = {fqn: index for index, fqn in enumerate(shapes)}
    costs = {fqn: newton_schulz_cost(shape) for fqn, shape in shapes.items()}
    loads = [0] * world_size
    per_boundary: dict[tuple[str, int], int] = {}
    assigned: dict[str, int] = {}
    for fqn in sorted(shapes, key=lambda f: (-costs[f], order[f])):
        cost = costs[fqn]
        boundary = boundaries.get(fqn, "")
        lightest = min(loads)
        eligible = [rank for rank in range(world_size) if loads[rank] <= lightest + cost]
        rank = min(
            eligible,
            key=lambda r: (per_boundary.get((boundary, r), 0), loads[r], r),
        )
        assigned[fqn] = rank
        loads[rank] += cost
        per_boundary[(boundary, rank)] = per_boundary.get((boundary, rank), 0) + 1
    mean = sum(loads) / world_size
    imbalance = max(loads) / mean if mean > 0 else 1.0
    return OwnerPlan(
        owners={fqn: assigned[fqn] for fqn in shapes}, loads=tuple(loads), imbalance=imbalance
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
