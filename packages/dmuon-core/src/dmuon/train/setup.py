"""What a run settles before its model exists: the checked inputs, threads, and the
errors a step raises.

`preflight` checks every input a user can get wrong (the model directory, the tokenizer,
the data, the export folder) before the process group exists and before any file is
written; `configure_threads` splits the CPU cores among the local processes.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dmuon.train.cli import TrainConfig
from dmuon.train.data import CorpusPlan, check_fits, load_tokenizer, plan_corpus
from dmuon.train.data.sources import list_source_files
from dmuon.train.data.tokenizer import TextTokenizer
from dmuon.train.models import ModelSource, resolve_model
from dmuon.train.schedules import lr_factor

__all__ = [
    "DTYPES",
    "KNOWN_PEAK_TFLOPS",
    "Inputs",
    "StepFailed",
    "TrainingDiverged",
    "configure_threads",
    "lr_lambda",
    "peak_memory_bytes",
    "preflight",
]

#: Dense bfloat16 peak TFLOP/s of one device, by a part of its CUDA name, for ``mfu``.
KNOWN_PEAK_TFLOPS: dict[str, float] = {"H100": 989.0, "H200": 989.0, "B200": 2250.0,
                                       "A100": 312.0}  # fmt: skip


#: The recipe's dtype names (``auto`` is absent: the library's default).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's allocator peak, else the peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
