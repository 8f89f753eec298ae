"""`DMuonTrainer`: Hugging Face's ``Trainer``, training with `dmuon.Muon`.

```python
from dmuon.integrations.transformers import DMuonTrainer

trainer = DMuonTrainer(model=model, args=args, train_dataset=dataset,
                       muon_kwargs={"lr": 0.02})
trainer.train()
```

It is used exactly like ``transformers.Trainer``, with two more arguments:
``muon_kwargs`` (for `dmuon.Muon`) and ``dedicate_kwargs`` (for `dmuon.dedicate_params`).
The model is dedicated when the trainer is created, before Trainer (through Accelerate)
wraps it; `dmuon.Muon` is built after the wrapping. Every Trainer feature below then goes
through DMuon: accumulation micro-batches run under `dmuon.no_sync`, ``max_grad_norm``
clips with `dmuon.clip_grad_norm_`, ``lr_scheduler_type`` schedules both the Muon and
the AdamW groups, ``save_steps`` checkpoints hold the model and optimizer as one
``torch.distributed.checkpoint`` folder that ``resume_from_checkpoint`` restores (at any
world size), and ``save_model`` / ``push_to_hub`` write plain Hugging Face directories of
full tensors.

Written against transformers 5.24 (its ``Trainer`` internals that prepare the model and
the optimizer and that save and load checkpoints).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from transformers import Trainer, TrainingArguments

import dmuon
from dmuon._ownership.dedication_state import get_dedication
from dmuon.integrations.accelerate import (
    CHECKPOINT_FOLDER,
    _dcp_load,
    _dcp_save,
    _prepare_fsdp2,
    _register,
    check_supported,
    is_prepared,
)

__all__ = ["CHECKPOINT_FOLDER", "DMuonTrainer", "muon_arguments"]

_SCHEDULER_FILE = "scheduler.pt"
_TORCH_OPTIMIZER_FILE = "optimizer.pt"
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"


#: The ``Trainer`` methods DMuonTrainer replaces; a transformers release without them
#: prepares or checkpoints the model in another way, which DMuonTrainer would not follow.
_REPLACED = (
    "_prepare_for_training",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
)
_missing = [name for name in _REPLACED if not hasattr(Trainer, name)]
if _missing:
    import transformers

    raise ImportError(
        f"DMuonTrainer needs a transformers whose Trainer has {_missing} (transformers "
        f"5.24 has); this is transformers {transformers.__version__}: pip install -U "
        "'transformers>=5.24'"
    )


def muon_arguments(args: TrainingArguments) -> dict[str, Any]:
    """The `dmuon.Muon` arguments ``DMuonTrainer`` takes from ``TrainingArguments``.

    One learning rate for both groups (``learning_rate``: `dmuon.Muon`'s default update
    scale gives Muon the RMS of an AdamW update, so AdamW's rate carries over), the same
    ``weight_decay`` for both, and AdamW's betas and epsilon. ``muon_kwargs`` override any
    of them.
    """
    return {
        "lr": args.learning_rate,
        "weight_decay": args.weight_decay,
        "adamw_lr": args.learning_rate,
        "adamw_betas": (args.adam_beta1, args.adam_beta2),
        "adamw_eps": args.adam_epsilon,
        "adamw_weight_decay": args.weight_decay,
    }


def _default_optim() -> str:
    return str(TrainingArguments.__dataclass_fields__["optim"].default)


def _tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are a later name of a tensor seen first under another name."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    return aliases


def _read_full_weights(directory: str) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face directory (one safetensors file, or an index of them)."""
    from safetensors.torch import load_file

    single = os.path.join(directory, _SAFE_WEIGHTS)
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(directory, _SAFE_WEIGHTS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for name in files:
            weights.update(load_file(os.path.join(directory, name)))
        return weights
    raise FileNotFoundError(
        f"{directory} holds neither a DMuon checkpoint ({CHECKPOINT_FOLDER}/) nor "
        f"{_SAFE_WEIGHTS}; pass a checkpoint folder written by DMuonTrainer "
        "(output_dir/checkpoint-N) or a directory written by save_pretrained"
    )


class DMuonTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is `dmuon.Muon`.

    Takes every argument of ``Trainer`` (except ``optimizers``,
    ``optimizer_cls_and_kwargs`` and ``model_init``: the optimizer can only be built
    once the model is dedicated and wrapped), and:

    Args:
        muon_kwargs: Arguments of `dmuon.Muon`. By default the optimizer takes
            ``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2`` and
            ``adam_epsilon`` from ``TrainingArguments`` (see `muon_arguments`), and
            ``param_groups=dmuon.weight_decay_groups(model)``: no weight decay on biases,
            norms and embeddings, as Trainer does for AdamW.
        dedicate_kwargs: Arguments of `dmuon.dedicate_params` (``predicate``,
            ``reshard_after_forward``, ``mesh``, ...). By default every ``nn.Linear``
            matrix but the output head is dedicated, over all processes, in Z3.

    Multi-process runs (``torchrun``) are DDP, as with ``Trainer``. FSDP2 is
    ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})``: on GPUs
    Accelerate shards the model; where Accelerate would run DDP instead (CPUs),
    ``DMuonTrainer`` applies ``fully_shard`` itself, to each layer of
    ``fsdp_config["transformer_layer_cls_to_wrap"]`` (or the model's
    ``_no_split_modules``) and then to the model.

    ``TrainingArguments.optim`` is not used: left at its default it is ignored (there is
    nothing to choose, so nothing is said); set to anything else it is refused. Logs carry
    both groups' learning rates, ``learning_rate_muon`` and ``learning_rate_adamw``;
    ``learning_rate`` is the AdamW groups' (``TrainingArguments.learning_rate``).

    Raises:
        ValueError: ``optimizers``, ``optimizer_cls_and_kwargs``, ``model_init``, a
            non-default ``optim`` or ``optim_args``, fp16, DeepSpeed or FSDP version 1.
    """

    def __init__(
        self,
        *args: Any,
        muon_kwargs: dict[str, Any] | None = None,
        dedicate_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.model_init is not None:
            raise ValueError(
                "DMuonTrainer takes model=..., not model_init: the model is dedicated once, "
                "when the trainer is created"
            )
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError(
                "DMuonTrainer builds dmuon.Muon itself, after the model is wrapped; pass its "
                "settings as muon_kwargs={...} instead of optimizers=(...), and choose the "
                "schedule with TrainingArguments(lr_scheduler_type=...)"
            )
        if self.optimizer_cls_and_kwargs is not None:
            raise ValueError(
                "DMuonTrainer always trains with dmuon.Muon; pass its settings as "
                "muon_kwargs={...} instead of optimizer_cls_and_kwargs"
            )
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim != _default_optim():
            raise ValueError(
                f"TrainingArguments(optim={optim!r}) asks for another optimizer, but "
                "DMuonTrainer always trains with dmuon.Muon; leave optim at its default and "
                "pass DMuon's settings as muon_kwargs={...}"
            )
        if self.args.optim_args:
            raise ValueError(
                "TrainingArguments(optim_args=...) configures Trainer's own optimizers; pass "
                "DMuon's settings as muon_kwargs={...}"
            )
        check_supported(self.accelerator)
        fsdp_version = self.args.fsdp_config.get("version", 1) if self.args.fsdp else None
        if self.args.fsdp and fsdp_version != 2:
            raise ValueError(
                "DMuon runs with FSDP2 only: pass TrainingArguments(fsdp=True, "
                "fsdp_config={'fsdp_version': 2})"
            )
        self.muon_kwargs = dict(muon_kwargs or {})
        #: ``"accelerate"`` (Accelerate shards with FSDP2), ``"self"`` (FSDP2 asked for
        #: where Accelerate runs DDP: this trainer shards), or ``None`` (no FSDP2).
        self.fsdp2_by = ("accelerate" if self.is_fsdp_enabled else "self") if fsdp_version else None
        if get_dedication(self.model) is None:
            dmuon.dedicate_params(self.model, **(dedicate_kwargs or {}))
        elif dedicate_kwargs:
            raise ValueError(
                "the model is already dedicated (dmuon.dedicate_params ran on it), so "
                "dedicate_kwargs would be ignored; drop them or pass a model not yet dedicated"
            )

    # ----- the optimizer ----------------------------------------------------------------
    def _build_muon(self, model: nn.Module) -> dmuon.Muon:
        kwargs = {**muon_arguments(self.args), **self.muon_kwargs}
        kwargs.setdefault("param_groups", dmuon.weight_decay_groups(model))
        return dmuon.Muon(model, **kwargs)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build `dmuon.Muon` for ``model`` (the trainer's model by default), if not built yet.

        Called after the model is wrapped (DDP or FSDP2), as DMuon's order asks.
        """
        if self.optimizer is None:
            self.optimizer = self._build_muon(model if model is not None else self.model_wrapped)
        return self.optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Log as ``Trainer`` does, with both groups' learning rates under their own names.

        ``learning_rate`` is the AdamW groups' rate (``TrainingArguments.learning_rate``
        as scheduled); ``learning_rate_muon`` and ``learning_rate_adamw`` name each group's
        (Trainer alone would log the first group's, Muon's, as ``learning_rate``). With
        ``muon_kwargs={"qk_clip": tau}`` the last step's ``max_logit`` and
        ``qk_clipped_heads`` are logged too.
        """
        if "learning_rate" in logs and self.optimizer is not None:
            muon = self._muon()
            rates = {group["algorithm"]: group["lr"] for group in muon.param_groups}
            for algorithm, rate in rates.items():
                logs[f"learning_rate_{algorithm}"] = float(rate)
            if "adamw" in rates:
                logs["learning_rate"] = float(rates["adamw"])
            report = muon.qk_clip_report
            if report is not None:
                logs["max_logit"] = report.max_logit
                logs["qk_clipped_heads"] = report.clipped_heads
        super().log(logs, *args, **kwargs)

    def _muon(self) -> dmuon.Muon:
        optimizer = self.optimizer
        while not isinstance(optimizer, dmuon.Muon):
            optimizer = optimizer.optimizer  # AcceleratedOptimizer
        return optimizer

    def _fully_shard(self, model: nn.Module) -> None:
        """FSDP2 applied here: each layer to wrap, then the model, on the dedication's mesh."""
        from torch.distributed.fsdp import fully_shard

        config = self.args.fsdp_config
        names = set(
            config.get("transformer_layer_cls_to_wrap") or getattr(model, "_no_split_modules", ())
        )
        if not names:
            raise ValueError(
                "FSDP2 needs the layer classes to shard one by one: set fsdp_config="
                "{'fsdp_version': 2, 'transformer_layer_cls_to_wrap': ['MyDecoderLayer']}"
            )
        state = get_dedication(model)
        mesh = state.mesh if state is not None else None
        reshard = bool(config.get("reshard_after_forward", True))
        for module in list(model.modules()):
            if type(module).__name__ in names:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    def _prepare_model_and_optimizer(self) -> nn.Module:
        """Wrap the dedicated model, then build and prepare `dmuon.Muon`; returns the
        wrapped model."""
        if self.fsdp2_by == "accelerate":
            model, self.optimizer = _prepare_fsdp2(self.accelerator, self.model, self._build_muon)
        elif self.fsdp2_by == "self":
            self._fully_shard(self.model)
            model = self.accelerator.prepare_model(
                self.model, device_placement=False, evaluation_mode=True
            )
            self.optimizer = self.accelerator.prepare(self._build_muon(model))
        else:
            model, self.optimizer = self.accelerator.prepare(
                self.model, self._build_muon(self.model)
            )
        _register(self.accelerator, model, self.optimizer)
        return model

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[nn.Module, Any]:
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        if is_prepared(self.accelerator, self.model_wrapped):
            model = self.model_wrapped  # a later train() call: already wrapped
        else:
            model = self._prepare_model_and_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if self.fsdp2_by == "accelerate":
            self.model = model
        if resume_from_checkpoint is not None:
            if self.fsdp2_by == "accelerate":  # Trainer loads only after Accelerate's FSDP2
                self._load_from_checkpoint(resume_from_checkpoint, model)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    # ----- gradients --------------------------------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return dmuon.clip_grad_norm_(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = self._muon().grad_norm()
        return grad_norm

    # ----- saving and loading -----------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a Hugging Face directory of full tensors (``from_pretrained`` loads it).

        Call it on every process (it gathers the dedicated matrices from their owners);
        the main process writes.
        """
        if output_dir is None:
            output_dir = self.args.output_dir
        full = dmuon.get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        self._save(output_dir, state_dict=full)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The model and optimizer as one DCP folder (every rank's shards and momentum),
        and the scheduler as Trainer saves it."""
        model_sd, optim_sd = dmuon.get_state_dict(self.model, self._muon())
        folder = os.path.join(output_dir, CHECKPOINT_FOLDER)
        _dcp_save({"model": model_sd, "optim": optim_sd}, folder)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """Load the model's weights: from the DCP folder of a DMuonTrainer checkpoint, or
        from the full weights of a Hugging Face directory."""
        model = model if model is not None else self.model
        folder = os.path.join(resume_from_checkpoint, CHECKPOINT_FOLDER)
        if os.path.isfile(os.path.join(folder, ".metadata")):
            model_sd = dmuon.get_model_state_dict(model)
            _dcp_load({"model": model_sd}, folder)
            dmuon.set_model_state_dict(model, model_sd)
            return
        weights = _read_full_weights(resume_from_checkpoint)
        result = dmuon.set_model_state_dict(
            model, weights, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        missing = sorted(set(result.missing_keys) - _tied_aliases(model))
        if missing or result.unexpected_keys:
            raise ValueError(
                f"the weights in {resume_from_checkpoint} do not fit the model: missing "
                f"{missing[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load the optimizer from the checkpoint's DCP folder, and the scheduler."""
        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, CHECKPOINT_FOLDER)
        if not os.path.isfile(os.path.join(folder, ".metadata")):
            if os.path.isfile(os.path.join(checkpoint, _TORCH_OPTIMIZER_FILE)):
                raise ValueError(
                    f"{checkpoint} holds a torch optimizer's state ({_TORCH_OPTIMIZER_FILE}), "
                    "not DMuon's: resume from a checkpoint written by DMuonTrainer, or load "
                    "only the weights (DMuonTrainer(model=AutoModel.from_pretrained(...)))"
                )
            return  # saved with save_only_model: nothing to restore, as with Trainer
        muon = self._muon()
        optim_sd = dmuon.get_optimizer_state_dict(self.model, muon)
        _dcp_load({"optim": optim_sd}, folder)
        dmuon.set_optimizer_state_dict(self.model, muon, optim_sd)
        scheduler = os.path.join(checkpoint, _SCHEDULER_FILE)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint, self.model)
