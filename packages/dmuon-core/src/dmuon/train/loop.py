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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon.train.cli import TrainConfig, parse_args
from dmuon.train.data import GlobalBatchSampler, load_corpus, validation_windows
from dmuon.train.metrics import MetricsWriter, ProgressReporter, format_summary
from dmuon.train.model import build_model, lm_loss

__all__ = ["Trainer", "TrainingDiverged", "configure_threads", "lr_lambda", "run"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}. Lower --lr / "
            "--adamw-lr, raise --warmup-steps, or resume from an earlier checkpoint."
        )
        self.step = step


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
    """

    def __init__(self, config: TrainConfig) -> None:
        """Set up everything; initializes the process group when ``WORLD_SIZE`` > 1.

        If setup fails, what was changed (threads, process group) is undone first.
        """
        self.config = config
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
            self.optimizer = dmuon.Muon(model, lr=config.lr, adamw_lr=config.adamw_lr)
        else:
            # The baseline: AdamW on everything, with the hyperparameters DMuon's
            # AdamW groups use by default.
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=config.adamw_lr,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
            )
        self._lr_factor = lr_lambda(config.warmup_steps, config.steps, config.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.tokens_per_step = self.sampler.global_batch_size * config.seq_len

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
        ``grad_norm`` and ``seconds`` (wall time of the step).
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
        mean_loss = float(self._all_reduce_sum(loss_sum) / self.world_size)
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(step, "loss", mean_loss)
        return {
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "seconds": time.perf_counter() - start,
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
        """Train for ``config.steps`` steps with eval, metrics and progress; return a summary."""
        cfg = self.config
        is_main = self.rank == 0
        writer = MetricsWriter(cfg.metrics_file if is_main else None)
        bar = {"auto": None, "bar": True, "plain": False}[cfg.progress]
        progress = ProgressReporter(
            cfg.steps, enabled=is_main, use_bar=bar, log_every=cfg.log_every
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
        start_val: float | None = None
        end_val: float | None = None
        loss = float("nan")
        train_seconds = 0.0
        t0 = time.perf_counter()
        try:
            if cfg.eval_every > 0:
                start_val = end_val = self.evaluate()
                writer.write({"step": 0, "time": time.perf_counter() - t0, "val_loss": start_val})
                progress.message(f"step 0 val_loss {start_val:.4f}")
            for step in range(1, cfg.steps + 1):
                stats = self.train_step(step)
                train_seconds += stats["seconds"]
                loss = stats["loss"]
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
                record["time"] = time.perf_counter() - t0
                writer.write(record)
                progress.step(step, loss, tokens_per_s, stats["lr"])
        finally:
            progress.close()
            writer.close()
        summary: dict[str, Any] = {
            "steps": cfg.steps,
            "final_loss": loss,
            "start_val_loss": start_val,
            "end_val_loss": end_val,
            "wall_time_s": time.perf_counter() - t0,
            "train_time_s": train_seconds,
            "tokens": self.tokens_per_step * cfg.steps,
            "tokens_per_s": self.tokens_per_step * cfg.steps / max(train_seconds, 1e-9),
            "world_size": self.world_size,
            "optimizer": cfg.optimizer,
            "model": cfg.model,
            "params": self.num_params,
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

    ``None`` reads ``sys.argv``. Returns the summary dict (``steps``, ``final_loss``,
    ``start_val_loss``, ``end_val_loss``, ``wall_time_s``, ``train_time_s``, ``tokens``,
    ``tokens_per_s``, ``world_size``, ``optimizer``, ``model``, ``params``, ``config``);
    non-zero ranks get the same losses but print and write nothing.
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
