"""The training loop: process group, the three-line DMuon integration, accumulation, eval.

One code path serves one process (no process group, ``dedicate_params(model, None)``) and
``torchrun`` (gloo on CPU, NCCL on CUDA):

```python
z3 = mode == "z3"
dmuon.dedicate_params(model, mesh, reshard_after_forward=z3)  # dmuon only
for layer in model.layers:                                    # when world_size > 1
    fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
fully_shard(model, mesh=mesh, reshard_after_forward=z3)
optimizer = dmuon.Muon(model, lr=..., adamw_lr=...)
```

Gradient accumulation follows the gradient-accumulation guide: the loss of each
micro-batch is divided by ``accum_steps`` and every micro-batch but the last runs under
``dmuon.no_sync(model)``; ``optimizer.step()`` and ``optimizer.zero_grad()`` follow the
last one. (The AdamW baseline, which has no dedicated parameters, uses FSDP2's own
``set_requires_gradient_sync(False)`` in the same place.)

The logged loss is the mean over the global batch: each rank's accumulated
``sum(loss / accum_steps)`` is all-reduced with SUM and divided by the world size. Data
order is defined on the global batch (see `dmuon.train.data`), so runs with the
same global batch see the same sequences whatever the process count.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon.train import checkpointing
from dmuon.train.cli import TrainConfig, parse_args
from dmuon.train.data import GlobalBatchSampler, load_corpus, validation_windows
from dmuon.train.metrics import MetricsWriter, ProgressReporter, format_summary, truncate_after
from dmuon.train.model import build_model, lm_loss
from dmuon.train.stopping import StopRequest

__all__ = ["Trainer", "TrainingDiverged", "configure_threads", "lr_lambda", "run"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}. Lower --lr / "
            "--adamw-lr, raise --warmup-steps, or resume from an earlier checkpoint."
        )
        self.step = step


def check_hsdp_degree(replicas: int, world_size: int) -> int:
    """Validate ``--hsdp R`` against the number of processes; return ``R``.

    Raises:
        ValueError: ``R`` does not divide the world size.
    """
    if world_size % replicas != 0:
        raise ValueError(
            f"--hsdp {replicas} needs a number of processes divisible by {replicas}, but "
            f"this run has {world_size} (torchrun's --nnodes x --nproc-per-node). Pass "
            "--hsdp R with R dividing the process count, usually R = the number of nodes, "
            "or --hsdp 1 for a 1-D mesh."
        )
    return replicas


def configure_threads(local_world_size: int, threads: int | None = None) -> int:
    """Set the intra-op thread count of this process and return it.

    ``threads`` wins when given. Otherwise, unless ``OMP_NUM_THREADS`` is set, the CPU
    cores available to the process are split evenly among the local processes.
    (``torchrun`` sets ``OMP_NUM_THREADS=1`` itself when it starts several processes.)
    """
    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not available on macOS
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, local_world_size)))
    return torch.get_num_threads()


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier for ``LambdaLR``: linear warmup, then cosine decay to ``min_ratio``.

    ``LambdaLR`` calls it with the number of completed steps ``i`` (0 for the first
    optimizer step): warmup gives ``(i + 1) / warmup_steps`` for ``i < warmup_steps``;
    then the factor follows ``min_ratio + (1 - min_ratio) * (1 + cos(pi * t)) / 2`` with
    ``t`` going from 0 to 1 over the remaining steps.
    """

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps - 1)
        t = min(1.0, (i - warmup_steps) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return factor


@contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


class Trainer:
    """A prepared run: process group, model, optimizer, schedule, data, metrics.

    Create it, call `train_step` for steps ``1..steps`` and `evaluate`
    as needed, then `close`; or call `fit` (what `run` does).

    Attributes:
        config: the settings.
        rank, world_size: this process and the process count (1 without torchrun).
        device: where the model runs.
        model: the (possibly dedicated and sharded) transformer.
        optimizer: ``dmuon.Muon`` or ``torch.optim.AdamW``.
        sampler: the global-batch sampler.
        start_step: the step the run continues from (0, or the resumed checkpoint's).
        resumed_from: the checkpoint the run resumed from, or None.
        stop: the stop request (SIGTERM/SIGINT while `fit` runs, or ``stop.request``).
    """

    def __init__(self, config: TrainConfig) -> None:
        """Set up everything; initializes the process group when ``WORLD_SIZE`` > 1.

        If setup fails, what was changed (threads, process group) is undone first.
        """
        self.config = config
        self.stop = StopRequest()
        self.start_step = 0
        self.resumed_from: Path | None = None
        self._time_offset = 0.0  # seconds of training before the resumed checkpoint
        self._resumed_geometry: tuple[Any, Any] = (None, None)  # its global batch, seq-len
        self._owns_process_group = False
        self._threads_before = torch.get_num_threads()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        config = self.config
        world_env = int(os.environ.get("WORLD_SIZE", "1"))
        if world_env > 1 and not dist.is_initialized():
            backend = "nccl" if self._want_cuda() else "gloo"
            dist.init_process_group(backend)
            self._owns_process_group = True
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.distributed = self.world_size > 1
        replicas = check_hsdp_degree(config.hsdp, self.world_size)
        self.threads = configure_threads(
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")), config.threads
        )

        if self._want_cuda():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

        self.corpus = load_corpus(
            config.data, val_fraction=config.val_fraction, cache_dir=config.cache_dir
        )
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

        # Same seed on every rank: identical weights before sharding.
        model = build_model(
            config.model,
            seed=config.seed,
            max_seq_len=config.seq_len,
            device=self.device,
            dtype=getattr(torch, config.dtype),
        )
        self.num_params = sum(p.numel() for p in model.parameters())
        self.mesh = None
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            if replicas > 1:
                # HSDP: replicas across nodes, FSDP2 and DMuon's owners within each.
                self.mesh = init_device_mesh(
                    self.device.type,
                    (replicas, self.world_size // replicas),
                    mesh_dim_names=("replicate", "shard"),
                )
            else:
                self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.dedicated: dict[str, int] = {}
        z3 = config.mode == "z3"
        if config.optimizer == "dmuon":
            self.dedicated = dmuon.dedicate_params(model, self.mesh, reshard_after_forward=z3)
        if self.distributed:
            from torch.distributed.fsdp import fully_shard

            # The same mode for FSDP2's parameters, or Z2 would still all-gather them
            # before every backward.
            for layer in model.layers:
                fully_shard(layer, mesh=self.mesh, reshard_after_forward=z3)
            fully_shard(model, mesh=self.mesh, reshard_after_forward=z3)
        self.model = model

        self.lr = config.effective_lr  # the rate logged as ``lr``
        self.optimizer: torch.optim.Optimizer
        if config.optimizer == "dmuon":
            ns_dtype = None if config.ns_dtype == "auto" else getattr(torch, config.ns_dtype)
            self.optimizer = dmuon.Muon(
                model, lr=config.lr, adamw_lr=config.adamw_rate, ns_dtype=ns_dtype
            )
        else:
            # The baseline: AdamW on everything, with the hyperparameters DMuon's
            # AdamW groups use by default.
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=config.adamw_rate,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
            )
        self._lr_factor = lr_lambda(config.warmup_steps, config.steps, config.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.tokens_per_step = self.sampler.global_batch_size * config.seq_len
        self._restore()

    def _restore(self) -> None:
        """Resume from a checkpoint or take initial weights, as the flags say."""
        cfg = self.config
        if cfg.checkpoint_dir is not None and self.rank == 0:
            checkpointing.remove_incomplete(cfg.checkpoint_dir)  # saves cut short
        if cfg.resume == "never":
            target = None
        elif cfg.resume == "auto":
            target = (
                checkpointing.latest_checkpoint(cfg.checkpoint_dir)
                if cfg.checkpoint_dir is not None
                else None
            )
        else:
            target = checkpointing.require_checkpoint(cfg.resume, "--resume")
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
            checkpointing.load_weights(cfg.init_from, self.model)

    def _resume(self, path: Path) -> None:
        cfg = self.config
        state = checkpointing.read_trainer_state(path)
        step = int(state["step"])
        for key, flag in (("model", "--model"), ("optimizer", "--optimizer")):
            if state.get(key) not in (None, getattr(cfg, key)):
                raise ValueError(
                    f"checkpoint {path} was written with {flag} {state[key]}, this run has "
                    f"{flag} {getattr(cfg, key)}. Resume with the same {flag}, or start a "
                    f"new run from its weights with --init-from {path} --resume never."
                )
        if step > cfg.steps:
            raise ValueError(
                f"checkpoint {path} is at step {step}, past --steps {cfg.steps}. Raise "
                "--steps to continue it, or pass --resume never to start over."
            )
        checkpointing.load_training_state(
            path, self.model, self.optimizer, rank=self.rank, device=self.device
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.start_step = step
        self.resumed_from = path
        self._time_offset = float(state.get("time", 0.0))
        self._resumed_geometry = (state.get("global_batch_size"), state.get("seq_len"))

    def save_checkpoint(self, step: int, elapsed: float) -> Path:
        """Write the checkpoint after ``step`` into ``--checkpoint-dir`` (a collective).

        ``elapsed`` is the training time so far, which a resumed run's ``time`` continues.
        """
        cfg = self.config
        if cfg.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs --checkpoint-dir")
        trainer_state = {
            "scheduler": self.scheduler.state_dict(),
            "time": elapsed,
            "model": cfg.model,
            "optimizer": cfg.optimizer,
            "global_batch_size": self.sampler.global_batch_size,
            "seq_len": cfg.seq_len,
            "world_size": self.world_size,
        }
        return checkpointing.save_checkpoint(
            cfg.checkpoint_dir,
            step,
            self.model,
            self.optimizer,
            trainer_state,
            rank=self.rank,
            barrier=self._barrier,
            device=self.device,
            keep=cfg.keep_checkpoints,
        )

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _want_cuda(self) -> bool:
        if self.config.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda was given but no CUDA device is available")
            return True
        return self.config.device == "auto" and torch.cuda.is_available()

    def _no_sync(self) -> AbstractContextManager[Any]:
        if self.config.optimizer == "dmuon":
            return dmuon.no_sync(self.model)
        if self.distributed:
            return _fsdp_no_sync(self.model)
        return nullcontext()

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients, clipped to ``--clip-grad`` if set.

        A collective: call it on every rank. Returns the norm before clipping.
        `dmuon.clip_grad_norm_` serves both optimizers: it counts dedicated gradients on
        their owners and FSDP2 shards once each (the AdamW baseline has only the latter).
        """
        max_norm = self.config.clip_grad if self.config.clip_grad > 0 else math.inf
        return float(dmuon.clip_grad_norm_(self.model, max_norm))

    def train_step(self, step: int) -> dict[str, float]:
        """Run optimizer step ``step`` (1-based): accumulate, step, schedule.

        Returns ``loss`` (global-batch mean), ``lr`` (the logged rate for this step),
        ``grad_norm``, ``seconds`` (wall time of the step) and ``stop`` (1.0 when any rank
        was asked to stop; the flag rides on the loss all-reduce, so all ranks agree).
        """
        accum_steps = self.config.accum_steps
        start = time.perf_counter()
        lr = self.lr * self._lr_factor(step - 1)
        batch = self.sampler.rank_batch(step, self.rank).to(self.device)
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        grad_norm = float("nan")
        # The gradient-accumulation guide's loop, over this step's micro-batches.
        for i, micro in enumerate(batch):
            is_accumulating = (i + 1) % accum_steps != 0
            ctx = self._no_sync() if is_accumulating else nullcontext()
            with ctx:
                loss = lm_loss(self.model(micro[:, :-1]), micro[:, 1:]) / accum_steps
                loss.backward()
            loss_sum += loss.detach()
            if not is_accumulating:
                grad_norm = self.grad_norm()
                if not math.isfinite(grad_norm):  # the same all-reduced value on every rank
                    raise TrainingDiverged(step, "gradient norm", grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
                self.scheduler.step()
        stop_flag = torch.full_like(loss_sum, 1.0 if self.stop.requested else 0.0)
        reduced = self._all_reduce_sum(torch.stack([loss_sum, stop_flag]))
        mean_loss = float(reduced[0] / self.world_size)
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(step, "loss", mean_loss)
        return {
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "seconds": time.perf_counter() - start,
            "stop": 1.0 if float(reduced[1]) > 0 else 0.0,
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean validation loss over the fixed windows, on every rank."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        windows = self.val_windows.to(self.device)
        for chunk in windows.split(self.config.micro_batch_size):
            logits = self.model(chunk[:, :-1])
            sums[0] += lm_loss(logits, chunk[:, 1:], reduction="sum").double()
            sums[1] += chunk[:, 1:].numel()
        self.model.train()
        self._all_reduce_sum(sums)
        return float(sums[0] / sums[1])

    def fit(self) -> dict[str, Any]:
        """Train steps ``start_step + 1 .. config.steps`` with eval, metrics, checkpoints.

        Returns a summary. SIGTERM or SIGINT while it runs (or ``stop.request``) ends it
        after the current step with a checkpoint (with ``--checkpoint-dir``) and a
        ``{"event": "stopped", ...}`` metrics line; the summary then has ``stopped_by``.
        """
        cfg = self.config
        is_main = self.rank == 0
        if is_main and cfg.metrics_file is not None and self.start_step > 0:
            truncate_after(cfg.metrics_file, self.start_step)
        writer = MetricsWriter(cfg.metrics_file if is_main else None)
        bar = {"auto": None, "bar": True, "plain": False}[cfg.progress]
        progress = ProgressReporter(
            cfg.steps,
            enabled=is_main,
            use_bar=bar,
            log_every=cfg.log_every,
            initial=self.start_step,
        )
        progress.message(
            f"dmuon.train: model {cfg.model} ({self.num_params / 1e6:.2f} M params), "
            f"optimizer {cfg.optimizer}"
            + (f" {cfg.mode} ({len(self.dedicated)} dedicated)" if cfg.optimizer == "dmuon" else "")
            + f", {self.world_size} process(es) x {self.threads} thread(s) on {self.device.type}, "
            f"global batch {self.sampler.global_batch_size} x {cfg.seq_len} tokens "
            f"(micro-batch {cfg.micro_batch_size}, accumulation {cfg.accum_steps}), "
            f"data {self.corpus.source} ({self.corpus.train.numel() / 1e6:.1f} M train / "
            f"{self.corpus.val.numel() / 1e6:.2f} M val bytes)"
        )
        if self.resumed_from is not None:
            progress.message(f"resumed from {self.resumed_from} (step {self.start_step})")
            geometry = (self.sampler.global_batch_size, cfg.seq_len)
            if self._resumed_geometry != geometry:
                progress.message(
                    f"note: the checkpoint was written with global batch x seq-len "
                    f"{self._resumed_geometry}, this run uses {geometry}: the batches "
                    "differ from those of an uninterrupted run"
                )
        start_val: float | None = None
        end_val: float | None = None
        loss = float("nan")
        train_seconds = 0.0
        last_step = self.start_step
        checkpoint: Path | None = None
        stopped = False
        t0 = time.perf_counter()

        def elapsed() -> float:
            return self._time_offset + time.perf_counter() - t0

        try:
            with self.stop:
                if cfg.eval_every > 0 and self.start_step == 0:
                    start_val = end_val = self.evaluate()
                    writer.write({"step": 0, "time": elapsed(), "val_loss": start_val})
                    progress.message(f"step 0 val_loss {start_val:.4f}")
                for step in range(self.start_step + 1, cfg.steps + 1):
                    stats = self.train_step(step)
                    train_seconds += stats["seconds"]
                    loss = stats["loss"]
                    last_step = step
                    stopping = stats["stop"] > 0 and step < cfg.steps  # else: done anyway
                    tokens_per_s = self.tokens_per_step / stats["seconds"]
                    record: dict[str, Any] = {
                        "step": step,
                        "loss": loss,
                        "lr": stats["lr"],
                        "tokens_per_s": tokens_per_s,
                        "grad_norm": stats["grad_norm"],
                    }
                    if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                        end_val = self.evaluate()
                        record["val_loss"] = end_val
                        progress.message(f"step {step} val_loss {end_val:.4f}")
                    record["time"] = elapsed()
                    writer.write(record)
                    progress.step(step, loss, tokens_per_s, stats["lr"])
                    periodic = cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0
                    if cfg.checkpoint_dir is not None and (
                        periodic or stopping or step == cfg.steps
                    ):
                        checkpoint = self.save_checkpoint(step, elapsed())
                    if stopping:
                        writer.write(
                            {
                                "event": "stopped",
                                "step": step,
                                "signal": self.stop.signal_name,
                                "checkpoint": None if checkpoint is None else str(checkpoint),
                            }
                        )
                        progress.message(
                            f"stopped by {self.stop.signal_name or 'a signal on another rank'}"
                            f" after step {step}"
                        )
                        stopped = True
                        break
        finally:
            progress.close()
            writer.close()
        steps_run = last_step - self.start_step
        summary: dict[str, Any] = {
            "steps": last_step,
            "final_loss": loss,
            "start_val_loss": start_val,
            "end_val_loss": end_val,
            "wall_time_s": time.perf_counter() - t0,
            "train_time_s": train_seconds,
            "tokens": self.tokens_per_step * steps_run,
            "tokens_per_s": self.tokens_per_step * steps_run / max(train_seconds, 1e-9),
            "world_size": self.world_size,
            "optimizer": cfg.optimizer,
            "model": cfg.model,
            "params": self.num_params,
            "start_step": self.start_step,
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
            "stopped_by": (self.stop.signal_name or "signal") if stopped else None,
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "config": asdict(cfg),
        }
        progress.message(format_summary(summary))
        return summary

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
        # cycles. Collect them now, while the interpreter is whole: a gloo worker thread
        # that drops its last tensor during interpreter teardown aborts the process.
        del trainer
        gc.collect()
