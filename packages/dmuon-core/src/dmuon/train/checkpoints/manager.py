"""Checkpoints of the recipe: where a run starts from, what it saves, and the HF export.

`CheckpointManager` is the trainer's checkpoint side, as torchtitan keeps one: it resumes
from the latest verified checkpoint of ``--checkpoint-dir`` (damaged ones reported and
passed over), from ``--resume PATH``, or takes ``--init-from``'s weights; it refuses a
checkpoint written by another model, optimizer or variant, or past ``--steps``; it saves
the model, optimizer, scheduler, `TrainState` and RNG states with the HF snapshot
(`dmuon.train.checkpoints.folder` writes the folders); and it exports the model as a Hugging
Face directory. Every method that moves weights is a collective.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import torch.distributed as dist

import dmuon
from dmuon.train import config_file
from dmuon.train.checkpoints import folder as checkpoint_folder
from dmuon.train.checkpoints.stateful import ModelState, OptimizerState, RNGState, TrainState

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Resume, save and export for one `Trainer` (whose model, optimizer and state it
    reads and, on resume, sets)."""

    def __init__(self, trainer: Any) -> None:
        """Serve ``trainer``, a `dmuon.train.loop.Trainer` (not imported here: the trainer
        imports this module)."""
        self.trainer = trainer
        self._warned_tokenizer = False

    def states(self) -> dict[str, Any]:
        return {
            "distributed": {
                "model": ModelState(self.trainer.model),
                "optim": OptimizerState(self.trainer.model, self.trainer.optimizer),
            },
            "rank_zero": {"train": self.trainer.train_state, "scheduler": self.trainer.scheduler},
            "rng": RNGState(self.trainer.device),
        }

    def restore(self) -> None:
        """Resume from a checkpoint or take initial weights, as the flags say."""
        cfg = self.trainer.config
        if cfg.checkpoint_dir is not None and self.trainer.rank == 0:
            checkpoint_folder.remove_incomplete(cfg.checkpoint_dir)  # saves cut short
        if cfg.resume == "never":
            target = None
        elif cfg.resume == "auto":
            target = self._latest_verified() if cfg.checkpoint_dir is not None else None
        else:
            target = checkpoint_folder.require_checkpoint(cfg.resume, "--resume")
        if target is not None and cfg.init_from is not None:
            raise ValueError(
                f"--init-from {cfg.init_from} was given, but --resume {cfg.resume} found "
                f"checkpoint {target} to continue from. Pass --resume never to start a new "
                "run from the --init-from weights, or drop --init-from to continue the run."
            )
        if target is not None:
            self._resume(target)
            return
        if cfg.init_from is not None:
            checkpoint_folder.load_checkpoint(
                cfg.init_from, distributed={"model": ModelState(self.trainer.model)}
            )

    def _latest_verified(self) -> Path | None:
        """The newest checkpoint whose files match its manifest, found on rank 0 (it reads
        every file once) and told to the other ranks; damaged ones are reported."""
        assert self.trainer.config.checkpoint_dir is not None
        found: list[Path | None] = [None]
        if self.trainer.rank == 0:

            def damaged(path: Path, problems: list[str]) -> None:
                text = f"skipping damaged checkpoint {path}: " + "; ".join(problems)
                print(f"dmuon-train: warning: {text}", file=sys.stderr, flush=True)
                self.trainer.notes.append(
                    {
                        contract.EVENT_KEY: contract.CHECKPOINT_SKIPPED_EVENT,
                        "checkpoint": str(path),
                        "problems": problems,
                    }
                )

            folder = self.trainer.config.checkpoint_dir
            found[0] = checkpoint_folder.latest_checkpoint(folder, damaged)
        if self.trainer.distributed:
            # not audited: rank 0's choice of checkpoint, a path, not a tensor of the model
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def _resume(self, path: Path) -> None:
        cfg = self.trainer.config
        saved = TrainState()
        saved.load_state_dict(checkpoint_folder.read_trainer_state(path)["train"])
        checks = (("model", "--model"), ("optimizer", "--optimizer"))
        if cfg.optimizer == "dmuon":
            checks += (("muon_variant", "--muon-variant"),)
        for key, option in checks:
            if getattr(saved, key) not in (None, getattr(cfg, key)):
                raise ValueError(
                    f"checkpoint {path} was written with {option} {getattr(saved, key)}, this "
                    f"run has {option} {getattr(cfg, key)}. Resume with the same {option}, or "
                    f"start a new run from its weights with --init-from {path} --resume never."
                )
        if saved.step > cfg.steps:
            raise ValueError(
                f"checkpoint {path} is at step {saved.step}, past --steps {cfg.steps}. Raise "
                "--steps to continue it, or pass --resume never to start over."
            )
        geometry = (saved.global_batch_size, saved.seq_len)
        states = self.states()
        checkpoint_folder.load_checkpoint(path, **states, rank=self.trainer.rank)
        self.trainer.start_step = self.trainer.train_state.step
        self.trainer.resumed_from = path
        self.trainer._resumed_geometry = geometry
        # What this run was started with, not the checkpoint's (the note in `fit` says so).
        self.trainer.train_state.global_batch_size = self.trainer.sampler.global_batch_size
        self.trainer.train_state.seq_len = cfg.seq_len
        self.trainer.train_state.world_size = self.trainer.world_size

    def write_extra(self, folder: Path) -> None:
        """Rank 0's files of a checkpoint besides the states: the resolved settings
        (``config.toml``, readable by ``--config``) and the HF snapshot."""
        text = config_file.dump(self.trainer.config)
        (folder / config_file.CHECKPOINT_CONFIG_FILE).write_text(text, encoding="utf-8")
        self.write_hf_snapshot(folder)

    def write_hf_snapshot(self, folder: Path) -> None:
        """Write into ``folder/hf`` what an HF export needs besides the weights."""
        from dmuon.checkpoint._hf_export import KEYS_FILE

        hf = folder / contract.HF_SNAPSHOT_DIR
        hf.mkdir(exist_ok=True)
        config = {k: v for k, v in self.trainer.built.hf_config.items() if k != "use_cache"}
        (hf / contract.HF_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        if self.trainer.built.hf_keys:
            (hf / KEYS_FILE).write_text(
                json.dumps(self.trainer.built.hf_keys, indent=2), encoding="utf-8"
            )
        tokenizer = self.trainer.inputs.tokenizer
        if tokenizer is None:
            return
        try:
            tokenizer.save(hf)
        except ModuleNotFoundError as error:  # the byte tokenizer's files need the hf extra
            if not self._warned_tokenizer:
                self._warned_tokenizer = True
                print(
                    f"dmuon-train: warning: checkpoints hold no tokenizer files for an HF "
                    f"export ({error.name} is not installed; pip install -e "
                    "'packages/dmuon-core[hf]' adds them); the weights and config.json are "
                    "written as usual",
                    file=sys.stderr,
                    flush=True,
                )

    def save(self, step: int, elapsed: float) -> Path:
        """Write the checkpoint after ``step`` into ``--checkpoint-dir`` (a collective).

        ``elapsed`` is the training time so far, which a resumed run's ``time`` continues.
        """
        cfg = self.trainer.config
        if cfg.checkpoint_dir is None:
            raise ValueError("save needs --checkpoint-dir")
        self.trainer.train_state.step = step
        self.trainer.train_state.time = elapsed
        return checkpoint_folder.save_checkpoint(
            cfg.checkpoint_dir,
            step,
            **self.states(),
            rank=self.trainer.rank,
            barrier=self.trainer._barrier,
            keep=cfg.keep_checkpoints,
            write_extra=self.write_extra,
        )

    def export_hf(self, output: str | os.PathLike[str]) -> Path:
        """Write the model as a Hugging Face directory into ``output`` (a collective).

        Every rank contributes its part of the full weights; rank 0 writes them with the
        model's config, its tokenizer and a generation config
        (`dmuon.checkpoint._hf_export.save_hf_model`).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from dmuon.checkpoint._hf_export import save_hf_model

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = dmuon.get_model_state_dict(self.trainer.model, options=options)
        out = Path(output)
        if self.trainer.rank == 0:
            with tempfile.TemporaryDirectory() as scratch:
                self.write_hf_snapshot(Path(scratch))
                hf = Path(scratch) / contract.HF_SNAPSHOT_DIR
                config = json.loads((hf / contract.HF_CONFIG_FILE).read_text(encoding="utf-8"))
                save_hf_model(
                    {k: v.float() if v.is_floating_point() else v for k, v in weights.items()},
                    config,
                    out,
                    keys=self.trainer.built.hf_keys or None,
                    tokenizer_files=hf,
                )
        self.trainer._barrier()
        return out
