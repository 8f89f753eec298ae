"""DMuon in torchtitan's trainer (torchtitan 0.3.0; CUDA only, as torchtitan's trainer is).

Three pieces replace their torchtitan counterparts in a ``Trainer.Config``:

```python
from dmuon.integrations import torchtitan as dmuon_titan

config = llama3_debugmodel()                     # any torchtitan Trainer.Config
config.model_spec = dmuon_titan.with_dedication(config.model_spec)
config.optimizer = dmuon_titan.DMuonOptimizers.Config(muon_kwargs={"lr": 8e-4})
config.checkpoint = dmuon_titan.DMuonCheckpointManager.Config(enable=True)
```

- `with_dedication`: the model spec's parallelize step runs `dmuon.dedicate_params` on
  the meta-built model and the FSDP mesh (each owner allocates its matrices' masters,
  nothing else is allocated), then torchtitan's own parallelize function (``fully_shard``
  leaves the dedicated matrices alone). The trainer's ``to_empty`` and ``init_weights``
  afterwards initialise the owners' matrices in place, and a seed checkpoint loads
  through `DMuonCheckpointManager`; no rank ever holds the whole model.
- `DMuonOptimizers`: torchtitan's optimizer container holding one `dmuon.Muon`; its state
  dict is DMuon's, flattened as torchtitan's checkpointer expects.
- `DMuonCheckpointManager`: torchtitan's DCP checkpointer with the model's state dict
  taken by `dmuon.get_model_state_dict` (so each dedicated matrix is saved once, from its
  owner, in FSDP2's layout) and loaded by `dmuon.set_model_state_dict`.

Why only on CUDA: torchtitan's trainer takes its device type from
``torch._utils._get_available_device_type() or "cuda"`` and calls
``torch.cuda.set_device`` and ``torch.cuda.get_device_properties`` while it builds, so it
does not start on a machine without a GPU. Pipeline parallelism is not supported (one
model part); tensor parallelism is, as in `dmuon.dedicate_params`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.optim import Optimizer
from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan.components.optimizer import OptimizersContainer

import dmuon

__all__ = ["DMuonCheckpointManager", "DMuonModelWrapper", "DMuonOptimizers", "with_dedication"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _fsdp_mesh(parallel_dims: Any) -> Any:
    """The mesh torchtitan shards over (``None`` when nothing is sharded)."""
    return parallel_dims.get_optional_mesh("fsdp")


def with_dedication(model_spec: Any, **dedicate_kwargs: Any) -> Any:
    """A copy of ``model_spec`` whose parallelize step dedicates before ``fully_shard``.

    The model arrives on the meta device and is dedicated there: each owner allocates
    its matrices' float32 masters on the mesh's device, uninitialised, and the trainer's
    ``to_empty`` and ``init_weights`` (or a checkpoint) fill them, as they fill FSDP2's
    shards. ``dedicate_kwargs`` go to `dmuon.dedicate_params` (``mesh`` defaults to
    torchtitan's FSDP mesh).
    """
    parallelize = model_spec.parallelize_fn

    def parallelize_with_dedication(model: nn.Module, **kwargs: Any) -> nn.Module:
        options = dict(dedicate_kwargs)
        options.setdefault("mesh", _fsdp_mesh(kwargs["parallel_dims"]))
        dmuon.dedicate_params(model, **options)
        return parallelize(model, **kwargs)

    return dataclasses.replace(model_spec, parallelize_fn=parallelize_with_dedication)


class DMuonOptimizers(OptimizersContainer):
    """torchtitan's optimizer container, holding one `dmuon.Muon` for the model."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        #: Arguments of `dmuon.Muon` (``lr``, ``adamw_lr``, ``weight_decay``, ...).
        muon_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(
                "DMuonOptimizers takes one model part: pipeline parallelism is not supported"
            )
        self.model_parts = model_parts
        self.optimizers = [dmuon.Muon(model_parts[0], **config.muon_kwargs)]
        Optimizer.__init__(
            self, [p for g in self.optimizers[0].param_groups for p in g["params"]], {}
        )

    def state_dict(self) -> dict[str, Any]:
        """DMuon's optimizer state dict, flattened (``state.FQN.key`` entries)."""
        return dmuon.get_optimizer_state_dict(
            self.model_parts[0], self.optimizers[0], options=_FLAT
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict` returned (filled by DCP, at any world size)."""
        dmuon.set_optimizer_state_dict(
            self.model_parts[0], self.optimizers[0], state_dict, options=_FLAT
        )


class DMuonModelWrapper(ModelWrapper):
    """torchtitan's model wrapper for checkpoints, with DMuon's model state dict."""

    def _get_state_dict(self) -> dict[str, Any]:
        return {k: v for model in self.model for k, v in dmuon.get_model_state_dict(model).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model in self.model:
            keys = set(model.state_dict())
            dmuon.set_model_state_dict(model, {k: v for k, v in state_dict.items() if k in keys})
        self.cached_state_dict = self._get_state_dict()


class DMuonCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointer, saving and loading the model through DMuon."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: CheckpointManager.Config, **kwargs: Any) -> None:  # type: ignore[override]
        super().__init__(config, **kwargs)
        if config.enable:
            self.states["model"] = DMuonModelWrapper(kwargs["model_parts"])
