"""One optimizer step, evaluation and samples: the compute side of the recipe's trainer.

`TrainingSteps` is a base of `dmuon.train.loop.Trainer` holding what runs the model: the
gradient-accumulation loop of the gradient-accumulation guide (each micro-batch's loss
divided by ``accum_steps``, every micro-batch but the last under ``dmuon.no_sync``, then
``optimizer.step()``, ``zero_grad()`` and the scheduler), the global gradient norm, the
token-weighted validation loss, and greedy samples. The logged loss is the mean over the
global batch: each rank's accumulated ``sum(loss / accum_steps)`` is all-reduced with SUM
and divided by the world size. The attributes it reads (``model``, ``optimizer``, ...)
are the `Trainer`'s, set up by it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import dmuon
from dmuon.train.machine import peak_memory_bytes
from dmuon.train.models import lm_loss
from dmuon.train.profiling import phase
from dmuon.train.samples import greedy_continuation, prompt_ids

__all__ = ["StepFailed", "TrainingDiverged", "TrainingSteps"]

T = TypeVar("T")


class StepFailed(RuntimeError):
    """A step of training failed on this rank: the optimizer step, or the evaluation,
    sample, checkpoint or export that follows it (a collective that timed out, say). The
    message names which, the step and the rank."""


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}. Lower --lr / "
            "--adamw-lr, raise --warmup-steps, or resume from an earlier checkpoint."
        )
        self.step = step


class TrainingSteps:
    """The steps, evaluation and samples of a `dmuon.train.loop.Trainer`."""

    # Set by the Trainer.
    config: Any
    model: Any
    built: Any
    optimizer: Any
    scheduler: Any
    sampler: Any
    inputs: Any
    stop: Any
    device: torch.device
    rank: int
    world_size: int
    distributed: bool
    lr: float
    val_windows: torch.Tensor
    _lr_factor: Any
    _autocast: bool

    def _guarded(self, what: str, phase: Callable[..., T], *args: Any) -> T:
        """``phase(*args)``, with a failure (a collective that timed out because another
        process died or stalled, say) raised as `StepFailed` naming ``what`` ("step 3",
        "the checkpoint of step 4", ...), the rank and the timeout."""
        try:
            return phase(*args)
        except (TrainingDiverged, StepFailed):
            raise
        except RuntimeError as error:
            where = f"{what} failed on rank {self.rank} of {self.world_size}"
            hint = ""
            if self.distributed:
                hint = (
                    f". A collective waits --collective-timeout {self.config.collective_timeout}"
                    " s for every process: if another process died or stalled, its own output"
                    " (or the lack of it) says which"
                )
            raise StepFailed(f"{where}: {type(error).__name__}: {error}{hint}") from error

    def _no_sync(self) -> AbstractContextManager[Any]:
        # dmuon.no_sync covers dedicated matrices and FSDP2 modules alike, so the AdamW
        # baseline (FSDP2 alone) accumulates through the same call.
        return dmuon.no_sync(self.model)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            # not audited: the recipe's loss and token counts for its metrics
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

    def _compute(self) -> AbstractContextManager[Any]:
        if self._autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of windows ``tokens`` (batch, seq_len + 1)."""
        with self._compute():
            logits = self.built.logits(tokens[:, :-1])
        return lm_loss(logits, tokens[:, 1:])

    def train_step(self, step: int) -> dict[str, Any]:
        """Run optimizer step ``step`` (1-based): accumulate, step, schedule.

        Returns ``loss`` (global-batch mean), ``lr`` (the logged rate for this step),
        ``adamw_lr`` (under dmuon: AdamW's scheduled rate for the other parameters),
        ``grad_norm``, ``seconds`` (wall time of the step), ``stop`` (1.0 when any rank
        was asked to stop; the flag rides on the loss all-reduce, so all ranks agree) and
        ``peak_memory_bytes`` (every rank's peak so far, index = rank; the same
        all-reduce).
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
            with ctx, phase("forward_backward"):
                loss = self.loss(micro) / accum_steps
                loss.backward()
            loss_sum += loss.detach()
            if not is_accumulating:
                grad_norm = self.grad_norm()
                if not math.isfinite(grad_norm):  # the same all-reduced value on every rank
                    raise TrainingDiverged(step, "gradient norm", grad_norm)
                with phase("optimizer_step"):
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                self.scheduler.step()
        shared = torch.zeros(2 + self.world_size, dtype=torch.float64, device=self.device)
        shared[0] = loss_sum
        shared[1] = 1.0 if self.stop.requested else 0.0
        shared[2 + self.rank] = float(peak_memory_bytes(self.device))
        reduced = self._all_reduce_sum(shared).cpu()
        mean_loss = float(reduced[0] / self.world_size)
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(step, "loss", mean_loss)
        factor = self._lr_factor(step - 1)
        return {
            "loss": mean_loss,
            "lr": lr,
            "adamw_lr": self.config.adamw_rate * factor
            if self.config.optimizer == "dmuon"
            else None,
            "grad_norm": grad_norm,
            "seconds": time.perf_counter() - start,
            "stop": 1.0 if float(reduced[1]) > 0 else 0.0,
            "peak_memory_bytes": [int(v) for v in reduced[2:].tolist()],
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean validation loss over the fixed windows, on every rank."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        windows = self.val_windows.to(self.device)
        for chunk in windows.split(self.config.micro_batch_size):
            with self._compute():
                logits = self.built.logits(chunk[:, :-1])
            sums[0] += lm_loss(logits, chunk[:, 1:], reduction="sum").double()
            sums[1] += chunk[:, 1:].numel()
        self.model.train()
        self._all_reduce_sum(sums)
        return float(sums[0] / sums[1])

    @torch.no_grad()
    def sample(self) -> str:
        """The text the model writes after ``--sample-prompt`` (greedy, ``--sample-tokens``
        tokens), on every rank (the forwards gather weights collectively)."""
        cfg = self.config
        tokenizer = self.inputs.tokenizer
        assert tokenizer is not None  # preflight refuses --sample-every without one
        encoded = [int(i) for i in tokenizer.encode_batch([cfg.sample_prompt])[0]]
        prompt = prompt_ids(encoded, cfg.sample_tokens, cfg.seq_len)
        self.model.eval()
        try:
            with self._compute():
                ids = greedy_continuation(self.built.logits, prompt, cfg.sample_tokens, self.device)
        finally:
            self.model.train()
        return tokenizer.decode(ids)
