"""The training loop: the three-line DMuon integration, accumulation, evaluation, export.

The pieces live apart, as in torchtitan: the model builders in `dmuon.train.models`
(presets and Hugging Face directories), the data in `dmuon.train.data`, process group,
mesh, dedication, ``fully_shard`` and the optimizer in `dmuon.train.parallelize`, the
trainer's state as ``Stateful`` objects in `dmuon.train.state`, checkpoint folders in
`dmuon.train.checkpointing`. One code path serves one process (no process group,
``dedicate_params(model, None)``) and ``torchrun`` (gloo on CPU, NCCL on CUDA).

Every input a user can get wrong (the model directory, the tokenizer, the data, the
export folder) is checked before the process group exists and before any file is
written (`preflight`). The corpus is tokenized by local rank 0 of each node while the
other ranks wait for its cache.

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

import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import torch
import torch.distributed as dist

import dmuon
from dmuon._teardown import before_interpreter_exit
from dmuon.train import checkpointing
from dmuon.train.cli import TrainConfig, parse_args
from dmuon.train.data import (
    CorpusPlan,
    GlobalBatchSampler,
    check_fits,
    load_tokenizer,
    plan_corpus,
    validation_windows,
)
from dmuon.train.data.sources import list_source_files
from dmuon.train.data.tokenizer import TextTokenizer
from dmuon.train.metrics import ProgressReporter, format_summary, truncate_after
from dmuon.train.models import BuiltModel, ModelSource, build, lm_loss, resolve_model
from dmuon.train.parallelize import (
    build_mesh,
    build_optimizer,
    check_hsdp_degree,
    init_distributed,
    parallelize,
)
from dmuon.train.reporting import Reporting
from dmuon.train.samples import greedy_continuation, prompt_ids
from dmuon.train.schedules import lr_factor
from dmuon.train.state import ModelState, OptimizerState, RNGState, TrainState
from dmuon.train.stopping import StopRequest

__all__ = [
    "Inputs",
    "StepFailed",
    "Trainer",
    "TrainingDiverged",
    "check_hsdp_degree",
    "configure_threads",
    "lr_lambda",
    "preflight",
    "run",
]

#: Dense bfloat16 peak TFLOP/s of one device, by a part of its CUDA name, for ``mfu``.
KNOWN_PEAK_TFLOPS: dict[str, float] = {"H100": 989.0, "H200": 989.0, "B200": 2250.0,
                                       "A100": 312.0}  # fmt: skip


#: The recipe's dtype names (``auto`` is absent: the library's default).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StepFailed(RuntimeError):
    """An optimizer step failed on this rank; the message names the step and the rank."""


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
    """Multiplier for ``LambdaLR``: linear warmup, then cosine decay to ``min_ratio`` (the
    default ``--lr-schedule``; see `dmuon.train.schedules`)."""
    return lr_factor("cosine", warmup_steps, total_steps, min_ratio)


@dataclass
class Inputs:
    """The checked inputs of a run (see `preflight`)."""

    model: ModelSource
    tokenizer: TextTokenizer | None
    corpus: CorpusPlan


def preflight(config: TrainConfig) -> Inputs:
    """Check every input a user can get wrong, before any process group or file exists.

    The model (a preset, or a model directory transformers builds, with enough positions
    for ``--seq-len``), the tokenizer (loads, has an EOS token, fits the model's
    embedding), the data (exists, readable formats, links inside its folder, token files
    with their sidecars and a vocabulary that fits) and the export folder.

    Raises:
        FileNotFoundError, ValueError: with a message naming the flag, the file and what
            to do.
    """
    source = resolve_model(config.model, config.seq_len)
    if config.export_hf is not None:
        from dmuon.checkpoint._hf_export import check_export_target

        check_export_target(config.export_hf)
    model_dir = None if source.hf is None else source.hf.path
    # Token files need no tokenizer; a model directory without one still trains on them.
    _, files = list_source_files(config.data)
    needs_tokenizer = files[0].kind != "tokens"
    tokenizer: TextTokenizer | None
    try:
        tokenizer = load_tokenizer(config.tokenizer, model_dir)
    except ValueError:
        if needs_tokenizer or config.tokenizer is not None:
            raise
        if config.sample_every > 0:
            raise ValueError(
                "--sample-every writes text, and these token files come without a tokenizer: "
                "pass --tokenizer (the one the files were made with)"
            ) from None
        tokenizer = None
    plan = plan_corpus(
        config.data,
        val_fraction=config.val_fraction,
        cache_dir=config.cache_dir,
        tokenizer=tokenizer,
        text_field=config.text_field,
    )
    if plan.cache_bin is not None:
        if not plan.is_cached:
            plan.check_records()  # a missing text field, before any process group
        if tokenizer is None:
            tokenizer = load_tokenizer(config.tokenizer, model_dir)  # raises its error
        what = (
            f"--tokenizer {tokenizer.name}"
            if config.tokenizer
            else f"the tokenizer {tokenizer.name}"
        )
        check_fits(tokenizer.vocab_size, source.vocab_size, what, config.model)
    else:
        from dmuon.train.data.sources import read_sidecar

        for f in (*plan.train, *plan.val):
            info = read_sidecar(f.path, f.relative)
            check_fits(info.vocab_size, source.vocab_size, f"token file {f.relative}", config.model)
    return Inputs(source, tokenizer, plan)


def _peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's allocator peak, else the peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class Trainer:
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
        self.threads = configure_threads(env.local_world_size, config.threads)

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

        # Same seed on every rank: identical weights before sharding.
        self.built: BuiltModel = build(
            self.inputs.model,
            seed=config.seed,
            seq_len=config.seq_len,
            device=self.device,
            dtype=getattr(torch, config.dtype),
        )
        model = self.built.module
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = self.built.flops_per_token(config.seq_len)
        self.mesh = build_mesh(env, replicas)
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
            reduce_dtype=_DTYPES.get(config.reduce_dtype),
            broadcast_dtype=_DTYPES.get(config.broadcast_dtype),
        )
        # One process has no FSDP2 to cast with: bfloat16 compute is torch.autocast.
        self._autocast = param_dtype is not None and self.mesh is None
        self.model = model

        self.lr = config.effective_lr  # the rate logged as ``lr``
        self.optimizer = build_optimizer(
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
        self._lr_factor = lr_factor(
            config.lr_schedule,
            config.warmup_steps,
            config.steps,
            config.min_lr_ratio,
            config.decay_fraction,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
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
        self._restore()

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

    def _states(self) -> dict[str, Any]:
        return {
            "distributed": {
                "model": ModelState(self.model),
                "optim": OptimizerState(self.model, self.optimizer),
            },
            "rank_zero": {"train": self.train_state, "scheduler": self.scheduler},
            "rng": RNGState(self.device),
        }

    def _restore(self) -> None:
        """Resume from a checkpoint or take initial weights, as the flags say."""
        cfg = self.config
        if cfg.checkpoint_dir is not None and self.rank == 0:
            checkpointing.remove_incomplete(cfg.checkpoint_dir)  # saves cut short
        if cfg.resume == "never":
            target = None
        elif cfg.resume == "auto":
            target = self._latest_verified() if cfg.checkpoint_dir is not None else None
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
            checkpointing.load_checkpoint(
                cfg.init_from, distributed={"model": ModelState(self.model)}
            )

    def _latest_verified(self) -> Path | None:
        """The newest checkpoint whose files match its manifest, found on rank 0 (it reads
        every file once) and told to the other ranks; damaged ones are reported."""
        assert self.config.checkpoint_dir is not None
        found: list[Path | None] = [None]
        if self.rank == 0:

            def damaged(path: Path, problems: list[str]) -> None:
                text = f"skipping damaged checkpoint {path}: " + "; ".join(problems)
                print(f"dmuon-train: warning: {text}", file=sys.stderr, flush=True)
                self.notes.append(
                    {
                        contract.EVENT_KEY: contract.CHECKPOINT_SKIPPED_EVENT,
                        "checkpoint": str(path),
                        "problems": problems,
                    }
                )

            found[0] = checkpointing.latest_checkpoint(self.config.checkpoint_dir, damaged)
        if self.distributed:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def _resume(self, path: Path) -> None:
        cfg = self.config
        saved = TrainState()
        saved.load_state_dict(checkpointing.read_trainer_state(path)["train"])
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
        states = self._states()
        checkpointing.load_checkpoint(path, **states, rank=self.rank)
        self.start_step = self.train_state.step
        self.resumed_from = path
        self._resumed_geometry = geometry
        # What this run was started with, not the checkpoint's (the note in `fit` says so).
        self.train_state.global_batch_size = self.sampler.global_batch_size
        self.train_state.seq_len = cfg.seq_len
        self.train_state.world_size = self.world_size

    def _write_hf_snapshot(self, folder: Path) -> None:
        """Write into ``folder/hf`` what an HF export needs besides the weights."""
        from dmuon.checkpoint._hf_export import KEYS_FILE

        hf = folder / contract.HF_SNAPSHOT_DIR
        hf.mkdir(exist_ok=True)
        config = {k: v for k, v in self.built.hf_config.items() if k != "use_cache"}
        (hf / contract.HF_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        if self.built.hf_keys:
            (hf / KEYS_FILE).write_text(json.dumps(self.built.hf_keys, indent=2), encoding="utf-8")
        if self.inputs.tokenizer is not None:
            self.inputs.tokenizer.save(hf)

    def _guarded_step(self, step: int) -> dict[str, Any]:
        """`train_step`, with a failure (a collective that timed out because another process
        died or stalled, say) raised as `StepFailed` naming the step, the rank and the timeout."""
        try:
            return self.train_step(step)
        except (TrainingDiverged, StepFailed):
            raise
        except RuntimeError as error:
            where = f"step {step} failed on rank {self.rank} of {self.world_size}"
            hint = ""
            if self.distributed:
                hint = (
                    f". A collective waits --collective-timeout {self.config.collective_timeout}"
                    " s for every process: if another process died or stalled, its own output"
                    " (or the lack of it) says which"
                )
            raise StepFailed(f"{where}: {type(error).__name__}: {error}{hint}") from error

    def save_checkpoint(self, step: int, elapsed: float) -> Path:
        """Write the checkpoint after ``step`` into ``--checkpoint-dir`` (a collective).

        ``elapsed`` is the training time so far, which a resumed run's ``time`` continues.
        """
        cfg = self.config
        if cfg.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs --checkpoint-dir")
        self.train_state.step = step
        self.train_state.time = elapsed
        return checkpointing.save_checkpoint(
            cfg.checkpoint_dir,
            step,
            **self._states(),
            rank=self.rank,
            barrier=self._barrier,
            keep=cfg.keep_checkpoints,
            write_extra=self._write_hf_snapshot,
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
        weights = dmuon.get_model_state_dict(self.model, options=options)
        out = Path(output)
        if self.rank == 0:
            with tempfile.TemporaryDirectory() as scratch:
                self._write_hf_snapshot(Path(scratch))
                hf = Path(scratch) / contract.HF_SNAPSHOT_DIR
                config = json.loads((hf / contract.HF_CONFIG_FILE).read_text(encoding="utf-8"))
                save_hf_model(
                    {k: v.float() if v.is_floating_point() else v for k, v in weights.items()},
                    config,
                    out,
                    keys=self.built.hf_keys or None,
                    tokenizer_files=hf,
                )
        self._barrier()
        return out

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _no_sync(self) -> AbstractContextManager[Any]:
        # dmuon.no_sync covers dedicated matrices and FSDP2 modules alike, so the AdamW
        # baseline (FSDP2 alone) accumulates through the same call.
        return dmuon.no_sync(self.model)

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
            with ctx:
                loss = self.loss(micro) / accum_steps
                loss.backward()
            loss_sum += loss.detach()
            if not is_accumulating:
                grad_norm = self.grad_norm()
                if not math.isfinite(grad_norm):  # the same all-reduced value on every rank
                    raise TrainingDiverged(step, "gradient norm", grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
                self.scheduler.step()
        shared = torch.zeros(2 + self.world_size, dtype=torch.float64, device=self.device)
        shared[0] = loss_sum
        shared[1] = 1.0 if self.stop.requested else 0.0
        shared[2 + self.rank] = float(_peak_memory_bytes(self.device))
        reduced = self._all_reduce_sum(shared).cpu()
        mean_loss = float(reduced[0] / self.world_size)
        if not math.isfinite(mean_loss):
            raise TrainingDiverged(step, "loss", mean_loss)
        return {
            "loss": mean_loss,
            "lr": lr,
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
        is_main = self.rank == 0
        if is_main and cfg.metrics_file is not None and self.start_step > 0:
            truncate_after(cfg.metrics_file, self.start_step)
        writer = Reporting.open(
            cfg, is_main=is_main, resume=self.train_state.trackers, start_step=self.start_step
        )
        if is_main:  # saved with every checkpoint, so that a resumed run continues them
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
        bar = {"auto": None, "bar": True, "plain": False}[cfg.progress]
        progress = ProgressReporter(
            cfg.steps,
            enabled=is_main,
            use_bar=bar,
            log_every=cfg.log_every,
            initial=self.start_step,
        )
        progress.message(self._describe())
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
        exported: Path | None = None
        stopped = False
        peak_memory: list[int] = []
        time_offset = self.train_state.time
        t0 = time.perf_counter()

        def elapsed() -> float:
            return time_offset + time.perf_counter() - t0

        try:
            with self.stop:
                if cfg.eval_every > 0 and self.start_step == 0:
                    start_val = end_val = self.evaluate()
                    writer.write({"step": 0, "time": elapsed(), "val_loss": start_val})
                    progress.message(f"step 0 val_loss {start_val:.4f}")
                for step in range(self.start_step + 1, cfg.steps + 1):
                    stats = self._guarded_step(step)
                    train_seconds += stats["seconds"]
                    loss = stats["loss"]
                    last_step = step
                    peak_memory = stats["peak_memory_bytes"]
                    stopping = stats["stop"] > 0 and step < cfg.steps  # else: done anyway
                    tokens_per_s = self.tokens_per_step / stats["seconds"]
                    record: dict[str, Any] = {
                        "step": step,
                        "loss": loss,
                        "lr": stats["lr"],
                        "tokens_per_s": tokens_per_s,
                        "grad_norm": stats["grad_norm"],
                        "peak_memory_bytes": peak_memory,
                    }
                    report = getattr(self.optimizer, "qk_clip_report", None)
                    if report is not None:
                        record["max_logit"] = report.max_logit
                        record["qk_clipped_heads"] = report.clipped_heads
                    if self.peak_flops is not None:
                        achieved = self.flops_per_token * tokens_per_s
                        record["mfu"] = achieved / (self.peak_flops * self.world_size)
                    if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                        end_val = self.evaluate()
                        record["val_loss"] = end_val
                        progress.message(f"step {step} val_loss {end_val:.4f}")
                    record["time"] = elapsed()
                    writer.write(record)
                    progress.step(step, loss, tokens_per_s, stats["lr"])
                    if cfg.sample_every > 0 and (step % cfg.sample_every == 0 or step == cfg.steps):
                        text = self.sample()
                        writer.write(
                            {
                                contract.EVENT_KEY: contract.SAMPLE_EVENT,
                                "step": step,
                                "prompt": cfg.sample_prompt,
                                "text": text,
                            }
                        )
                        writer.text(step, "sample", cfg.sample_prompt + text)
                        progress.message(f"step {step} sample: {cfg.sample_prompt + text!r}")
                    periodic = cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0
                    if cfg.checkpoint_dir is not None and (
                        periodic or stopping or step == cfg.steps
                    ):
                        try:
                            checkpoint = self.save_checkpoint(step, elapsed())
                        except checkpointing.CheckpointWriteError as error:
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
                    if stopping:
                        writer.write(
                            {
                                contract.EVENT_KEY: contract.STOPPED_EVENT,
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
                if cfg.export_hf is not None and not stopped and last_step == cfg.steps:
                    exported = self.export_hf(cfg.export_hf)
                    writer.artifact(exported, "model")
                    progress.message(f"exported a Hugging Face model directory to {exported}")
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
            "peak_memory_bytes": peak_memory,
            "start_step": self.start_step,
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
            "stopped_by": (self.stop.signal_name or "signal") if stopped else None,
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "export": None if exported is None else str(exported),
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
        # cycles. Collect them now, while the interpreter is whole, and let gloo's worker
        # threads finish: one that drops its last tensor during interpreter teardown aborts
        # the process (see dmuon._teardown; the AdamW baseline registers no exit handler).
        del trainer
        before_interpreter_exit()
