"""Moving a dedicated tensor between its owner and the layouts of a state dict.

A dedicated matrix (and its Muon momentum) lives whole on its owner. In a state dict it
takes one of three forms:

- **sharded** (the default): a DTensor ``Shard(0)`` over the dedication's mesh, row chunks
  of ``ceil(rows / N)`` as ``torch.chunk`` cuts them; on a 2-D (HSDP) mesh
  ``(Replicate(), Shard(0))``, the same chunks in every replica. That is the layout FSDP2
  gives the same parameter, so DCP saves it from every rank at once, reshards it on load
  (also between 1-D and 2-D meshes), and a checkpoint of a dedicated model is
  interchangeable with one of a plain FSDP2 model. With a single rank per shard group it
  is the plain tensor.
- **full on rank 0** (``full_state_dict=True, cpu_offload=True``): a CPU tensor on rank 0,
  nothing elsewhere.
- **full everywhere** (``full_state_dict=True``): the whole tensor on every rank.

A matrix split by tensor parallelism (`dmuon._ownership.tp_integration`) lives as one shard
per tp position on that position's owner. Sharded, it is a DTensor over the 2-D
``(dp, tp)`` mesh: ``Shard`` over tp along the dimension the plan split, and each tp
shard cut over dp along the other dimension (standard placements, so DCP reshards it to
any layout, a 1-D mesh or one process included). Full, the owners first gather the shards
over tp. Loading takes the owners' shards out of whatever DCP or a full state dict gives.

Every function here is called on every rank in the same order (the dedication's parameter
order), so the ranks issue the same collectives whatever the values.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.param import DedicatedParam

#: Codes all-gathered to agree on what each rank's state dict holds for a matrix.
MISSING, FULL, SHARDED, BAD_SHAPE = 0, 1, 2, 3


def dedication_mesh(state: DedicationState) -> DeviceMesh | None:
    """The mesh of the dedication: 1-D, or 2-D under HSDP (``None`` with one shard rank)."""
    return state.mesh if state.runtime.comm.group is not None else None


def _rows_per_chunk(rows: int, world: int) -> int:
    return max(1, math.ceil(rows / world))


def _with(shape: torch.Size, dim: int, length: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` set to ``length``."""
    return (*shape[:dim], length, *shape[dim + 1 :])


def _chunk_bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    per = _rows_per_chunk(rows, world)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


class DedicatedLayout:
    """Conversions between owner-held tensors and state-dict forms for one dedication."""

    def __init__(self, state: DedicationState) -> None:
        self.state = state
        self.comm = state.runtime.comm
        self.mesh = dedication_mesh(state)
        hsdp = self.mesh is not None and self.mesh.ndim == 2
        self.placements: tuple[Placement, ...] = (Replicate(), Shard(0)) if hsdp else (Shard(0),)

    # ----- owner -> state dict -----------------------------------------------------------
    def export(
        self, dp: DedicatedParam, owned: torch.Tensor | None, full: bool, rank0_only: bool
    ) -> torch.Tensor | None:
        """The state-dict form of a tensor of ``dp``'s shape held by its owner (``owned``).

        ``owned`` is the owner's tensor (``None`` on other ranks). Returns the DTensor
        shard (sharded), the full tensor (``full``; on CPU and on rank 0 only with
        ``rank0_only``), or ``None`` where this rank gets nothing.
        """
        comm = self.comm
        if dp.tp_sharded:
            return self._export_tp(dp, owned, full, rank0_only)
        if rank0_only and comm.replica_rank != 0:
            return None  # rank 0 of the mesh is in the first replica
        if comm.world_size == 1:
            assert owned is not None
            value = owned.detach().clone()
            return value.cpu() if rank0_only else value
        if not full:
            return self._scatter(dp, owned)
        if rank0_only:
            return self._to_rank0(dp, owned)
        buffer = (
            owned.detach().to(comm.device, torch.float32).clone()
            if dp.is_owned and owned is not None
            else torch.empty(dp.shape, dtype=torch.float32, device=comm.device)
        )
        comm.broadcast_now(buffer, dp.owner)
        return buffer

    def _export_tp(
        self, dp: DedicatedParam, owned: torch.Tensor | None, full: bool, rank0_only: bool
    ) -> torch.Tensor | None:
        """`export` for a matrix split by tensor parallelism (see the module docstring)."""
        tp = dp.tp
        assert tp is not None and tp.shard_dim is not None
        comm = self.comm
        if not full:
            if comm.world_size > 1:
                return self._scatter(dp, owned)
            assert owned is not None
            mesh, placements, _ = self._layout_of(dp)
            shape = dp.global_shape
            return DTensor.from_local(
                owned.detach().to(comm.device, torch.float32).clone(),
                mesh,
                placements,
                run_check=False,
                shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )
        # The owners' tp group gathers the shards into the whole matrix at tp rank 0...
        whole = None
        if dp.is_owned:
            assert owned is not None
            padded = torch.zeros(
                _with(dp.shape, tp.shard_dim, tp.padded), dtype=torch.float32, device=comm.device
            )
            padded.narrow(tp.shard_dim, 0, dp.shape[tp.shard_dim]).copy_(owned.detach())
            chunks = [torch.empty_like(padded) for _ in range(tp.size)] if tp.rank == 0 else None
            comm.gather_on(padded, chunks, 0, tp.group)
            if chunks is not None:
                whole = torch.cat(
                    [
                        chunk.narrow(tp.shard_dim, 0, stop - start)
                        for chunk, (start, stop) in zip(
                            chunks, (tp.bounds(r) for r in range(tp.size)), strict=True
                        )
                    ],
                    tp.shard_dim,
                )
        # ...which moves to rank 0 (or every rank) of tp position 0 like an unsplit
        # matrix, and from there along each tp group.
        value = None
        if tp.rank == 0:
            value = self.export(
                replace(dp, shape=dp.global_shape, tp=None), whole, True, rank0_only
            )
        if rank0_only:
            return value
        if value is None:
            value = torch.empty(dp.global_shape, dtype=torch.float32, device=comm.device)
        comm.broadcast_on(value, 0, tp.group)
        return value

    def _layout_of(self, dp: DedicatedParam) -> tuple[DeviceMesh, tuple[Placement, ...], int]:
        """``(mesh, placements, dimension cut over dp)`` of ``dp``'s sharded form."""
        if not dp.tp_sharded:
            assert self.mesh is not None
            return self.mesh, self.placements, 0
        tp = dp.tp
        assert tp is not None and tp.shard_dim is not None
        root = tp.mesh._get_root_mesh()
        names = tuple(root.mesh_dim_names or ())
        # With one data-parallel rank there is no mesh to shard over (`dedication_mesh`),
        # but the dp mesh passed to dedicate_params still names its dimension of the root.
        dp_mesh = self.mesh if self.mesh is not None else self.state.mesh
        dp_name = (dp_mesh.mesh_dim_names or (None,))[0] if dp_mesh is not None else None
        tp_name = (tp.mesh.mesh_dim_names or (None,))[0]
        if root.ndim != 2 or dp_name not in names or tp_name not in names:
            raise ValueError(
                f"{dp.fqn!r}: tensor-parallel checkpoints need the dp and tp meshes to be the "
                "two dimensions of one mesh (init_device_mesh(..., mesh_dim_names=('dp', "
                "'tp')), then mesh['dp'] and mesh['tp'])"
            )
        other = 1 - tp.shard_dim
        placements: list[Placement] = [Replicate(), Replicate()]
        placements[names.index(dp_name)] = Shard(other)
        placements[names.index(tp_name)] = Shard(tp.shard_dim)
        return root, tuple(placements), other

    def _scatter(self, dp: DedicatedParam, owned: torch.Tensor | None) -> DTensor:
        comm = self.comm
        mesh, placements, dim = self._layout_of(dp)
        length = int(dp.shape[dim])
        per = _rows_per_chunk(length, comm.world_size)
        chunks = None
        if dp.is_owned:
            assert owned is not None
            padded = torch.zeros(
                _with(dp.shape, dim, per * comm.world_size), dtype=torch.float32, device=comm.device
            )
            padded.narrow(dim, 0, length).copy_(owned.detach())
            chunks = [chunk.contiguous() for chunk in padded.chunk(comm.world_size, dim)]
        out = torch.empty(_with(dp.shape, dim, per), dtype=torch.float32, device=comm.device)
        comm.scatter_rows(chunks, out, dp.owner)
        start, stop = _chunk_bounds(length, comm.world_size, comm.rank)
        local = out.narrow(dim, 0, stop - start).clone()
        shape = dp.global_shape
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )

    def _to_rank0(self, dp: DedicatedParam, owned: torch.Tensor | None) -> torch.Tensor | None:
        comm = self.comm
        if dp.owner == 0:
            if comm.rank == 0:
                assert owned is not None
                return owned.detach().to("cpu", torch.float32, copy=True)
            return None
        if dp.is_owned:
            assert owned is not None
            comm.send(owned.detach().to(comm.device, torch.float32).contiguous(), 0)
            return None
        if comm.rank == 0:
            buffer = torch.empty(dp.shape, dtype=torch.float32, device=comm.device)
            comm.recv(buffer, dp.owner)
            return buffer.cpu()
        return None

    # ----- state dict -> owner -----------------------------------------------------------
    def classify(self, dp: DedicatedParam, value: Any) -> int:
        """This rank's code for ``value``: missing, full, sharded, or of the wrong shape."""
        if value is None:
            return MISSING
        if not isinstance(value, torch.Tensor):
            return BAD_SHAPE
        if tuple(value.shape) != tuple(dp.global_shape):
            return BAD_SHAPE
        return SHARDED if isinstance(value, DTensor) else FULL

    def agree(self, codes: list[int]) -> torch.Tensor:
        """Every rank's codes as a ``(world_size, len(codes))`` tensor (one collective)."""
        local = torch.tensor(codes, dtype=torch.int64)
        if self.comm.world_size == 1:
            return local.unsqueeze(0)
        return self.comm.all_gather_codes(local)

    def to_owner(
        self, dp: DedicatedParam, value: Any, every_rank: torch.Tensor
    ) -> torch.Tensor | None:
        """Bring ``value`` (this rank's state-dict entry) to ``dp``'s owner as a full tensor.

        ``every_rank`` is the column of `agree`'s result for ``dp``. Returns the full
        float32 tensor on the owner, ``None`` elsewhere (and when the owner has nothing).
        """
        codes = every_rank.tolist()
        if all(code == SHARDED for code in codes):
            return self._gather_sharded(dp, value)
        if codes[dp.owner] == FULL and dp.is_owned:
            value = dp.tp.local_of(value) if dp.tp is not None else value
            return value.detach().to(self.comm.device, torch.float32, copy=True)
        return None

    def _gather_sharded(self, dp: DedicatedParam, value: DTensor) -> torch.Tensor | None:
        comm = self.comm
        mesh, placements, dim = self._layout_of(dp) if self.mesh is not None else (None, (), 0)
        ours = value.device_mesh == mesh and tuple(value.placements) == placements
        if not ours:
            full = value.full_tensor()
            if not dp.is_owned:
                return None
            local = dp.tp.local_of(full) if dp.tp is not None else full
            return local.to(comm.device, torch.float32).contiguous()
        length = int(dp.shape[dim])
        per = _rows_per_chunk(length, comm.world_size)
        local = value.to_local().to(comm.device, torch.float32)
        chunk = torch.zeros(_with(dp.shape, dim, per), dtype=torch.float32, device=comm.device)
        chunk.narrow(dim, 0, local.shape[dim]).copy_(local)
        chunks = [torch.empty_like(chunk) for _ in range(comm.world_size)] if dp.is_owned else None
        comm.gather_rows(chunk, chunks, dp.owner)
        if chunks is None:
            return None
        return torch.cat(chunks, dim).narrow(dim, 0, length).contiguous()

    def from_rank0(self, dp: DedicatedParam, value: torch.Tensor | None) -> torch.Tensor | None:
        """Send rank 0's full ``value`` to ``dp``'s owners; they get it (others ``None``).

        Under HSDP the first replica's owner receives it and passes it on to the owners of
        the other replicas.
        """
        comm = self.comm
        if dp.tp is not None:
            raise ValueError(
                f"{dp.fqn!r} is tensor-parallel: loading a full state dict from rank 0 "
                "(broadcast_from_rank0) is not supported with tensor parallelism; load the "
                "sharded checkpoint with dcp.load, or give every rank the full state dict "
                "(full_state_dict=True without broadcast_from_rank0)"
            )
        received = self._from_rank0_in_first_replica(dp, value) if comm.replica_rank == 0 else None
        if comm.replicas == 1 or not dp.is_owned:
            return received
        if received is None:
            received = torch.empty(dp.shape, dtype=torch.float32, device=comm.device)
        comm.broadcast_replicas_now(received, 0)
        return received

    def _from_rank0_in_first_replica(
        self, dp: DedicatedParam, value: torch.Tensor | None
    ) -> torch.Tensor | None:
        comm = self.comm
        if comm.world_size == 1 or dp.owner == 0:
            if comm.rank == 0 and value is not None:
                return value.detach().to(comm.device, torch.float32, copy=True)
            return None
        if comm.rank == 0:
            assert value is not None
            comm.send(value.detach().to(comm.device, torch.float32).contiguous(), dp.owner)
            return None
        if dp.is_owned:
            buffer = torch.empty(dp.shape, dtype=torch.float32, device=comm.device)
            comm.recv(buffer, 0)
            return buffer
        return None
