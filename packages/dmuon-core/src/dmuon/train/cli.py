"""Command line of the recipe: flags (kebab-case) and their validation.

``parse_args(argv)`` turns a list of flags into a `TrainConfig`; invalid values
exit with an argparse error that names the flag and what is allowed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from dmuon.train.checkpointing import CheckpointError, require_checkpoint
from dmuon.train.model import PRESETS

__all__ = [
    "TrainConfig",
    "build_parser",
    "parse_args",
]


ADAMW_BASELINE_LR = 1.5e-3
"""Peak rate of the ``adamw`` baseline when ``--adamw-lr`` is not given."""


@dataclass(frozen=True)
class TrainConfig:
    """All settings of a run; field names are the flag names with ``_`` for ``-``.

    ``lr`` is the Muon rate (used by ``optimizer="dmuon"`` only); ``adamw_lr`` is the
    AdamW rate: of the embedding, norms and ``lm_head`` under ``dmuon``, and of every
    parameter under the ``adamw`` baseline. Left at ``None`` it depends on the optimizer
    (`adamw_rate`). See `build_parser` for every field.
    """

    model: str = "small"
    data: str | None = None
    cache_dir: str | None = None
    val_fraction: float = 0.05
    steps: int = 60
    micro_batch_size: int = 4
    accum_steps: int = 1
    seq_len: int = 128
    lr: float = 0.02
    adamw_lr: float | None = None
    optimizer: str = "dmuon"
    ns_dtype: str = "auto"
    mode: str = "z3"
    hsdp: int = 1
    seed: int = 0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    eval_every: int = 20
    eval_sequences: int = 64
    metrics_file: str | None = None
    log_every: int = 1
    device: str = "auto"
    dtype: str = "float32"
    threads: int | None = None
    progress: str = "auto"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str = "auto"
    init_from: str | None = None

    @property
    def adamw_rate(self) -> float:
        """The peak AdamW rate of this run: ``adamw_lr`` when set, else the optimizer's default.

        Under ``dmuon`` the default is ``lr``: with ``dmuon.Muon``'s default update scale
        (``match_rms_adamw``) a Muon update has AdamW's RMS, so one rate suits both
        groups. Under the ``adamw`` baseline it is `ADAMW_BASELINE_LR`. Both defaults are
        the best rates of the quality sweep (``benchmarks/quality.py``).
        """
        if self.adamw_lr is not None:
            return self.adamw_lr
        return self.lr if self.optimizer == "dmuon" else ADAMW_BASELINE_LR

    @property
    def effective_lr(self) -> float:
        """The peak rate logged as ``lr``: ``lr`` (Muon) for dmuon, `adamw_rate` for adamw."""
        return self.lr if self.optimizer == "dmuon" else self.adamw_rate


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _open_fraction(text: str) -> float:
    value = _fraction(text)
    if value in (0.0, 1.0):
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {text}")
    return value


def _checkpoint_path(flag: str, *keywords: str) -> Callable[[str], str]:
    """A parser for ``flag``: one of ``keywords``, or a complete checkpoint folder."""

    def parse(text: str) -> str:
        if text in keywords:
            return text
        try:
            require_checkpoint(text, flag)
        except CheckpointError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``dmuon-train`` / ``python -m dmuon.train`` argument parser."""
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="dmuon-train",
        description=(
            "Train a byte-level Llama-style transformer with DMuon (or the AdamW "
            "baseline). Run directly for one process, or under "
            "`torchrun --standalone --nproc_per_node N -m dmuon.train` for N."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model and data")
    model.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=d.model,
        help="model preset (sizes in dmuon.train.PRESETS)",
    )
    model.add_argument(
        "--data",
        metavar="PATH",
        default=d.data,
        help="text file or folder; default: the Python standard library source",
    )
    model.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=d.cache_dir,
        help="tokenized-corpus cache; default $DMUON_CACHE_DIR or ~/.cache/dmuon",
    )
    model.add_argument(
        "--val-fraction",
        type=_open_fraction,
        default=d.val_fraction,
        help="share of files (bytes, for one file) held out for validation",
    )

    loop = p.add_argument_group("loop")
    loop.add_argument("--steps", type=_int_at_least(1), default=d.steps, help="optimizer steps")
    loop.add_argument(
        "--micro-batch-size",
        type=_int_at_least(1),
        default=d.micro_batch_size,
        help="sequences per micro-batch per process",
    )
    loop.add_argument(
        "--accum-steps",
        type=_int_at_least(1),
        default=d.accum_steps,
        help="micro-batches accumulated per optimizer step",
    )
    loop.add_argument(
        "--seq-len", type=_int_at_least(1), default=d.seq_len, help="tokens (bytes) per sequence"
    )
    loop.add_argument("--seed", type=int, default=d.seed, help="initialization and data-order seed")
    loop.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=d.device,
        help="auto = cuda if available, else cpu",
    )
    loop.add_argument(
        "--threads",
        type=_int_at_least(1),
        default=d.threads,
        help="intra-op CPU threads per process; default: OMP_NUM_THREADS if set, else "
        "the available cores divided by the local process count",
    )
    loop.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default=d.dtype,
        help="parameter and compute dtype (float64 for exactness checks)",
    )

    opt = p.add_argument_group("optimizer")
    opt.add_argument(
        "--optimizer",
        choices=("dmuon", "adamw"),
        default=d.optimizer,
        help="dmuon = DMuon on 2-D Linear weights + AdamW on the rest; "
        "adamw = torch.optim.AdamW on everything (the baseline)",
    )
    opt.add_argument(
        "--mode",
        choices=("z2", "z3"),
        default=d.mode,
        help="sharding mode of DMuon and FSDP2: z3 reshards parameters after forward, "
        "z2 keeps them resident until the optimizer step",
    )
    opt.add_argument(
        "--hsdp",
        type=_int_at_least(1),
        default=d.hsdp,
        metavar="R",
        help="replicate degree of an HSDP (replicate, shard) mesh: R replicas of "
        "world_size / R shards each (usually R = number of nodes); 1 = a 1-D mesh",
    )
    opt.add_argument(
        "--ns-dtype",
        choices=("auto", "float32", "bfloat16"),
        default=d.ns_dtype,
        help="Newton-Schulz dtype of dmuon; auto = bfloat16 on CUDA and on CPUs that "
        "multiply it natively (AMX-BF16, AVX512-BF16), float32 elsewhere",
    )
    opt.add_argument(
        "--lr",
        type=_positive_float,
        default=d.lr,
        help="peak Muon learning rate of the dedicated matrices (dmuon only)",
    )
    opt.add_argument(
        "--adamw-lr",
        type=_positive_float,
        default=d.adamw_lr,
        help="peak AdamW rate: embeddings, norms and lm_head under dmuon; every "
        f"parameter under the adamw baseline; default: --lr under dmuon, "
        f"{ADAMW_BASELINE_LR:g} under adamw",
    )
    opt.add_argument(
        "--warmup-steps",
        type=_int_at_least(0),
        default=d.warmup_steps,
        help="linear warmup steps, then cosine decay to min-lr-ratio x peak",
    )
    opt.add_argument(
        "--min-lr-ratio",
        type=_fraction,
        default=d.min_lr_ratio,
        help="final learning rate as a fraction of the peak",
    )
    opt.add_argument(
        "--clip-grad",
        type=_non_negative_float,
        default=d.clip_grad,
        help="clip the global gradient norm to this value (0 disables); the logged "
        "grad_norm is the norm before clipping",
    )

    out = p.add_argument_group("evaluation and output")
    out.add_argument(
        "--eval-every",
        type=_int_at_least(0),
        default=d.eval_every,
        help="evaluate at step 0, every N steps and at the end; 0 = never",
    )
    out.add_argument(
        "--eval-sequences",
        type=_int_at_least(1),
        default=d.eval_sequences,
        help="fixed validation windows per evaluation",
    )
    out.add_argument(
        "--metrics-file",
        metavar="PATH",
        default=d.metrics_file,
        help="append one JSON object per optimizer step here (rank 0)",
    )
    out.add_argument(
        "--log-every",
        type=_int_at_least(1),
        default=d.log_every,
        help="print every N steps when not showing a progress bar",
    )
    out.add_argument(
        "--progress",
        choices=("auto", "bar", "plain"),
        default=d.progress,
        help="auto = a tqdm bar on a terminal, plain lines otherwise",
    )

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=d.checkpoint_dir,
        help="write checkpoints here (step_NNNNNNNN folders); a final one is always "
        "written at the end and on SIGTERM/SIGINT",
    )
    ckpt.add_argument(
        "--checkpoint-every",
        type=_int_at_least(0),
        metavar="N",
        default=d.checkpoint_every,
        help="also checkpoint every N steps (needs --checkpoint-dir); 0 = only at the end",
    )
    ckpt.add_argument(
        "--keep-checkpoints",
        type=_int_at_least(0),
        metavar="K",
        default=d.keep_checkpoints,
        help="keep the newest K complete checkpoints in --checkpoint-dir; 0 keeps all",
    )
    ckpt.add_argument(
        "--resume",
        type=_checkpoint_path("--resume", "auto", "never"),
        metavar="{auto,never,PATH}",
        default=d.resume,
        help="auto = continue from the latest checkpoint in --checkpoint-dir if there is "
        "one; never = start fresh; PATH = continue from that checkpoint",
    )
    ckpt.add_argument(
        "--init-from",
        type=_checkpoint_path("--init-from"),
        metavar="PATH",
        default=d.init_from,
        help="start from the weights of this checkpoint (optimizer, schedule and step "
        "start fresh); an error if --resume also finds a checkpoint",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse flags into a `TrainConfig` (exits with status 2 on a bad value)."""
    parser = build_parser()
    namespace = parser.parse_args(None if argv is None else list(argv))
    if namespace.checkpoint_every > 0 and namespace.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir (where to write checkpoints)")
    if namespace.init_from is not None and namespace.resume not in ("auto", "never"):
        parser.error(
            "--init-from and --resume PATH both give a starting point: --resume PATH "
            "continues a run (weights, optimizer, step), --init-from starts a new one "
            "from weights only; pass one of them"
        )
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(namespace).items() if k in names})
