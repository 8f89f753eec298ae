"""`DedicatedParam`: one Muon-target matrix (or stack of matrices) and where it lives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dmuon._ownership.tp_integration import TensorParallel


@dataclass(eq=False)
class DedicatedParam:
    """One Muon-target matrix, or stack of independent matrices, and where it lives.

    ``param`` is the parameter registered on the module between forwards: the full float32
    master on the owner, a 0-element placeholder on every other rank. The owner's averaged
    gradient is ``param._reduced_grad``; local accumulation under `no_sync` is
    ``_accumulated_grad`` on the parameter the module holds (both ``None`` after
    ``zero_grad``). Only `dmuon._ownership.gradients` writes them; read the reduced gradient
    with ``DedicationRuntime.reduced_grad``.

    ``transposed`` is ``True`` for layouts that store the matrix as ``(in, out)`` (the
    ``Conv1D`` of GPT-2-style models); Newton-Schulz does not care, the learning-rate
    adjustment uses ``(out, in)``.

    A 3-D parameter is a stack ``(matrices, ...)`` of independent matrices (the fused experts
    of a mixture-of-experts layer): one dedicated tensor with one owner, broadcast and
    reduced as a whole, orthogonalized matrix by matrix. ``transposed`` then says that each
    matrix is stored as ``(in, out)``.

    A stack the planner split by experts is several records, one per contiguous range of
    experts (``experts = (start, stop)``), each with its own owner: ``param`` is then the
    owner's master of that range (``shape`` is the range's), and ``registered`` is the
    stack's own parameter, a 0-element placeholder on every rank, which the module holds
    between forwards. ``stack_shape`` is the whole stack's shape.

    ``fused_parts`` is the number of equal parts a known fused layout concatenates along
    each matrix's output dimension (2 for transformers' ``gate_up_proj``, else 1): what
    ``dmuon.Muon(split="auto")`` splits by.

    On a 2-D (HSDP) mesh every replica has an owner of the record (the rank at shard
    position ``owner``), holding the same master; only the one in replica
    ``update_replica`` receives the averaged gradient, keeps the Muon momentum and runs
    Newton-Schulz (``updates_here``), and after the step it hands its update to the
    other replicas' owners. On a 1-D mesh ``updates_here`` is ``is_owned``.

    ``tp`` describes a matrix that tensor parallelism made a DTensor
    (`dmuon._ownership.tp_integration`): ``shape``, the master, the momentum and the
    gradients are then this tp position's shard, and ``global_shape`` the whole matrix's.
    """

    fqn: str
    module: nn.Module
    attr: str
    owner: int
    shape: torch.Size
    param: nn.Parameter
    boundary: str
    is_owned: bool
    transposed: bool = False
    fused_parts: int = 1
    experts: tuple[int, int] | None = None
    registered: nn.Parameter | None = None
    stack_shape: torch.Size | None = None
    tp: TensorParallel | None = None
    update_replica: int = 0
    #: ``None``: the same as ``is_owned`` (one replica).
    updates_here: bool | None = None

    def __post_init__(self) -> None:
        if self.updates_here is None:
            self.updates_here = self.is_owned

    @property
    def global_shape(self) -> torch.Size:
        """The whole matrix's shape (``shape`` unless tensor parallelism shards it)."""
        return self.tp.global_shape if self.tp is not None else self.shape

    @property
    def tp_sharded(self) -> bool:
        """Whether tensor parallelism splits the matrix (Newton-Schulz gathers it)."""
        return self.tp is not None and self.tp.shard_dim is not None

    @property
    def name(self) -> str:
        """``fqn``, or ``fqn[start:stop]`` for a range of a split stack (`OwnerPlan`'s name)."""
        if self.experts is None:
            return self.fqn
        return f"{self.fqn}[{self.experts[0]}:{self.experts[1]}]"

    @property
    def is_range(self) -> bool:
        """Whether this is one range of experts of a stack split across owners."""
        return self.experts is not None

    @property
    def module_param(self) -> nn.Parameter:
        """The parameter the module holds between forwards (``registered`` or ``param``)."""
        return self.registered if self.registered is not None else self.param

    @property
    def view_shape(self) -> torch.Size:
        """Shape of the tensor the module holds while the boundary runs: the record's own,
        or the whole stack's for a range of a split stack."""
        return self.stack_shape if self.stack_shape is not None else self.shape

    @property
    def numel(self) -> int:
        """Number of elements of the full matrix (of the range, for a split stack)."""
        return self.shape.numel()

    @property
    def is_stack(self) -> bool:
        """Whether this is a 3-D stack of independent matrices."""
        return len(self.shape) == 3

    @property
    def num_matrices(self) -> int:
        """How many matrices the tensor holds: 1, or the stack's leading dimension."""
        return int(self.shape[0]) if self.is_stack else 1

    @property
    def out_in_shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of one matrix, whatever its storage layout."""
        rows, cols = int(self.global_shape[-2]), int(self.global_shape[-1])
        return (cols, rows) if self.transposed else (rows, cols)
