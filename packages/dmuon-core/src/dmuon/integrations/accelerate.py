"""DMuon in a training loop of one's own on Hugging Face Accelerate.

`prepare` takes the place of ``accelerator.prepare(model, optimizer)``: it dedicates the
model's matrices, lets Accelerate wrap the model (``DistributedDataParallel``, or FSDP2 on
GPUs), builds `dmuon.Muon` on the wrapped model and prepares it. The rest of the loop is
Accelerate's own:

```python
accelerator = Accelerator(gradient_accumulation_steps=2)
model, optimizer = dmuon.integrations.accelerate.prepare(accelerator, model, lr=0.02)
dataloader = accelerator.prepare(dataloader)
for batch in dataloader:
    with accelerator.accumulate(model):          # dmuon.no_sync on accumulating batches
        accelerator.backward(model(**batch).loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DMuon's global norm
        optimizer.step()
        optimizer.zero_grad()
accelerator.save_state("checkpoint")             # model and optimizer through DCP
```

`prepare` makes four methods of that accelerator DMuon-aware, for the models it prepared
and only for them: ``no_sync`` (and so ``accumulate``) enters `dmuon.no_sync`;
``clip_grad_norm_`` given such a model's parameters runs `dmuon.clip_grad_norm_`;
``save_state`` and ``load_state`` write and read such a model and its optimizer as one
``torch.distributed.checkpoint`` folder (``dmuon`` inside the state folder) with
`dmuon.get_state_dict` / `dmuon.set_state_dict`, so every rank's Muon momentum is kept
and a checkpoint loads at another world size. Accelerate's own files carry the rest
(schedulers, samplers, random states, other models).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dmuon
from dmuon._ownership.dedication_state import get_dedication, unwrap
from dmuon._ownership.fsdp_integration import is_dedicated

__all__ = ["CHECKPOINT_FOLDER", "check_supported", "is_prepared", "prepare"]

CHECKPOINT_FOLDER = "dmuon"
"""The folder, inside an ``accelerator.save_state`` folder (or a Trainer's
``checkpoint-N``), that holds a DMuon model and its optimizer as a DCP checkpoint
(``dmuon_1``, ``dmuon_2``, ... for further models)."""

_HOOKS_ATTR = "_dmuon_hooks"


@contextlib.contextmanager
def _quiet_in_one_process() -> Iterator[None]:
    """DCP without a process group warns that it assumes one process, which is meant here."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def _dcp_save(state: dict[str, Any], path: str) -> None:
    """``dcp.save(state, checkpoint_id=path)``, also in one process."""
    with _quiet_in_one_process():
        dcp.save(state, checkpoint_id=path)


def _dcp_load(state: dict[str, Any], path: str) -> None:
    """``dcp.load(state, checkpoint_id=path)``, also in one process."""
    with _quiet_in_one_process():
        dcp.load(state, checkpoint_id=path)


def _dedicated_model(module: nn.Module) -> nn.Module | None:
    """The dedicated model inside ``module`` (a wrapper, a compiled module), or ``None``."""
    inner = getattr(module, "_orig_mod", module)
    inner = unwrap(inner)
    return inner if get_dedication(inner) is not None else None


@dataclass
class _Prepared:
    """One model `prepare` prepared, as Accelerate holds it, and its optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def muon(self) -> dmuon.Muon:
        """The `dmuon.Muon` inside Accelerate's optimizer wrapper."""
        optimizer = self.optimizer
        while not isinstance(optimizer, dmuon.Muon):
            optimizer = optimizer.optimizer  # type: ignore[attr-defined]
        return optimizer


@dataclass
class _Hooks:
    """What `prepare` added to one accelerator: its DMuon models and the originals of the
    methods it replaced."""

    accelerator: Any
    prepared: list[_Prepared] = field(default_factory=list)
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def owner_of(self, parameters: list[nn.Parameter]) -> _Prepared | None:
        """The DMuon model whose parameters these are (all its trainable ones at least)."""
        given = {id(p) for p in parameters}
        for entry in self.prepared:
            params = list(entry.model.parameters())
            trainable = {id(p) for p in params if p.requires_grad}
            if trainable <= given <= {id(p) for p in params}:
                return entry
        return None

    def folder(self, root: str, index: int) -> str:
        name = CHECKPOINT_FOLDER if index == 0 else f"{CHECKPOINT_FOLDER}_{index}"
        return os.path.join(root, name)

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Keep Accelerate's own state saving away from the DMuon models and optimizers."""
        acc = self.accelerator
        models, optimizers = acc._models, acc._optimizers
        # Accelerate lists a model as given or as wrapped, depending on the wrapper.
        mine_models = {id(_dedicated_model(e.model)) for e in self.prepared}
        mine_optimizers = {id(e.optimizer) for e in self.prepared}
        acc._models = [m for m in models if id(_dedicated_model(m)) not in mine_models]
        acc._optimizers = [o for o in optimizers if id(o) not in mine_optimizers]
        try:
            yield
        finally:
            acc._models, acc._optimizers = models, optimizers

    def save(self, _models: list[nn.Module], _weights: list[Any], output_dir: str) -> None:
        """Accelerate's save pre-hook: each DMuon model and optimizer into its DCP folder."""
        for index, entry in enumerate(self.prepared):
            model_sd, optim_sd = dmuon.get_state_dict(entry.model, entry.muon)
            _dcp_save({"model": model_sd, "optim": optim_sd}, self.folder(output_dir, index))

    def load(self, _models: list[nn.Module], input_dir: str) -> None:
        """Accelerate's load pre-hook: each DMuon model and optimizer from its DCP folder."""
        for index, entry in enumerate(self.prepared):
            path = self.folder(str(input_dir), index)
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise FileNotFoundError(
                    f"{path} holds no DMuon checkpoint: load a folder written by "
                    "accelerator.save_state after dmuon.integrations.accelerate.prepare (with "
                    "as many DMuon models prepared, in the same order)"
                )
            model_sd, optim_sd = dmuon.get_state_dict(entry.model, entry.muon)
            state = {"model": model_sd, "optim": optim_sd}
            _dcp_load(state, path)
            dmuon.set_state_dict(
                entry.model,
                entry.muon,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )


def _install(accelerator: Any) -> _Hooks:
    """Make ``accelerator``'s ``no_sync``, ``clip_grad_norm_``, ``save_state`` and
    ``load_state`` DMuon-aware (once per accelerator)."""
    hooks: _Hooks | None = getattr(accelerator, _HOOKS_ATTR, None)
    if hooks is not None:
        return hooks
    hooks = _Hooks(accelerator)
    originals = hooks.originals
    for name in ("no_sync", "clip_grad_norm_", "save_state", "load_state"):
        originals[name] = getattr(accelerator, name)

    @contextlib.contextmanager
    def no_sync(model: nn.Module) -> Iterator[None]:
        if _dedicated_model(model) is None:
            with originals["no_sync"](model):
                yield
        else:
            with dmuon.no_sync(model):
                yield

    def clip_grad_norm_(
        parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        params = list(parameters)
        entry = hooks.owner_of(params)
        if entry is None:
            if any(is_dedicated(p) for p in params):
                raise ValueError(
                    "accelerator.clip_grad_norm_ was given some of a DMuon model's parameters; "
                    "pass all of them (model.parameters()), or call "
                    "dmuon.clip_grad_norm_(model, max_norm): a dedicated matrix's gradient "
                    "lives on its owner rank, so the norm is taken over the whole model"
                )
            return originals["clip_grad_norm_"](params, max_norm, norm_type)
        return dmuon.clip_grad_norm_(entry.model, max_norm, norm_type)

    def save_state(*args: Any, **kwargs: Any) -> Any:
        with hooks.hidden():
            return originals["save_state"](*args, **kwargs)

    def load_state(*args: Any, **kwargs: Any) -> Any:
        with hooks.hidden():
            return originals["load_state"](*args, **kwargs)

    accelerator.no_sync = no_sync
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.save_state = save_state
    accelerator.load_state = load_state
    accelerator.register_save_state_pre_hook(hooks.save)
    accelerator.register_load_state_pre_hook(hooks.load)
    setattr(accelerator, _HOOKS_ATTR, hooks)
    return hooks


def is_prepared(accelerator: Any, model: nn.Module) -> bool:
    """Whether `prepare` (or `DMuonTrainer`) prepared ``model`` on ``accelerator``."""
    hooks: _Hooks | None = getattr(accelerator, _HOOKS_ATTR, None)
    return hooks is not None and any(e.model is model for e in hooks.prepared)


def check_supported(accelerator: Any) -> None:
    """Raise a `ValueError` for the Accelerate setups DMuon does not run in.

    fp16 with a gradient scaler (its unscaling reads ``.grad`` of every parameter, which a
    dedicated matrix does not hold), DeepSpeed, Megatron-LM, XLA, FSDP version 1, and
    FSDP2 with ``cpu_ram_efficient_loading`` (it moves the model to the meta device, which
    would drop the owners' matrices).
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise ValueError(
            f"DMuon does not run under Accelerate's {kind.value} mode; use DDP (the default "
            "with several processes) or FSDP2 (fsdp_version=2)"
        )
    if accelerator.scaler is not None:
        raise ValueError(
            "DMuon does not support fp16 with a gradient scaler: the scaler unscales .grad of "
            "every parameter, and a dedicated matrix's gradient lives on its owner rank. Use "
            "mixed_precision='bf16' (or 'no')"
        )
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError(
            "DMuon runs with FSDP2 only: set fsdp_version=2 in the FSDP plugin (Trainer: "
            "fsdp_config={'fsdp_version': 2})"
        )
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "cpu_ram_efficient_loading moves the model to the meta device inside prepare(), "
            "which would drop the matrices dmuon.dedicate_params gave their owners; turn it off"
        )


def _prepare_fsdp2(
    accelerator: Any,
    model: nn.Module,
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 through Accelerate for a dedicated ``model``: shard it, then build its optimizer.

    Accelerate shards the model inside ``prepare(model, optimizer)`` and then rebinds the
    optimizer's parameters to the sharded ones by data pointer. Dedicated parameters are
    not sharded and cannot be rebound that way (every 0-element placeholder has the same
    null pointer). So a stand-in optimizer over the other parameters goes through
    ``prepare``, and ``build_optimizer`` runs on the sharded model afterwards, as DMuon's
    order (dedicate, ``fully_shard``, optimizer) asks.
    """
    others = [p for p in model.parameters() if not is_dedicated(p)]
    stand_in = torch.optim.SGD(others, lr=0.0)
    prepared, prepared_stand_in = accelerator.prepare(model, stand_in)
    accelerator._optimizers = [o for o in accelerator._optimizers if o is not prepared_stand_in]
    optimizer = accelerator.prepare_optimizer(build_optimizer(prepared))
    return prepared, optimizer


def _register(accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make ``accelerator`` DMuon-aware for ``model`` (as prepared) and its optimizer."""
    hooks = _install(accelerator)
    if not any(e.model is model for e in hooks.prepared):
        hooks.prepared.append(_Prepared(model, optimizer))


def prepare(
    accelerator: Any,
    model: nn.Module,
    *,
    dedicate_kwargs: dict[str, Any] | None = None,
    **muon_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Dedicate ``model``, prepare it with ``accelerator``, and give it a `dmuon.Muon`.

    Call it on every process, where the loop would call ``accelerator.prepare(model,
    optimizer)``; prepare the data loaders and schedulers with ``accelerator.prepare`` as
    usual (a scheduler built on the returned optimizer). The model is moved to
    ``accelerator.device`` and passed to `dmuon.dedicate_params` (unless it already was),
    then wrapped by Accelerate: ``DistributedDataParallel`` with several processes, FSDP2
    when the accelerator's FSDP plugin has ``fsdp_version=2`` (GPUs), nothing in one
    process. `dmuon.Muon` is built on the wrapped model. See the module's docstring for
    the accelerator methods this makes DMuon-aware.

    Args:
        accelerator: The ``accelerate.Accelerator``.
        model: The model, not yet prepared.
        dedicate_kwargs: Arguments of `dmuon.dedicate_params` (``mesh``, ``predicate``,
            ``reshard_after_forward``, ...); by default the matrices of every
            ``nn.Linear`` but the output head, over all processes.
        **muon_kwargs: Arguments of `dmuon.Muon` (``lr``, ``adamw_lr``,
            ``param_groups``, ...).

    Returns:
        ``(model, optimizer)`` as Accelerate prepared them.

    Raises:
        ValueError: an Accelerate setup DMuon does not run in (see `check_supported`),
            ``model`` already prepared by Accelerate, or ``dedicate_kwargs`` given for a
            model that is already dedicated.
    """
    check_supported(accelerator)
    if getattr(model, "_is_accelerate_prepared", False) or model in accelerator._models:
        raise ValueError(
            "the model was already prepared by accelerator.prepare; pass the model itself to "
            "dmuon.integrations.accelerate.prepare, instead of accelerator.prepare(model, ...)"
        )
    if get_dedication(unwrap(model)) is None:
        if accelerator.device_placement and not accelerator.is_fsdp2:
            model = model.to(accelerator.device)
        dmuon.dedicate_params(model, **(dedicate_kwargs or {}))
    elif dedicate_kwargs:
        raise ValueError(
            "the model is already dedicated (dmuon.dedicate_params ran on it), so "
            "dedicate_kwargs would be ignored; drop them or pass a model not yet dedicated"
        )
    if accelerator.is_fsdp2:
        prepared, optimizer = _prepare_fsdp2(
            accelerator, model, lambda m: dmuon.Muon(m, **muon_kwargs)
        )
    else:
        prepared = accelerator.prepare(model)
        optimizer = accelerator.prepare(dmuon.Muon(prepared, **muon_kwargs))
    _register(accelerator, prepared, optimizer)
    return prepared, optimizer
