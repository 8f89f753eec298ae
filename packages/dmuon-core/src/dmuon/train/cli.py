"""Command line of the recipe: flags (kebab-case) and their validation.

The flags themselves (spellings, types, defaults, choices, bounds, help) are defined once,
in the torch-free contract module `dmuon_recipe_contract` that the job service builds
from too; this module turns them into an ``argparse`` parser and a `TrainConfig`.
``parse_args(argv)`` returns a `TrainConfig`; invalid values exit with an argparse error
that names the flag and what is allowed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dmuon_recipe_contract import ADAMW_LR, FLAGS, MUON_ONLY_FLAGS, PRESETS, Flag, flag

from dmuon.train import config_file
from dmuon.train.reporting.trackers import resolve_report_to

__all__ = [
    "ADAMW_LR",
    "TrainConfig",
    "build_parser",
    "parse_args",
]


def _default(dest: str) -> Any:
    return flag(dest).default


@dataclass(frozen=True)
class TrainConfig:
    """All settings of a run; field names are the flag names with ``_`` for ``-``.

    Defaults come from `dmuon_recipe_contract.FLAGS`. ``lr`` is the Muon rate (used by
    ``optimizer="dmuon"`` only); ``adamw_lr`` is the AdamW rate: of the embedding, norms
    and ``lm_head`` under ``dmuon``, and of every parameter under the ``adamw`` baseline.
    Set to ``None`` it is `ADAMW_LR` (`adamw_rate`). ``model`` is a preset
    name or the path of a Hugging Face model directory. See `build_parser` for every
    field.
    """

    model: str = _default("model")
    tokenizer: str | None = _default("tokenizer")
    data: str | None = _default("data")
    text_field: str = _default("text_field")
    cache_dir: str | None = _default("cache_dir")
    val_fraction: float = _default("val_fraction")
    steps: int = _default("steps")
    micro_batch_size: int = _default("micro_batch_size")
    accum_steps: int = _default("accum_steps")
    seq_len: int = _default("seq_len")
    seed: int = _default("seed")
    device: str = _default("device")
    threads: int | None = _default("threads")
    collective_timeout: int = _default("collective_timeout")
    dtype: str = _default("dtype")
    param_dtype: str = _default("param_dtype")
    activation_checkpointing: bool = _default("activation_checkpointing")
    compile: bool = _default("compile")
    peak_tflops: float | None = _default("peak_tflops")
    optimizer: str = _default("optimizer")
    mode: str = _default("mode")
    hsdp: int = _default("hsdp")
    ns_split: int = _default("ns_split")
    reduce_dtype: str = _default("reduce_dtype")
    broadcast_dtype: str = _default("broadcast_dtype")
    ns_dtype: str = _default("ns_dtype")
    muon_variant: str = _default("muon_variant")
    lr: float = _default("lr")
    adamw_lr: float | None = _default("adamw_lr")
    warmup_steps: int = _default("warmup_steps")
    min_lr_ratio: float = _default("min_lr_ratio")
    lr_schedule: str = _default("lr_schedule")
    decay_fraction: float = _default("decay_fraction")
    weight_decay: float = _default("weight_decay")
    adamw_weight_decay: float = _default("adamw_weight_decay")
    momentum: float = _default("momentum")
    adamw_beta1: float = _default("adamw_beta1")
    adamw_beta2: float = _default("adamw_beta2")
    split: str = _default("split")
    qk_clip: float | None = _default("qk_clip")
    clip_grad: float = _default("clip_grad")
    eval_every: int = _default("eval_every")
    eval_sequences: int = _default("eval_sequences")
    metrics_file: str | None = _default("metrics_file")
    log_every: int = _default("log_every")
    sample_every: int = _default("sample_every")
    sample_prompt: str = _default("sample_prompt")
    sample_tokens: int = _default("sample_tokens")
    report_to: str = _default("report_to")
    run_name: str | None = _default("run_name")
    profile_steps: str | None = _default("profile_steps")
    memory_snapshot: bool = _default("memory_snapshot")
    tracking_dir: str | None = _default("tracking_dir")
    progress: str = _default("progress")
    checkpoint_dir: str | None = _default("checkpoint_dir")
    checkpoint_every: int = _default("checkpoint_every")
    keep_checkpoints: int = _default("keep_checkpoints")
    on_checkpoint_error: str = _default("on_checkpoint_error")
    resume: str = _default("resume")
    init_from: str | None = _default("init_from")
    export_hf: str | None = _default("export_hf")

    @property
    def adamw_rate(self) -> float:
        """The peak AdamW rate of this run: ``adamw_lr`` when set, else `ADAMW_LR`.

        The default is the same under both optimizers: the parameters AdamW trains under
        ``dmuon`` (embedding, norms, head) train best at AdamW's own rate. It and ``lr``'s
        default are the best rates of the ``small`` sweep over 1,000 steps
        (``benchmarks/quality_scale.py``).
        """
        return ADAMW_LR if self.adamw_lr is None else self.adamw_lr

    @property
    def effective_lr(self) -> float:
        """The peak rate logged as ``lr``: ``lr`` (Muon) for dmuon, `adamw_rate` for adamw."""
        return self.lr if self.optimizer == "dmuon" else self.adamw_rate

    @property
    def is_preset(self) -> bool:
        """Whether ``model`` names a preset (else it is a model directory)."""
        return self.model in PRESETS


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


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _bounded_float(bound: str | None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _number(text)
        if bound == "positive" and not (0 < value < float("inf")):
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        if bound == "non_negative" and not 0.0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
        if bound in ("fraction", "open_fraction") and not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
        if bound == "open_fraction" and value in (0.0, 1.0):
            raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _model(text: str) -> str:
    if text in PRESETS or Path(text).expanduser().is_dir():
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing "
        "directory; pass a preset name or a Hugging Face model directory"
    )


def _checkpoint_path(option: str, keywords: tuple[str, ...]) -> Callable[[str], str]:
    """A parser for ``option``: one of ``keywords``, or a complete checkpoint folder."""

    def parse(text: str) -> str:
        if text in keywords:
            return text
        # Here, not at the top: the checkpoint code imports torch, and --help must not.
        from dmuon.train.checkpoints.folder import CheckpointError, require_checkpoint

        try:
            require_checkpoint(text, option)
        except CheckpointError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def _non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _add(group: argparse._ArgumentGroup, spec: Flag) -> None:
    kwargs: dict = {"default": spec.default, "help": spec.help, "dest": spec.dest}
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if spec.kind == "bool":
        group.add_argument(spec.option, action="store_true", **kwargs)
        return
    if spec.kind == "int":
        kwargs["type"] = _int_at_least(spec.minimum) if spec.minimum is not None else int
    elif spec.kind == "float":
        kwargs["type"] = _bounded_float(spec.bound)
    elif spec.kind == "choice":
        kwargs["choices"] = spec.choices
    elif spec.kind == "model":
        kwargs["type"] = _model
    elif spec.kind == "checkpoint":
        kwargs["type"] = _checkpoint_path(spec.option, spec.choices or ())
    else:  # str, path
        kwargs["type"] = _non_empty
    group.add_argument(spec.option, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``dmuon-train`` / ``python -m dmuon.train`` argument parser."""
    p = argparse.ArgumentParser(
        prog="dmuon-train",
        description=(
            "Train a byte-level preset or a Hugging Face model with DMuon (or the AdamW "
            "baseline). Run directly for one process, or under "
            "`torchrun --standalone --nproc_per_node N -m dmuon.train` for N."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flags from the TOML file FILE (every flag as a key, e.g. "
        "micro_batch_size = 8; flags on the command line override it); the resolved "
        "settings are written beside the metrics file and into each checkpoint",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in FLAGS:
        if spec.group not in groups:
            groups[spec.group] = p.add_argument_group(spec.group)
        _add(groups[spec.group], spec)
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse flags into a `TrainConfig` (exits with status 2 on a bad value)."""
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    path, rest = config_file.split(given)
    if path is not None:
        try:
            rest = config_file.argv(config_file.read(path), path) + rest
        except config_file.ConfigFileError as error:
            parser.error(str(error))
    namespace = parser.parse_args(rest)
    if namespace.checkpoint_every > 0 and namespace.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir (where to write checkpoints)")
    if namespace.init_from is not None and namespace.resume not in ("auto", "never"):
        parser.error(
            "--init-from and --resume PATH both give a starting point: --resume PATH "
            "continues a run (weights, optimizer, step), --init-from starts a new one "
            "from weights only; pass one of them"
        )
    if namespace.sample_every > 0 and namespace.sample_tokens >= namespace.seq_len:
        parser.error(
            f"--sample-tokens {namespace.sample_tokens} must be below --seq-len "
            f"{namespace.seq_len}: the prompt and the sample share one window"
        )
    try:
        resolve_report_to(namespace.report_to)
    except ValueError as error:
        parser.error(f"argument --report-to: {error}")
    if namespace.profile_steps is not None:
        from dmuon.train.profiling import parse_steps

        try:
            parse_steps(namespace.profile_steps)
        except ValueError as error:
            parser.error(f"argument --profile-steps: {error}")
    if namespace.optimizer == "adamw":
        given = [
            flag(dest).option
            for dest in MUON_ONLY_FLAGS
            if getattr(namespace, dest) != flag(dest).default
        ]
        if given:
            parser.error(
                f"{' and '.join(given)}: only for --optimizer dmuon (they change how its Muon "
                "matrices are updated); drop them or use --optimizer dmuon"
            )
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(namespace).items() if k in names})
