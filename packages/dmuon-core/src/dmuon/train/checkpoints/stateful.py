"""The trainer's state as ``torch.distributed.checkpoint.stateful.Stateful`` objects.

A checkpoint is the ``state_dict()`` of each of these, and resuming is their
``load_state_dict()``; `dmuon.train.checkpoints.folder` decides where each one is stored.
DCP's ``Stateful`` is a protocol, so they need not import it, nor DCP (about 1 s), which a
run without checkpoints never loads:

* `ModelState` and `OptimizerState` go through DCP (every rank writes its part; any world
  size reads them back), with `dmuon.get_model_state_dict` / `dmuon.get_optimizer_state_dict`
  (torch's functions on a model without dedicated parameters);
* `TrainState` (step, elapsed time, what the run was started with) and the LR scheduler
  go into rank 0's ``trainer_state.pt``;
* `RNGState` goes into one ``rng_rank{r}.pt`` per rank.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import dmuon

__all__ = ["ModelState", "OptimizerState", "RNGState", "TrainState"]


class ModelState:
    """The model's weights (sharded: FSDP2 DTensors and the owners' dedicated matrices)."""

    def __init__(self, model: nn.Module) -> None:
        """Wrap ``model``."""
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """`dmuon.get_model_state_dict` of the model."""
        return dmuon.get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`dmuon.set_model_state_dict` (every rank, a collective)."""
        dmuon.set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """The optimizer's state, keyed by parameter name."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Wrap ``optimizer`` of ``model``."""
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """`dmuon.get_optimizer_state_dict`."""
        return dmuon.get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`dmuon.set_optimizer_state_dict` (every rank, a collective)."""
        dmuon.set_optimizer_state_dict(self.model, self.optimizer, state_dict)


@dataclass
class TrainState:
    """Where the run is, and what it was started with (to refuse resuming another run).

    Attributes:
        step: optimizer steps done.
        time: seconds of training so far (a resumed run's ``time`` continues from it).
        model: ``--model`` (a preset name or the model directory).
        optimizer: ``--optimizer``.
        muon_variant: ``--muon-variant`` under ``--optimizer dmuon`` (``None`` otherwise).
        global_batch_size: sequences per step.
        seq_len: tokens per sequence.
        world_size: processes.
        trackers: ``{tracker: ids}`` of the experiment trackers' runs (``--report-to``),
            which a resumed run continues.
    """

    step: int = 0
    time: float = 0.0
    model: str | None = None
    optimizer: str | None = None
    muon_variant: str | None = None
    global_batch_size: int | None = None
    seq_len: int | None = None
    world_size: int | None = None
    trackers: dict[str, dict[str, str]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the fields present in ``state_dict``."""
        for key, value in state_dict.items():
            if hasattr(self, key):
                setattr(self, key, value)


class RNGState:
    """This process's random number generators: torch's CPU one, CUDA's if used, Python's."""

    def __init__(self, device: torch.device) -> None:
        """The generators of ``device`` (and the CPU's and Python's)."""
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        """The generator states."""
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators."""
        torch.set_rng_state(state_dict["torch"])
        random.setstate(state_dict["python"])
        if self.device.type == "cuda" and "cuda" in state_dict:
            torch.cuda.set_rng_state(state_dict["cuda"], self.device)
