"""Muon's step for matrices that tensor parallelism splits: gather, orthogonalize, scatter.

The owners of a tp-sharded matrix (the same data-parallel rank in every tp position) each
hold one shard of its momentum and gradient. Momentum, Nesterov and weight decay act on the
shards as they are; Newton-Schulz needs the whole matrix, so each owner sends its shard of
the Nesterov input to the matrix's worker (``dist.gather`` over the tp group), which
orthogonalizes the whole matrix (split into its parts when ``split`` asks, each scaled by
its own learning-rate adjustment) and sends each owner its shard of the scaled update back
(``dist.scatter``). Every owner then applies ``W -= lr * update``. Shards of different
lengths (a dimension that does not divide by the tp size) travel padded to the longest.

Every rank of a tp group owns the same matrices, in the same order, so the collectives
match; which of them are stepped is agreed on first (`agree`), from norms summed over the
group, so a NaN in one shard stops the matrix on every tp rank alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon._comm import Communicator
from dmuon._comm_audit import TENSOR
from dmuon._ownership.param import DedicatedParam
from dmuon.optim._orthogonalize import (
    CoefficientTriple,
    _newton_schulz_unchecked,
    default_ns_dtype,
)
from dmuon.optim._split import matrix_pieces

__all__ = ["agree", "tp_updates"]


def _group(records: Sequence[DedicatedParam]) -> dist.ProcessGroup:
    tp = records[0].tp
    assert tp is not None
    return tp.group


def agree(
    records: Sequence[DedicatedParam], norms: Tensor, firsts: Tensor, comm: Communicator
) -> None:
    """Make per-shard norms and first elements the whole matrices', on every tp rank.

    ``norms`` (2-norms) and ``firsts`` hold one entry per record and are rewritten in
    place: the norms summed over the shards, and a first element of ``-0.0`` where every
    shard is absent (`dmuon._ownership.gradients.is_absent`), ``1.0`` elsewhere. One
    all-reduce over the tp group.
    """
    if not records:
        return
    shard_present = ((norms != 0) | ~firsts.signbit()).float()
    packed = torch.cat([norms.square(), shard_present])
    comm.all_reduce_control(packed, dist.ReduceOp.SUM, _group(records), sequence=TENSOR)
    count = len(records)
    norms.copy_(packed[:count].sqrt())
    present = packed[count:] > 0
    firsts.copy_(torch.where(present, torch.ones_like(firsts), torch.full_like(firsts, -0.0)))


def _padded(local: Tensor, dim: int, length: int) -> Tensor:
    if local.shape[dim] == length:
        return local.contiguous()
    shape = list(local.shape)
    shape[dim] = length
    padded = torch.zeros(shape, dtype=local.dtype, device=local.device)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    return padded


def tp_updates(
    records: Sequence[DedicatedParam],
    sources: Sequence[Tensor],
    group: dict[str, Any],
    triples: Sequence[CoefficientTriple],
    split_sizes: dict[str, tuple[int, ...]],
    adjust: Callable[[str | None, int, int], float],
    comm: Communicator,
) -> list[Tensor]:
    """Each record's local shard of its scaled, orthogonalized update.

    ``sources`` are the local shards of the Nesterov inputs (float32), one per record.
    """
    if not records:
        return []
    tp_group = _group(records)
    gathered = _gather_to_workers(records, sources, comm, tp_group)
    updates = _orthogonalize_whole(records, gathered, group, triples, split_sizes, adjust)
    return _scatter_from_workers(records, sources, updates, comm, tp_group)


def _gather_to_workers(
    records: Sequence[DedicatedParam],
    sources: Sequence[Tensor],
    comm: Communicator,
    tp_group: dist.ProcessGroup,
) -> list[list[Tensor] | None]:
    """Each record's shards, on the rank that steps it (None on the others)."""
    rank = dist.get_rank(tp_group)
    gathered: list[list[Tensor] | None] = []
    works = []
    for record, source in zip(records, sources, strict=True):
        tp = record.tp
        assert tp is not None and tp.shard_dim is not None
        padded = _padded(source, tp.shard_dim, tp.padded)
        chunks = [torch.empty_like(padded) for _ in range(tp.size)] if rank == tp.worker else None
        works.append(
            comm.gather_tensor_parallel(
                padded, chunks, tp.worker, tp_group, record.global_shape.numel()
            )
        )
        gathered.append(chunks)
    for work in works:
        work.wait()
    return gathered


def _orthogonalize_whole(
    records: Sequence[DedicatedParam],
    gathered: list[list[Tensor] | None],
    group: dict[str, Any],
    triples: Sequence[CoefficientTriple],
    split_sizes: dict[str, tuple[int, ...]],
    adjust: Callable[[str | None, int, int], float],
) -> dict[int, Tensor]:
    """The scaled update of each matrix this rank steps, whole, by record index; its parts
    are orthogonalized in batches of one shape."""
    updates: dict[int, Tensor] = {}
    by_shape: dict[tuple[Any, ...], list[tuple[Tensor, Tensor, float]]] = {}
    for index, (record, chunks) in enumerate(zip(records, gathered, strict=True)):
        if chunks is None:
            continue
        tp = record.tp
        assert tp is not None and tp.shard_dim is not None
        dim = tp.shard_dim
        pieces = []
        for position, chunk in enumerate(chunks):
            start, stop = tp.bounds(position)
            pieces.append(chunk.narrow(dim, 0, stop - start))
        full = torch.cat(pieces, dim=dim)
        update = torch.empty_like(full)
        updates[index] = update
        sizes = split_sizes.get(record.fqn)
        for source, target in zip(
            matrix_pieces(full, record.transposed, sizes),
            matrix_pieces(update, record.transposed, sizes),
            strict=True,
        ):
            rows, cols = source.shape
            out_in = (cols, rows) if record.transposed else (rows, cols)
            scale = adjust(group["adjust_lr_fn"], *out_in)
            by_shape.setdefault((tuple(source.shape), source.device), []).append(
                (source, target, scale)
            )
    for (_, device), members in by_shape.items():
        dtype = group["ns_dtype"] or default_ns_dtype(device)
        ortho = _newton_schulz_unchecked(
            torch.stack([source for source, _, _ in members]), triples, dtype, group["eps"]
        )
        for (_, target, scale), result in zip(members, ortho.unbind(0), strict=True):
            target.copy_(result).mul_(scale)
    return updates


def _scatter_from_workers(
    records: Sequence[DedicatedParam],
    sources: Sequence[Tensor],
    updates: dict[int, Tensor],
    comm: Communicator,
    tp_group: dist.ProcessGroup,
) -> list[Tensor]:
    """Each owner's shard of its record's update, sent back from the rank that stepped it."""
    locals_: list[Tensor] = []
    works = []
    for index, (record, source) in enumerate(zip(records, sources, strict=True)):
        tp = record.tp
        assert tp is not None and tp.shard_dim is not None
        dim = tp.shard_dim
        out = _padded(torch.empty_like(source), dim, tp.padded)
        parts = None
        if index in updates:
            parts = []
            for position in range(tp.size):
                start, stop = tp.bounds(position)
                parts.append(
                    _padded(updates[index].narrow(dim, start, stop - start), dim, tp.padded)
                )
        works.append(
            comm.scatter_tensor_parallel(
                out, parts, tp.worker, tp_group, record.global_shape.numel()
            )
        )
        locals_.append(out.narrow(dim, 0, source.shape[dim]))
    for work in works:
        work.wait()
    return locals_
