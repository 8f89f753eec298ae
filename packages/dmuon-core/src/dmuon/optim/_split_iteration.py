"""Newton-Schulz iterations shared by a block of ranks (``dedicate_params(ns_split=g)``).

The rank that steps a split matrix normalizes its update input as a whole iteration
would, then scatters ``g`` slices of its long side (padded with zero columns, which stay
zero and add nothing to the Gram matrix) to its block. Each iteration, every member forms
its slice's share of ``A = X Xᵀ`` (``m x m``, ``m`` the short side), the block all-reduces
it, every member computes ``B = bA + cA·A`` and updates its slice ``X ← aX + BX``; the
stepping rank gathers the slices back. The result is the whole iteration's up to the
order ``A``'s sum is rounded in. Every member issues one scatter, one all-reduce per
iteration and one gather per split matrix (per part of a ``split`` one), in the
dedication's order, whatever the data: a matrix skipped this step, or without a
gradient, is iterated from zeros and its result dropped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dmuon._comm import Communicator
from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.split_iterations import SplitBlock
from dmuon.optim._muon_step import Piece, Workspaces, step_bucket
from dmuon.optim._orthogonalize import CoefficientTriple, NewtonSchulzWorkspace, default_ns_dtype
from dmuon.optim._split import matrix_pieces


def split_newton_schulz(
    x: Tensor | None,
    shape: tuple[int, int],
    triples: Sequence[CoefficientTriple],
    dtype: torch.dtype,
    device: torch.device,
    block: SplitBlock,
    root: int,
    comm: Communicator,
) -> Tensor | None:
    """Iterate one normalized ``rows x cols`` matrix over ``block``.

    ``x`` is the matrix (in the iteration dtype) on the rank at position ``root``, which
    gets the result back; the other members pass ``None`` and get ``None``. The block's
    collectives go through ``comm`` (its audit's split dimension).
    """
    rows, cols = shape
    tall = rows > cols
    m, n = (cols, rows) if tall else (rows, cols)
    size = len(block.ranks)
    width = math.ceil(n / size)
    root_rank = block.ranks[root - block.first]
    chunks = None
    if x is not None:
        padded = torch.zeros((m, size * width), dtype=dtype, device=device)
        padded[:, :n] = x.mT if tall else x
        chunks = list(padded.split(width, dim=1))
        chunks = [chunk.contiguous() for chunk in chunks]
    mine = torch.empty((m, width), dtype=dtype, device=device)
    comm.scatter_block(mine, chunks, root_rank, block.group)
    gram = torch.empty((m, m), dtype=dtype, device=device)
    poly = torch.empty_like(gram)
    other = torch.empty_like(mine)
    for a, b, c in triples:
        torch.mm(mine, mine.mT, out=gram)
        comm.all_reduce_block(gram, block.group)
        torch.addmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.addmm(mine, poly, mine, beta=a, out=other)
        mine, other = other, mine
    slices = [torch.empty_like(mine) for _ in range(size)] if x is not None else None
    comm.gather_block(mine, slices, root_rank, block.group)
    if slices is None:
        return None
    whole = torch.cat(slices, dim=1)[:, :n]
    return whole.mT if tall else whole


def _position(state: DedicationState, dp: DedicatedParam) -> int:
    """The mesh position (replica x shard size + shard rank) of the rank stepping ``dp``."""
    plan = state.plan
    assert plan is not None
    return plan.workers[dp.name] * plan.shard_size + plan.owners[dp.name]


def share_split_iterations(
    group: dict[str, Any],
    triples: list[CoefficientTriple],
    deferred: Mapping[str, list[tuple[tuple[Any, ...], Piece]]],
    state: DedicationState,
    dedicated: Mapping[int, DedicatedParam],
    split_sizes: Mapping[str, tuple[int, ...]],
    workspaces: Workspaces,
    max_workspace_bytes: int,
) -> None:
    """Run this rank's block's split iterations of one Muon group, in the dedication's
    order: the matrices this rank steps (``deferred`` by `apply_muon_update`, each piece
    with its bucket key) are updated as a bucket of one would be; for the others this
    rank iterates its slice."""
    block, plan = state.split_block, state.plan
    if block is None or plan is None:
        return
    members = range(block.first, block.first + len(block.ranks))
    comm = state.runtime.comm
    device = comm.device
    dtype = group["ns_dtype"] or default_ns_dtype(device)
    for p in group["params"]:
        dp = dedicated.get(id(p))
        if dp is None or dp.name not in plan.split:
            continue
        root = _position(state, dp)
        if root not in members:
            continue
        if dp.name in deferred:
            iterate = functools.partial(
                _iterate_source,
                triples=triples,
                eps=group["eps"],
                dtype=dtype,
                block=block,
                root=root,
                comm=comm,
            )
            for key, piece in deferred[dp.name]:
                step_bucket(group, triples, key, [piece], workspaces, max_workspace_bytes, iterate)
            continue
        sizes = split_sizes.get(dp.fqn)
        meta = torch.empty(dp.shape, device="meta")
        for piece in matrix_pieces(meta, dp.transposed, sizes):
            rows, cols = piece.shape
            # The stepping rank without this matrix's update this step iterates zeros.
            x = torch.zeros((rows, cols), dtype=dtype, device=device) if dp.updates_here else None
            split_newton_schulz(x, (rows, cols), triples, dtype, device, block, root, comm)


def _iterate_source(
    ws: NewtonSchulzWorkspace,
    triples: Sequence[CoefficientTriple],
    eps: float,
    dtype: torch.dtype,
    block: SplitBlock,
    root: int,
    comm: Communicator,
) -> Tensor:
    """A workspace's one matrix, normalized as `NewtonSchulzWorkspace.run` normalizes it,
    iterated over the block: ``(1, rows, cols)`` in the iteration dtype."""
    ws.normalize_source(eps)
    x = ws.source[0].to(dtype)
    shape = (x.shape[0], x.shape[1])
    result = split_newton_schulz(x, shape, triples, dtype, x.device, block, root, comm)
    assert result is not None
    return result.unsqueeze(0)
