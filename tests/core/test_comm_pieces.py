"""One collective call per hook boundary and direction, whatever the number of owners.

`Communicator.all_gather_pieces` and `reduce_scatter_pieces` move each rank's pieces (any
number, any sizes, none) in one call; the oracle is the values themselves (every rank ends
with every sender's pieces, or the sum of every rank's pieces) and the count of
``torch.distributed`` calls made, counted apart from the audit. The updated values of an
HSDP step travel in chunks (`update_chunks`): cut small, they still train exactly as one
process does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import Scenario, count_collectives, reference_run, run_scenario, spawn_ranks

from dmuon._ownership.replica_updates import update_chunks

#: Pieces per rank of 3: two of rank 0 (3 and 2 elements), none of rank 1, one of rank 2.
SIZES = [[3, 2], [], [4]]


def _values(rank: int, sizes: list[int], scale: float, device: str = "cpu") -> list[torch.Tensor]:
    start = 100.0 * rank
    out = []
    for size in sizes:
        out.append(scale * (torch.arange(size, dtype=torch.float32, device=device) + start))
        start += size
    return out


def _exchange(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    import torch.distributed as dist

    from dmuon._comm import Communicator
    from dmuon._comm_audit import CommAudit

    comm = Communicator(dist.group.WORLD, torch.device(device), CommAudit(1))
    results: dict[str, Any] = {}

    def filled(value: float, sizes: list[int]) -> list[torch.Tensor]:
        return [torch.full((n,), value, device=device) for n in sizes]

    with count_collectives() as issued:
        # Several senders: rank r's pieces hold its values, the others' are overwritten.
        pieces = [
            _values(r, sizes, 1.0, device) if r == rank else filled(-1.0, sizes)
            for r, sizes in enumerate(SIZES)
        ]
        comm.all_gather_pieces(pieces, ", test").wait()
        results["gathered"] = [[p.tolist() for p in part] for part in pieces]
        # One sender (rank 0, two pieces): a broadcast.
        lone = [
            _values(0, SIZES[0], 1.0, device) if rank == 0 else filled(0.0, SIZES[0]),
            [],
            [],
        ]
        comm.all_gather_pieces(lone, ", test").wait()
        results["broadcast"] = [p.tolist() for p in lone[0]]
        # Sums: every rank contributes (rank + 1) x the destination's values.
        pending, mine = comm.reduce_scatter_pieces(
            [_values(r, sizes, rank + 1.0, device) for r, sizes in enumerate(SIZES)], ", test"
        )
        pending.wait()
        results["summed"] = None if mine is None else mine.tolist()
        # One receiver (rank 2): a reduce, in place.
        pending, mine = comm.reduce_scatter_pieces(
            [[], [], _values(2, SIZES[2], rank + 1.0, device)], ", test"
        )
        pending.wait()
        results["reduced"] = None if mine is None else mine.tolist()
    results["issued"] = [kind for kind, _ in issued]
    results["audit"] = {k: t.count for k, t in comm.audit.current.by_kind.items()}
    return results


def test_pieces_travel_in_one_call_each() -> None:
    _check_exchange(spawn_ranks(3, _exchange), "all_to_all_single")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs with NCCL")
def test_pieces_travel_in_one_call_each_over_nccl() -> None:
    """NCCL's uneven all-gather and reduce-scatter (each one group of broadcasts or
    reduces inside torch)."""
    _check_exchange(spawn_ranks(3, _exchange, "cuda", device_type="cuda"), "all_gather")


def _check_exchange(per_rank: list[dict[str, Any]], gathered_by: str) -> None:
    expected = [[p.tolist() for p in _values(r, sizes, 1.0)] for r, sizes in enumerate(SIZES)]
    sums = [torch.cat(_values(r, sizes, 6.0)).tolist() if sizes else None
            for r, sizes in enumerate(SIZES)]  # fmt: skip
    for rank, result in enumerate(per_rank):
        assert result["gathered"] == expected, rank
        assert result["broadcast"] == expected[0], rank
        assert result["summed"] == sums[rank], rank
        assert result["reduced"] == (sums[2] if rank == 2 else None), rank
        # gloo has no uneven all-gather: one all-to-all stands for it there.
        assert result["issued"] == [gathered_by, "broadcast", "reduce_scatter", "reduce"]
        assert result["audit"] == {
            "all_gather": 1,
            "broadcast": 1,
            "reduce_scatter": 1,
            "reduce": 1,
        }


def test_update_chunks_cut_in_dedication_order_by_size() -> None:
    """Chunks follow dedication (forward) order, so the next forward's first boundaries
    wait for the first chunks only."""
    records = [(5, 1), (3, 0), (4, 1), (2, 0), (10, 0)]
    assert update_chunks(records, 2, cap=8) == [
        [[1], [0]],  # 5 + 3
        [[3], [2]],  # 4 + 2
        [[4], []],  # larger than the cap: alone
    ]
    assert update_chunks(records, 2) == [[[1, 3, 4], [0, 2]]]  # 256 MiB holds them all
    assert update_chunks([], 2) == []


def _chunked(rank: int, world: int, scenario: Scenario) -> dict[str, Any]:
    from dmuon._ownership import replica_updates

    replica_updates.CHUNK_BYTES = 1  # every matrix a chunk of its own
    return run_scenario(scenario, rank, world)


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_updates_in_small_chunks_train_exactly(mode: str) -> None:
    scenario = Scenario(f"hsdp-chunks-{mode}", mode=mode, steps=2, mesh_shape=(2, 2))
    per_rank = spawn_ranks(4, _chunked, scenario)
    reference = reference_run(scenario, 4)
    for rank, result in enumerate(per_rank):
        worst = max((result["params"][n] - p).abs().max().item() for n, p in reference.items())
        assert worst <= 1e-5, f"rank {rank}: {worst:.2e}"
        owned = sum(1 for owner in result["owners"].values() if owner == rank % 2)
        for step in result["comm"]:
            shared = step["dimensions"]["replicate"]["collectives"]
            calls = sum(shared[k]["count"] for k in ("broadcast", "all_gather") if k in shared)
            assert calls == owned  # one call per matrix this rank's shard position owns
