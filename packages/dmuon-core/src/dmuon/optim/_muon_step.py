"""The Muon update of one param group's owned matrices, given their averaged gradients.

Momentum and decoupled weight decay with ``torch._foreach_*`` kernels; then each bucket
of same-shape matrices (stacks contribute each matrix, ``split`` parameters each part) is
orthogonalized in batches that fit `dmuon.Muon`'s ``max_workspace_bytes``, in buffers kept
from step to step (`Workspaces`); NorMuon normalizes the result per output neuron; the
update is added with each shape's learning-rate adjustment. Matrices split by tensor
parallelism are gathered to their workers first (`dmuon.optim._tensor_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from dmuon._comm import Communicator
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.placement import state_to_param
from dmuon._ownership.replica_updates import UpdateSlot
from dmuon._ownership.runtime import DedicationRuntime
from dmuon._ownership.step_arithmetic import (
    add_updates_,
    decay_masters_,
    scale_update_,
    step_scalar,
)
from dmuon.optim._adamw_step import new_adamw_state
from dmuon.optim._blocks import Arena
from dmuon.optim._normuon import SECOND_MOMENT, normalize_rows_, second_moment_shape
from dmuon.optim._orthogonalize import (
    CoefficientTriple,
    NewtonSchulzWorkspace,
    default_ns_dtype,
    iteration_dtype,
    workspace_nbytes,
)
from dmuon.optim._split import matrix_pieces
from dmuon.optim._tensor_parallel import tp_updates
from dmuon.optim._validation import adjust_lr_ratio


class Workspaces:
    """The Newton-Schulz buffers of one optimizer, kept from step to step.

    Every bucket's buffers are carved from one `Arena` per device, from its start: buckets
    run one after the other, so the optimizer holds the largest bucket's workspace, not
    the sum of all of them. When a new bucket needs a larger block, the block is replaced
    and the other buckets' workspaces are made again on it.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], NewtonSchulzWorkspace] = {}
        self._arenas: dict[torch.device, Arena] = {}

    def get(
        self,
        batch: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        gram: bool,
        out_dtype: torch.dtype,
    ) -> NewtonSchulzWorkspace:
        """The workspace of ``batch`` matrices of ``shape``: made on first use, then reused."""
        key = (batch, shape, dtype, device, gram, out_dtype)
        ws = self._cache.get(key)
        if ws is not None:
            return ws
        arena = self._arenas.setdefault(device, Arena(device))
        rows, cols = shape
        needed = workspace_nbytes(batch, rows, cols, dtype, device, gram, out_dtype)
        if needed > arena.nbytes:
            # The workspaces carved from the old block go first, so that the old and the
            # new block are never alive together.
            for stale in [k for k in self._cache if k[3] == device]:
                del self._cache[stale]
            arena.reserve(needed)
        allocate, _ = arena.carver()
        ws = self._cache[key] = NewtonSchulzWorkspace(
            batch, rows, cols, dtype, device, gram=gram, allocate=allocate, out_dtype=out_dtype
        )
        return ws

    def nbytes(self) -> int:
        """Bytes held, over every device."""
        return sum(arena.nbytes for arena in self._arenas.values())


def chunk_size(
    max_workspace_bytes: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    gram: bool,
    out_dtype: torch.dtype,
) -> int:
    """How many matrices of ``shape`` one batched iteration may take within
    ``max_workspace_bytes`` (at least one)."""
    rows, cols = shape
    one = workspace_nbytes(1, rows, cols, dtype, device, gram, out_dtype)
    return max(1, max_workspace_bytes // one)


def apply_muon_update(
    group: dict[str, Any],
    triples: list[CoefficientTriple],
    stepped: list[DedicatedParam],
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    seconds: list[Tensor | None],
    split_sizes: dict[str, tuple[int, ...]],
    workspaces: Workspaces,
    max_workspace_bytes: int,
    comm: Communicator,
    outgoing: Callable[[DedicatedParam], UpdateSlot | None] = lambda dp: None,
    split: frozenset[str] = frozenset(),
) -> dict[str, list[tuple[tuple[Any, ...], Piece]]]:
    """Step ``params`` (the owned masters) with their averaged ``grads``, momentum buffers
    ``bufs`` and NorMuon second moments ``seconds`` (``None`` under Muon), in place.

    Each step is decay, then ``multiplier x update`` added, each rounded once; where
    ``outgoing(dp)`` gives a slot (HSDP), the update and the scalars go there too, for the
    other replicas to apply the same way (`dmuon._ownership.replica_updates`).

    The records named in ``split`` get their momentum and decay here, and their pieces
    (with their bucket keys) are returned by name, for their block to iterate
    (`dmuon.optim._split_iteration`).
    """
    lr = group["lr"]
    foreach_by_dtype(torch._foreach_lerp_, bufs, grads, 1 - group["momentum"])
    decay = 1 - lr * group["weight_decay"] if group["weight_decay"] != 0 else 1.0
    if group["weight_decay"] != 0:
        decay_(params, decay)
    slots = {id(dp): outgoing(dp) for dp in stepped}

    deferred: dict[str, list[tuple[tuple[Any, ...], Piece]]] = {}
    buckets, sharded = _buckets(
        group, decay, stepped, params, grads, bufs, seconds, split_sizes, slots, split, deferred
    )
    for key, bucket in buckets.items():
        step_bucket(group, triples, key, bucket, workspaces, max_workspace_bytes)
    if sharded:
        _tensor_parallel_step(group, triples, sharded, split_sizes, comm)
    return deferred


Piece = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]


def _buckets(
    group: dict[str, Any],
    decay: float,
    stepped: list[DedicatedParam],
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    seconds: list[Tensor | None],
    split_sizes: dict[str, tuple[int, ...]],
    slots: dict[int, UpdateSlot | None],
    split: frozenset[str],
    deferred: dict[str, list[tuple[tuple[Any, ...], Piece]]],
) -> tuple[dict[tuple[Any, ...], list[Piece]], list[tuple[DedicatedParam, Tensor, Tensor, Tensor]]]:
    """Same-shape matrices to orthogonalize together (one batched call per bucket), and
    the tensor-parallel shards stepped apart; writes each outgoing slot's scalars.

    Stacks contribute each of their matrices, split parameters each of their parts (views,
    not copies). A (in, out) layout (Conv1D) gets its own bucket: its learning-rate
    adjustment reads the shape the other way. NorMuon's second moments are (out, 1) per
    matrix: a split part's is a row range. The pieces of the records named in ``split``
    go to ``deferred`` instead, by name, each with its bucket key.
    """
    buckets: dict[tuple[Any, ...], list[Piece]] = {}
    sharded: list[tuple[DedicatedParam, Tensor, Tensor, Tensor]] = []
    for dp, p, g, b, s in zip(stepped, params, grads, bufs, seconds, strict=True):
        if dp.tp_sharded:
            sharded.append((dp, p, g, b))
            continue
        sizes = split_sizes.get(dp.fqn)
        slot = slots[id(dp)]
        if slot is not None:
            _write_scalars(slot, group, decay, sizes)
        pieces = zip(
            matrix_pieces(g, dp.transposed, sizes),
            matrix_pieces(b, dp.transposed, sizes),
            matrix_pieces(p, dp.transposed, sizes),
            matrix_pieces(s, False, sizes) if s is not None else _nones(g, sizes),
            matrix_pieces(slot.update, dp.transposed, sizes) if slot else _nones(g, sizes),
            strict=True,
        )
        for piece in pieces:
            g_piece = piece[0]
            key = (tuple(g_piece.shape), g_piece.dtype, g_piece.device, dp.transposed)
            if dp.name in split:
                deferred.setdefault(dp.name, []).append((key, piece))
            else:
                buckets.setdefault(key, []).append(piece)
    return buckets, sharded


def step_bucket(
    group: dict[str, Any],
    triples: list[CoefficientTriple],
    key: tuple[Any, ...],
    bucket: list[Piece],
    workspaces: Workspaces,
    max_workspace_bytes: int,
    orthogonalize: Callable[[NewtonSchulzWorkspace], Tensor] | None = None,
) -> None:
    """Orthogonalize one bucket's updates, chunk by chunk, in buffers kept from step to
    step, and add them to its matrices (sending each to the other replicas first).

    ``orthogonalize(workspace)`` replaces the workspace's own iteration (``run``): it
    gets the update inputs in ``source`` and returns ``(batch, rows, cols)`` in the
    iteration dtype.
    """
    shape, _, device, is_transposed = key
    momentum = group["momentum"]
    ns_dtype = group["ns_dtype"] or default_ns_dtype(device)
    gram = group.get("ns_gram", False)
    out_dtype = bucket[0][2].dtype
    size = chunk_size(max_workspace_bytes, shape, ns_dtype, device, gram, out_dtype)
    for first in range(0, len(bucket), size):
        members = bucket[first : first + size]
        ws = workspaces.get(len(members), shape, ns_dtype, device, gram, out_dtype)
        views = ws.source_views
        bucket_grads = [g for g, _, _, _, _ in members]
        bucket_bufs = [b for _, b, _, _, _ in members]
        # Straight into the buffers, widened there when the gradients are 16-bit.
        if group["nesterov"]:  # U = lerp(G, buf, momentum), one pass per matrix
            for v, g, b in zip(views, bucket_grads, bucket_bufs, strict=True):
                torch.lerp(g, b, momentum, out=v)
        else:
            torch._foreach_copy_(views, bucket_bufs)
        bucket_params = [p for _, _, p, _, _ in members]
        # Added in the weights' dtype; a bfloat16 result is widened once into a buffer
        # (adding it directly would allocate a widened temporary per matrix).
        result = ws.run(triples, group["eps"]) if orthogonalize is None else orthogonalize(ws)
        ortho = ws.cast(result, bucket_params[0].dtype)
        if group["variant"] == "normuon":
            bucket_seconds = [s for _, _, _, s, _ in members]
            ortho = normalize_rows_(ortho, bucket_seconds, group["beta2"], is_transposed)  # type: ignore[arg-type]
            result = ortho
        _send([u for _, _, _, _, u in members], result)
        rows, cols = (shape[1], shape[0]) if is_transposed else shape
        # Scaled, then added: two roundings another replica repeats exactly.
        multiplier = step_scalar(_multiplier(group, rows, cols), ortho.dtype, ortho.device)
        scale_update_(ortho, multiplier)
        add_updates_(bucket_params, list(ortho.unbind(0)))


"""A matrix Muon orthogonalizes: gradient, momentum, master, NorMuon second moment and
where its update goes to the other replicas (each a view of its record's)."""


def _multiplier(group: dict[str, Any], rows: int, cols: int) -> float:
    """What a ``rows x cols`` (out x in) matrix's orthogonalized update is multiplied by."""
    return -(group["lr"] * adjust_lr_ratio(group["adjust_lr_fn"], rows, cols))


def _write_scalars(
    slot: UpdateSlot, group: dict[str, Any], decay: float, sizes: tuple[int, ...] | None
) -> None:
    """The decay and the multiplier of each output row (each part's, for a split matrix)
    into ``slot``'s header, in its dtype, as the kernels round them."""
    dp = slot.dp
    out, cols = dp.out_in_shape
    parts = sizes or (out,)
    multipliers = [_multiplier(group, size, cols) for size in parts]
    per_part = torch.tensor(multipliers, dtype=slot.header.dtype)
    rows = torch.repeat_interleave(per_part, torch.tensor(parts))
    slot.decay.fill_(decay)
    slot.multipliers.copy_(rows)


def _send(destinations: list[Tensor | None], result: Tensor) -> None:
    """Copy each matrix of ``result`` (what the iteration or NorMuon returned, before any
    widening) into its destination, where it has one."""
    pairs = [(d, r) for d, r in zip(destinations, result.unbind(0), strict=True) if d is not None]
    if not pairs:
        return
    if pairs[0][0].dtype != result.dtype:
        raise RuntimeError(
            f"internal: an update of dtype {result.dtype} was to travel as {pairs[0][0].dtype}"
        )
    torch._foreach_copy_([d for d, _ in pairs], [r for _, r in pairs])


def _tensor_parallel_step(
    group: dict[str, Any],
    triples: list[Any],
    members: list[tuple[DedicatedParam, Tensor, Tensor, Tensor]],
    split_sizes: dict[str, tuple[int, ...]],
    comm: Communicator,
) -> None:
    """Matrices split by tensor parallelism: gathered to their workers, orthogonalized
    there, their updates scattered back (see `dmuon.optim._tensor_parallel`)."""
    momentum = group["momentum"]
    sources = [
        torch.lerp(g, b, momentum).float() if group["nesterov"] else b.float().clone()
        for _, _, g, b in members
    ]
    updates = tp_updates(
        [dp for dp, _, _, _ in members],
        sources,
        group,
        triples,
        split_sizes,
        adjust_lr_ratio,
        comm,
    )
    for (_, p, _, _), update in zip(members, updates, strict=True):
        p.add_(update.to(p.dtype), alpha=-group["lr"])


def update_dtypes(
    param_groups: list[dict[str, Any]], dedicated: dict[int, DedicatedParam]
) -> Callable[[DedicatedParam], torch.dtype]:
    """The dtype each matrix's update travels in to the other replicas (HSDP): the
    iteration's, or the weights' for NorMuon (it normalizes there); the same on every
    rank."""
    dtypes: dict[str, torch.dtype] = {}
    for group in param_groups:
        if group["algorithm"] != "muon":
            continue
        for p in group["params"]:
            dp = dedicated.get(id(p))
            if dp is None:
                continue
            if group["variant"] == "normuon" or dp.tp_sharded:
                dtypes[dp.fqn] = p.dtype
            else:
                asked = group["ns_dtype"] or default_ns_dtype(p.device)
                rows, cols = dp.out_in_shape
                dtypes[dp.fqn] = iteration_dtype(rows, cols, group.get("ns_gram", False), asked)
    return lambda dp: dtypes.get(dp.fqn, dp.param.dtype)


def owned_gradients(
    params: list[Tensor], dedicated: dict[int, DedicatedParam], runtime: DedicationRuntime
) -> list[tuple[DedicatedParam, Tensor]]:
    """The matrices of a Muon group this rank steps, with their averaged gradients (those
    no rank had a gradient for are left out, as torch leaves a ``None`` ``.grad``)."""
    pairs: list[tuple[DedicatedParam, Tensor]] = []
    for p in params:
        dp = dedicated.get(id(p))
        if dp is None:
            raise ValueError(
                "a parameter in the Muon group is not dedicated; only parameters "
                "dedicated by dmuon.dedicate_params can be stepped with Muon"
            )
        if not dp.updates_here:
            continue
        grad = runtime.reduced_grad(dp)
        if grad is None:
            continue
        if grad.shape != p.shape or grad.dim() not in (2, 3):
            raise ValueError(
                f"the reduced gradient of {dp.fqn!r} has shape {tuple(grad.shape)}, "
                f"expected the full tensor {tuple(p.shape)}"
            )
        pairs.append((dp, grad))
    return pairs


def step_inputs(
    kept: list[tuple[DedicatedParam, Tensor]],
    states: Mapping[Tensor, dict[str, Any]],
    normuon: bool,
) -> tuple[list[DedicatedParam], list[Tensor], list[Tensor], list[Tensor], list[Tensor | None]]:
    """What `apply_muon_update` takes for the matrices to step (``kept``: each with its
    averaged gradient): the records, masters, gradients, momentum buffers and NorMuon
    second moments, the state made as zeros where it is missing."""
    stepped, params, grads, bufs = [], [], [], []
    seconds: list[Tensor | None] = []
    for dp, grad in kept:
        state = states[dp.param]
        state_to_param(state, dp.param)  # made before the model moved
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        if normuon and SECOND_MOMENT not in state:
            state[SECOND_MOMENT] = zero_second_moment(dp)
        stepped.append(dp)
        params.append(dp.param)
        grads.append(grad)
        bufs.append(state["momentum_buffer"])
        seconds.append(state[SECOND_MOMENT] if normuon else None)
    return stepped, params, grads, bufs, seconds


def zero_second_moment(dp: DedicatedParam) -> Tensor:
    """NorMuon's second moment of ``dp`` at its start: zeros of ``(*lead, out, 1)``, float32
    (float64 for float64 weights)."""
    shape = second_moment_shape(dp.shape, dp.transposed)
    dtype = torch.promote_types(dp.param.dtype, torch.float32)
    return torch.zeros(shape, dtype=dtype, device=dp.param.device)


def _nones(tensor: Tensor, sizes: tuple[int, ...] | None) -> list[None]:
    """One ``None`` per piece `matrix_pieces` cuts ``tensor`` into."""
    return [None] * (tensor.shape[0] if tensor.dim() == 3 else 1) * (len(sizes) if sizes else 1)


def decay_(params: list[Tensor], decay: float) -> None:
    """Multiply ``params`` by ``decay`` in place, through the function another replica
    applies its header's decay with (`dmuon._ownership.step_arithmetic`)."""
    factors: dict[tuple[torch.dtype, torch.device], Tensor] = {}
    for p in params:
        key = (p.dtype, p.device)
        if key not in factors:
            factors[key] = step_scalar(decay, p.dtype, p.device)
        decay_masters_([p], factors[key])


def foreach_by_dtype(op: Callable[..., Any], first: list[Tensor], *rest: Any) -> None:
    """Apply an in-place ``torch._foreach_*_`` op, one call per (dtype, device) of ``first``.

    The foreach kernels take one dtype per list, and model weights may mix dtypes.
    """
    lists = [first] + [r for r in rest if isinstance(r, list)]
    scalars = [r for r in rest if not isinstance(r, list)]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(first):
        groups.setdefault((t.dtype, t.device), []).append(i)
    if len(groups) == 1:
        op(*lists, *scalars)
        return
    for idx in groups.values():
        op(*[[lst[i] for i in idx] for lst in lists], *scalars)


def init_missing_state(
    states: dict[Tensor, dict[str, Any]],
    param_groups: list[dict[str, Any]],
    dedicated: dict[int, DedicatedParam],
) -> None:
    """Create every missing optimizer state as zeros, as the first step would: Muon
    momentum (and NorMuon's second moment) of the matrices this rank steps, AdamW's
    state of every trainable parameter of the AdamW groups."""
    for group in param_groups:
        for p in group["params"]:
            state = states[p]
            if group["algorithm"] == "muon":
                dp = dedicated.get(id(p))
                if dp is not None and dp.updates_here and "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                if (
                    dp is not None
                    and dp.updates_here
                    and group["variant"] == "normuon"
                    and SECOND_MOMENT not in state
                ):
                    state[SECOND_MOMENT] = zero_second_moment(dp)
            elif p.requires_grad and len(state) == 0:
                state.update(new_adamw_state(p))
            if not state:
                del states[p]
