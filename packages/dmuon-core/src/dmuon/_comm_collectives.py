"""Two pieces of `dmuon._comm.Communicator` that stand on their own: the all-gather of
uneven pieces as each backend can run it, and the check that every rank is about to
issue the same collective (``check_collectives``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dmuon._comm_pending import adjacent, joined, scatter_into

#: The collectives a signature names, as numbers every rank exchanges.
KIND_CODES = {
    "broadcast": 1,
    "reduce": 2,
    "all_gather": 3,
    "reduce_scatter": 4,
    "all_reduce": 5,
    "scatter": 6,
    "gather": 7,
}


def check_signatures(
    signature: tuple[int, str, int, int], group: dist.ProcessGroup, device: torch.device
) -> None:
    """All-gather this rank's ``(sequence number, kind, elements, root)`` over ``group``
    and raise on every rank if the ranks disagree."""
    sequence, kind, numel, root = signature
    size = dist.get_world_size(group)
    mine = torch.tensor([sequence, KIND_CODES[kind], numel, root], dtype=torch.int64, device=device)
    every = torch.empty(size * 4, dtype=torch.int64, device=device)
    dist.all_gather_single(every, mine, group=group)
    rows = every.view(size, 4).tolist()
    if any(row != rows[0] for row in rows):
        names = {code: name for name, code in KIND_CODES.items()}
        lines = "; ".join(
            f"rank {r}: #{seq} {names.get(code, code)} of {n} elements, root {at}"
            for r, (seq, code, n, at) in enumerate(rows)
        )
        raise RuntimeError(
            "DMuon's ranks are about to issue different collectives (" + lines + "). "
            "Something rank-local changed the schedule: make every rank run the same "
            "forwards and backwards (same hook boundaries, same no_sync blocks)."
        )


def uneven_all_gather(
    pieces: Sequence[Sequence[torch.Tensor]],
    sizes: list[int],
    me: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, Callable[[], dist.Work | None], Callable[[], None]]:
    """``(what this rank sends, the call to issue, what to do once it completed)`` of an
    all-gather in which rank ``r`` sends ``pieces[r]`` (``sizes[r]`` elements): NCCL's
    all-gather of uneven tensors (one group of broadcasts), or on gloo, which has none,
    one all-to-all that moves the same elements."""
    like = next(part[0] for part, n in zip(pieces, sizes, strict=True) if n)
    if dist.get_backend(group) == "gloo":
        mine = joined(pieces[me], True, like)
        send = mine.expand(len(pieces), -1).reshape(-1)
        # Pieces that lie back to back in rank order (a boundary without split stacks)
        # receive in place; others through a buffer.
        received = adjacent(pieces)
        fills = []
        if received is None:
            received = torch.empty(sum(sizes), dtype=like.dtype, device=like.device)
            starts = [sum(sizes[:r]) for r in range(len(pieces))]
            fills = [(received[starts[r] :], part) for r, part in enumerate(pieces) if r != me]

        def call() -> dist.Work | None:
            return dist.all_to_all_single(
                received,
                send,
                output_split_sizes=sizes,
                input_split_sizes=[sizes[me]] * len(pieces),
                group=group,
                async_op=True,
            )

    else:
        outputs = [joined(part, r == me, like) for r, part in enumerate(pieces)]
        fills = [(outputs[r], part) for r, part in enumerate(pieces) if r != me and len(part) > 1]
        send = outputs[me]

        def call() -> dist.Work | None:
            return dist.all_gather(outputs, send, group=group, async_op=True)

    def then() -> None:
        for source, part in fills:
            scatter_into(source, part)

    return send, call, then
