"""The training loop: the three-line DMuon integration, accumulation, evaluation, export.

The pieces live apart, as in torchtitan: the model builders in `dmuon.train.models`
(presets and Hugging Face directories), the data in `dmuon.train.data`, process group,
mesh, dedication, ``fully_shard`` and the optimizer in `dmuon.train.parallelize`, the
checked inputs in `dmuon.train.preflight`, threads and peak memory in
`dmuon.train.machine`, the steps in `dmuon.train.steps`, checkpoints in
`dmuon.train.checkpoints` (what, where, when), everything reported in
`dmuon.train.reporting`, samples in `dmuon.train.samples`. One code path serves one
process (no process group, ``dedicate_params(model, None)``) and ``torchrun`` (gloo on
CPU, NCCL on CUDA).

Every input a user can get wrong (the model directory, the tokenizer, the data, the
export folder) is checked before the process group exists and before any file is
written (`dmuon.train.preflight.preflight`). The corpus is tokenized by local rank 0 of each
node while the other ranks wait for its cache.

Gradient accumulation follows the gradient-accumulation guide: the loss of each
micro-batch is divided by ``accum_steps`` and every micro-batch but the last runs under
``dmuon.no_sync(model)`` (on the AdamW baseline it turns FSDP2's gradient sync off the
same way); ``optimizer.step()`` and ``optimizer.zero_grad()`` follow the last one.

The logged loss is the mean over the global batch: each rank's accumulated
``sum(loss / accum_steps)`` is all-reduced with SUM and divided by the world size. Data
order is defined on the global batch (see `dmuon.train.data.sampler`), so runs with the
same global batch see the same sequences whatever the process count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import torch
import torch.distributed as dist
from torch import nn

from dmuon._teardown import before_interpreter_exit
from dmuon.train.checkpoints import folder as checkpoint_folder
from dmuon.train.checkpoints.manager import CheckpointManager
from dmuon.train.checkpoints.stateful import TrainState
from dmuon.train.cli import TrainConfig, parse_args
from dmuon.train.data import (
    GlobalBatchSampler,
    validation_windows,
)
from dmuon.train.machine import DTYPES, KNOWN_PEAK_TFLOPS, configure_threads
from dmuon.train.models import BuiltModel, build
from dmuon.train.parallelize import (
    build_mesh,
    build_optimizer,
    check_hsdp_degree,
    check_ns_split,
    init_distributed,
    parallelize,
)
from dmuon.train.preflight import Inputs, preflight
from dmuon.train.profiling import StepProfiler
from dmuon.train.reporting.console import ProgressReporter, format_summary
from dmuon.train.reporting.metrics_file import truncate_after
from dmuon.train.reporting.reporters import DEFAULT_TRACKING_DIR, Reporting
from dmuon.train.schedules import lr_factor, lr_lambda
from dmuon.train.steps import StepFailed, TrainingDiverged, TrainingSteps
from dmuon.train.stopping import StopRequest

__all__ = [
    "Inputs",
    "StepFailed",
    "Trainer",
    "TrainingDiverged",
    "check_hsdp_degree",
    "check_ns_split",
    "configure_threads",
    "lr_lambda",
    "preflight",
    "run",
]


@dataclass
class _Run:
    """What one `Trainer.fit` call has done so far (its summary's figures)."""

    last_step: int
    started: float
    start_val: float | None = None
    end_val: float | None = None
    loss: float = float("nan")
    train_seconds: float = 0.0
    checkpoint: Path | None = None
    exported: Path | None = None
    stopped: bool = False
    peak_memory: list[int] = field(default_factory=list)


class Trainer(TrainingSteps):
    """A prepared run: process group, model, optimizer, schedule, data, metrics.

    Create it, call `train_step` for steps ``1..steps`` and `evaluate`
    as needed, then `close`; or call `fit` (what `run` does).

    Attributes:
        config: the settings.
        inputs: the checked inputs (`preflight`).
        rank, world_size: this process and the process count (1 without torchrun).
        device: where the model runs.
        built: the `BuiltModel` (its ``module`` is ``model``).
        model: the (possibly dedicated and sharded) model.
        optimizer: ``dmuon.Muon`` or ``torch.optim.AdamW``.
        sampler: the global-batch sampler.
        train_state: the `TrainState` (step, time) checkpoints hold.
        start_step: the step the run continues from (0, or the resumed checkpoint's).
        resumed_from: the checkpoint the run resumed from, or None.
        stop: the stop request (SIGTERM/SIGINT while `fit` runs, or ``stop.request``).
    """

    def __init__(self, config: TrainConfig) -> None:
        """Check the inputs, then set everything up (the process group when ``WORLD_SIZE``
        > 1). If setup fails, what was changed (threads, process group) is undone first.
        """
        self.config = config
        self.stop = StopRequest()
        self.start_step = 0
        self.resumed_from: Path | None = None
        #: Events for the metrics file noticed before it is open (a damaged checkpoint).
        self.notes: list[dict[str, Any]] = []
        self._resumed_geometry: tuple[Any, Any] = (None, None)
        self._threads_before = torch.get_num_threads()
        self._owns_process_group = False
        self.inputs = preflight(config)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        config = self.config
        env = init_distributed(config.device, config.collective_timeout)
        self._owns_process_group = env.owns_process_group
        self.env = env
        self.rank, self.world_size, self.device = env.rank, env.world_size, env.device
        self.distributed = env.distributed
        replicas = check_hsdp_degree(config.hsdp, self.world_size)
        check_ns_split(config.ns_split, self.world_size, replicas)
        self.threads = configure_threads(env.local_world_size, config.threads)
        self._setup_data()
        self.mesh = build_mesh(env, replicas)
        self._setup_model()
        self.lr = config.effective_lr  # the rate logged as ``lr``
        self.optimizer, self._lr_factor, self.scheduler = _optimizer_and_schedule(
            self.model, config
        )
        self.tokens_per_step = self.sampler.global_batch_size * config.seq_len
        self.train_state = TrainState(
            model=config.model,
            optimizer=config.optimizer,
            muon_variant=config.muon_variant if config.optimizer == "dmuon" else None,
            global_batch_size=self.sampler.global_batch_size,
            seq_len=config.seq_len,
            world_size=self.world_size,
        )
        self.peak_flops = self._peak_flops()
        self.checkpoints = CheckpointManager(self)
        self.checkpoints.restore()

    def _setup_data(self) -> None:
        """The corpus, the global batch sampler and this rank's validation windows."""
        config = self.config
        self.corpus = self._load_corpus()
        self.sampler = GlobalBatchSampler(
            self.corpus.train,
            seq_len=config.seq_len,
            micro_batch_size=config.micro_batch_size,
            accum_steps=config.accum_steps,
            world_size=self.world_size,
            seed=config.seed,
        )
        self.val_windows = validation_windows(
            self.corpus.val,
            seq_len=config.seq_len,
            num_sequences=config.eval_sequences,
            world_size=self.world_size,
            rank=self.rank,
        )

    def _setup_model(self) -> None:
        """Build, dedicate, shard and materialise the model on this rank."""
        config = self.config
        # Same seed on every rank: identical weights. Distributed, the model is built on the
        # meta device, dedicated and sharded there, then given its weights: a preset's one
        # layer at a time, a Hugging Face model's from rank 0, which alone builds it whole.
        self.built: BuiltModel = build(
            self.inputs.model,
            seed=config.seed,
            seq_len=config.seq_len,
            device=self.device,
            dtype=getattr(torch, config.dtype),
            meta=self.mesh is not None,
        )
        model = self.built.module
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = self.built.flops_per_token(config.seq_len)
        param_dtype = torch.bfloat16 if config.param_dtype == "bfloat16" else None
        self.dedicated = parallelize(
            model,
            self.built.layers,
            self.mesh,
            optimizer=config.optimizer,
            mode=config.mode,
            param_dtype=param_dtype,
            activation_checkpointing=config.activation_checkpointing,
            compile=config.compile,
            reduce_dtype=DTYPES.get(config.reduce_dtype),
            broadcast_dtype=DTYPES.get(config.broadcast_dtype),
            ns_split=config.ns_split,
        )
        self.built.materialize(self.device, config.seed)
        # One process has no FSDP2 to cast with: bfloat16 compute is torch.autocast.
        self._autocast = param_dtype is not None and self.mesh is None
        self.model = model

    def _load_corpus(self) -> Any:
        """Tokenize on local rank 0 while the node's other ranks wait for its cache."""
        plan = self.inputs.corpus
        bar = {"auto": None, "bar": True, "plain": False}[self.config.progress]
        builder = self.env.local_rank == 0
        if self.distributed:
            if builder:
                plan.clear_error()
            self._barrier()  # no rank reads an earlier build's error
        if builder:
            plan.build(bar if self.rank == 0 else False)
        else:
            plan.wait()
        self._barrier()
        return plan.open()

    def _peak_flops(self) -> float | None:
        if self.config.peak_tflops is not None:
            return self.config.peak_tflops * 1e12
        if self.device.type == "cuda" and self.config.param_dtype == "bfloat16":
            name = torch.cuda.get_device_name(self.device)
            for part, tflops in KNOWN_PEAK_TFLOPS.items():
                if part in name:
                    return tflops * 1e12
        return None

    def save_checkpoint(self, step: int, elapsed: float) -> Path:
        """Write the checkpoint after ``step`` into ``--checkpoint-dir`` (a collective);
        ``elapsed`` is the training time so far (`CheckpointManager.save`)."""
        return self.checkpoints.save(step, elapsed)

    def export_hf(self, output: str | os.PathLike[str]) -> Path:
        """Write the model as a Hugging Face directory into ``output`` (a collective;
        `CheckpointManager.export_hf`)."""
        return self.checkpoints.export_hf(output)

    def _barrier(self) -> None:
        if self.distributed:
            # not audited: the recipe waits for every rank's files, it moves no tensor
            dist.barrier()

    def _describe(self) -> str:
        cfg = self.config
        corpus = self.corpus
        tokenizer = self.inputs.tokenizer
        extras = [
            f"param dtype {cfg.param_dtype}" if cfg.param_dtype != "float32" else "",
            "activation checkpointing" if cfg.activation_checkpointing else "",
            "compiled layers" if cfg.compile else "",
        ]
        return (
            f"dmuon.train: model {cfg.model} ({self.num_params / 1e6:.2f} M params, "
            f"{len(self.built.layers)} layers), optimizer {cfg.optimizer}"
            + (f" {cfg.mode} ({len(self.dedicated)} dedicated)" if cfg.optimizer == "dmuon" else "")
            + f", {self.world_size} process(es) x {self.threads} thread(s) on {self.device.type}"
            + "".join(f", {e}" for e in extras if e)
            + f", global batch {self.sampler.global_batch_size} x {cfg.seq_len} tokens "
            f"(micro-batch {cfg.micro_batch_size}, accumulation {cfg.accum_steps}), "
            f"data {corpus.source} ({corpus.train.numel() / 1e6:.2f} M train / "
            f"{corpus.val.numel() / 1e6:.3f} M val tokens, tokenizer "
            f"{tokenizer.name if tokenizer is not None else 'none (token files)'})"
        )

    def fit(self) -> dict[str, Any]:
        """Train steps ``start_step + 1 .. config.steps`` with eval, metrics, checkpoints.

        Returns a summary. SIGTERM or SIGINT while it runs (or ``stop.request``) ends it
        after the current step with a checkpoint (with ``--checkpoint-dir``) and a
        ``{"event": "stopped", ...}`` metrics line; the summary then has ``stopped_by``.
        With ``--export-hf`` a run that reaches ``--steps`` ends with the export.
        """
        cfg = self.config
        if self.rank == 0 and cfg.metrics_file is not None and self.start_step > 0:
            truncate_after(cfg.metrics_file, self.start_step)
        progress = ProgressReporter(
            cfg.steps,
            enabled=self.rank == 0,
            use_bar={"auto": None, "bar": True, "plain": False}[cfg.progress],
            log_every=cfg.log_every,
            initial=self.start_step,
        )
        writer = self._open_reporting(progress)
        self._announce(progress)
        run = _Run(last_step=self.start_step, started=time.perf_counter())
        time_offset = self.train_state.time
        tracking = Path(cfg.tracking_dir or DEFAULT_TRACKING_DIR)
        profiler = StepProfiler(
            cfg.profile_steps, tracking, self.rank, self.device, cfg.memory_snapshot
        )

        def elapsed() -> float:
            return time_offset + time.perf_counter() - run.started

        try:
            with self.stop:
                if cfg.eval_every > 0 and self.start_step == 0:
                    run.start_val = run.end_val = self._guarded(
                        "the evaluation of step 0", self.evaluate
                    )
                    writer.write({"step": 0, "time": elapsed(), "val_loss": run.start_val})
                for step in range(self.start_step + 1, cfg.steps + 1):
                    profiler.before(step)
                    stats = self._guarded(f"step {step}", self.train_step, step)
                    if profiled := profiler.after(step):
                        progress.message(profiled)
                    stopping = self._record_step(step, stats, run, writer, elapsed)
                    if self._after_step(step, stopping, run, writer, progress, elapsed):
                        break
                if cfg.export_hf is not None and not run.stopped and run.last_step == cfg.steps:
                    run.exported = self._guarded(
                        f"the export after step {run.last_step}", self.export_hf, cfg.export_hf
                    )
                    writer.artifact(run.exported, "model")
                    progress.message(f"exported a Hugging Face model directory to {run.exported}")
        finally:
            profiler.close()
            progress.close()
            writer.close()
        summary = _summary(self, run)
        progress.message(format_summary(summary))
        return summary

    def _open_reporting(self, progress: ProgressReporter) -> Reporting:
        """The metrics file and trackers, with what a resumed run carries over written."""
        writer = Reporting.open(
            self.config,
            is_main=self.rank == 0,
            resume=self.train_state.trackers,
            start_step=self.start_step,
            progress=progress,
        )
        if self.rank == 0:  # saved with every checkpoint, so that a resumed run continues them
            self.train_state.trackers = writer.ids()
            if self.train_state.trackers:
                writer.write(
                    {
                        contract.EVENT_KEY: contract.TRACKERS_EVENT,
                        "step": self.start_step,
                        "trackers": self.train_state.trackers,
                    }
                )
        for note in self.notes:  # at the step resumed from, so that a later resume keeps it
            writer.write({**note, "step": self.start_step})
        return writer

    def _announce(self, progress: ProgressReporter) -> None:
        """Say what runs, and where a resumed run comes from."""
        progress.message(self._describe())
        if self.resumed_from is None:
            return
        progress.message(f"resumed from {self.resumed_from} (step {self.start_step})")
        geometry = (self.sampler.global_batch_size, self.config.seq_len)
        if self._resumed_geometry != geometry:
            progress.message(
                f"note: the checkpoint was written with global batch x seq-len "
                f"{self._resumed_geometry}, this run uses {geometry}: the batches "
                "differ from those of an uninterrupted run"
            )

    def _record_step(
        self,
        step: int,
        stats: dict[str, Any],
        run: _Run,
        writer: Reporting,
        elapsed: Callable[[], float],
    ) -> bool:
        """Write the step's metrics line (its evaluation too, when due); whether a stop
        was asked for before the last step."""
        cfg = self.config
        run.train_seconds += stats["seconds"]
        run.loss = stats["loss"]
        run.last_step = step
        run.peak_memory = stats["peak_memory_bytes"]
        tokens_per_s = self.tokens_per_step / stats["seconds"]
        record: dict[str, Any] = {
            "step": step,
            "loss": run.loss,
            "lr": stats["lr"],
            **({"adamw_lr": stats["adamw_lr"]} if stats["adamw_lr"] is not None else {}),
            "tokens_per_s": tokens_per_s,
            "grad_norm": stats["grad_norm"],
            "peak_memory_bytes": run.peak_memory,
        }
        report = getattr(self.optimizer, "qk_clip_report", None)
        if report is not None:
            record["max_logit"] = report.max_logit
            record["qk_clipped_heads"] = report.clipped_heads
        if self.peak_flops is not None:
            achieved = self.flops_per_token * tokens_per_s
            record["mfu"] = achieved / (self.peak_flops * self.world_size)
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
            run.end_val = self._guarded(f"the evaluation of step {step}", self.evaluate)
            record["val_loss"] = run.end_val
        record["time"] = elapsed()
        writer.write(record)
        return stats["stop"] > 0 and step < cfg.steps  # at the last step: done anyway

    def _after_step(
        self,
        step: int,
        stopping: bool,
        run: _Run,
        writer: Reporting,
        progress: ProgressReporter,
        elapsed: Callable[[], float],
    ) -> bool:
        """The step's sample and checkpoint when due, and its stop when asked; whether
        training stops here."""
        cfg = self.config
        if cfg.sample_every > 0 and (step % cfg.sample_every == 0 or step == cfg.steps):
            text = self._guarded(f"the sample of step {step}", self.sample)
            writer.write(
                {
                    contract.EVENT_KEY: contract.SAMPLE_EVENT,
                    "step": step,
                    "prompt": cfg.sample_prompt,
                    "text": text,
                }
            )
            writer.text(step, "sample", cfg.sample_prompt + text)
        periodic = cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0
        if cfg.checkpoint_dir is not None and (periodic or stopping or step == cfg.steps):
            try:
                run.checkpoint = self._guarded(
                    f"the checkpoint of step {step}", self.save_checkpoint, step, elapsed()
                )
            except checkpoint_folder.CheckpointWriteError as error:
                writer.write(
                    {
                        contract.EVENT_KEY: contract.CHECKPOINT_FAILED_EVENT,
                        "step": step,
                        "message": error.strerror,
                    }
                )
                if cfg.on_checkpoint_error != "warn":
                    raise
                progress.warning(f"{error.strerror}; training goes on")
        if not stopping:
            return False
        writer.write(
            {
                contract.EVENT_KEY: contract.STOPPED_EVENT,
                "step": step,
                "signal": self.stop.signal_name,
                "checkpoint": None if run.checkpoint is None else str(run.checkpoint),
            }
        )
        progress.message(
            f"stopped by {self.stop.signal_name or 'a signal on another rank'} after step {step}"
        )
        run.stopped = True
        return True

    def close(self) -> None:
        """Restore the thread count; destroy the process group if this trainer created it."""
        torch.set_num_threads(self._threads_before)
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False


def run(args: Sequence[str] | TrainConfig | None = None) -> dict[str, Any]:
    """Run the recipe from flags (a list like ``["--steps", "10"]``) or a config.

    ``None`` reads ``sys.argv``. Returns the summary dict (``steps`` (the last step
    reached), ``final_loss``, ``start_val_loss``, ``end_val_loss``, ``wall_time_s``,
    ``train_time_s``, ``tokens``, ``tokens_per_s``, ``world_size``, ``optimizer``,
    ``model``, ``params``, ``start_step``, ``resumed_from``, ``stopped_by``,
    ``checkpoint``, ``config``); non-zero ranks get the same losses but print and write
    nothing.
    """
    config = args if isinstance(args, TrainConfig) else parse_args(args)
    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        # The model, FSDP2 and DMuon keep the process group alive through reference
        # cycles. Collect them now, while the interpreter is whole, and let gloo's worker
        # threads finish: one that drops its last tensor during interpreter teardown aborts
        # the process (see dmuon._teardown; the AdamW baseline registers no exit handler).
        del trainer
        before_interpreter_exit()


def _summary(trainer: Trainer, run: _Run) -> dict[str, Any]:
    """What `Trainer.fit` returns (and prints)."""
    steps_run = run.last_step - trainer.start_step
    return {
        "steps": run.last_step,
        "final_loss": run.loss,
        "start_val_loss": run.start_val,
        "end_val_loss": run.end_val,
        "wall_time_s": time.perf_counter() - run.started,
        "train_time_s": run.train_seconds,
        "tokens": trainer.tokens_per_step * steps_run,
        "tokens_per_s": trainer.tokens_per_step * steps_run / max(run.train_seconds, 1e-9),
        "world_size": trainer.world_size,
        "optimizer": trainer.config.optimizer,
        "model": trainer.config.model,
        "params": trainer.num_params,
        "peak_memory_bytes": run.peak_memory,
        "start_step": trainer.start_step,
        "resumed_from": None if trainer.resumed_from is None else str(trainer.resumed_from),
        "stopped_by": (trainer.stop.signal_name or "signal") if run.stopped else None,
        "checkpoint": None if run.checkpoint is None else str(run.checkpoint),
        "export": None if run.exported is None else str(run.exported),
        "config": asdict(trainer.config),
    }


def _optimizer_and_schedule(
    model: nn.Module, config: TrainConfig
) -> tuple[torch.optim.Optimizer, Callable[[int], float], torch.optim.lr_scheduler.LambdaLR]:
    """The run's optimizer, its learning-rate factor per step, and the scheduler applying it."""
    optimizer = build_optimizer(
        model,
        optimizer=config.optimizer,
        lr=config.lr,
        adamw_lr=config.adamw_rate,
        ns_dtype=config.ns_dtype,
        variant=config.muon_variant,
        weight_decay=config.weight_decay,
        adamw_weight_decay=config.adamw_weight_decay,
        momentum=config.momentum,
        adamw_betas=(config.adamw_beta1, config.adamw_beta2),
        split=config.split,
        qk_clip=config.qk_clip,
    )
    factor = lr_factor(
        config.lr_schedule,
        config.warmup_steps,
        config.steps,
        config.min_lr_ratio,
        config.decay_fraction,
    )
    return optimizer, factor, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
