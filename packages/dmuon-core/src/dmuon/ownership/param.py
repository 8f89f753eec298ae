"""`DedicatedParam`: one Muon-target matrix and where it lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(eq=False)
class DedicatedParam:
    """One Muon-target matrix and where it lives.

    ``param`` is the parameter registered on the module between forwards: the full float32
    master on the owner, a 0-element placeholder on every other rank. The owner's averaged
    gradient is ``param._reduced_grad``; local accumulation under `no_sync` is
    ``param._accumulated_grad`` (both ``None`` after ``zero_grad``). Only the ownership
    runtime writes them; read the reduced gradient with
    ``DedicationRuntime.reduced_grad``.

    ``transposed`` is ``True`` for layouts that store the matrix as ``(in, out)`` (the
    ``Conv1D`` of GPT-2-style models); Newton-Schulz does not care, the learning-rate
    adjustment uses ``(out, in)``.
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

    @property
    def numel(self) -> int:
        """Number of elements of the full matrix."""
        return self.shape.numel()

    @property
    def out_in_shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the matrix, whatever its storage layout."""
        rows, cols = int(self.shape[0]), int(self.shape[1])
        return (cols, rows) if self.transposed else (rows, cols)
