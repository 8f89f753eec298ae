"""The contract of the recipe ``python -m dmuon.train``, in one module that imports no torch.

Two programs build from this module: the recipe's argument parser (`dmuon.train.cli`) and
the job service (``dmuon_server``), which never imports torch or ``dmuon`` and knows the
recipe only by its command line, its metrics file and its checkpoint folders. Everything
both sides must agree on is defined here once:

* `FLAGS`: every flag of the recipe (spelling, type, default, choices, lower bound, help);
* `PRESETS`: the model presets and their sizes (`PresetShape.num_params`);
* the metrics file's keys (`METRIC_KEYS`, `OPTIONAL_METRIC_KEYS`, `EVENT_KEY`);
* checkpoint folder naming (`checkpoint_name`, `CHECKPOINT_NAME_PATTERN`, ...), what makes
  one complete and whole (`is_complete_checkpoint`, `checkpoint_problems` against the
  manifest written last) and the HF export layout (`HF_CONFIG_FILE`, ...);
* the data formats `--data` reads (`RECORD_SUFFIXES`, `TOKEN_SUFFIX`, `sidecar_path`, ...);
* the exit codes (`EXIT_OK`, `EXIT_USAGE`, `EXIT_DIVERGED`, `EXIT_CHECKPOINT_WRITE`).

Only the standard library is imported, so ``import dmuon_recipe_contract`` costs a few
milliseconds. ``tests/server/test_server_recipe_contract.py`` holds the recipe, the server
and this module to one another.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ADAMW_LR",
    "CHECKPOINT_FAILED_EVENT",
    "CHECKPOINT_NAME_PATTERN",
    "CHECKPOINT_PREFIX",
    "CHECKPOINT_SKIPPED_EVENT",
    "DATA_ROOTS_ENV",
    "DCP_METADATA_FILE",
    "DEFAULT_TEXT_FIELD",
    "EVENT_KEY",
    "EXIT_CHECKPOINT_WRITE",
    "EXIT_DIVERGED",
    "EXIT_OK",
    "EXIT_USAGE",
    "FLAGS",
    "HF_CONFIG_FILE",
    "HF_SNAPSHOT_DIR",
    "MANIFEST_FILE",
    "METRIC_KEYS",
    "MUON_ONLY_FLAGS",
    "OPTIONAL_METRIC_KEYS",
    "PARQUET_SUFFIXES",
    "PRESETS",
    "RECORD_SUFFIXES",
    "SAMPLE_EVENT",
    "STOPPED_EVENT",
    "TEMPORARY_PREFIX",
    "TOKENIZER_FILES",
    "TOKENIZE_BATCH_BYTES",
    "TOKEN_DTYPES",
    "TOKEN_SUFFIX",
    "TRACKERS_EVENT",
    "TRACKER_NAMES",
    "TRAINER_STATE_FILE",
    "WEIGHT_SUFFIXES",
    "Flag",
    "PresetShape",
    "checkpoint_name",
    "checkpoint_problems",
    "data_kind",
    "file_sha256",
    "flag",
    "is_complete_checkpoint",
    "is_model_directory",
    "link_message",
    "no_tokenizer_message",
    "not_model_directory_message",
    "positions_message",
    "read_manifest",
    "remote_code_message",
    "sidecar_message",
    "sidecar_path",
    "vocab_message",
]


# ----- model presets ---------------------------------------------------------------------
@dataclass(frozen=True)
class PresetShape:
    """The sizes of a byte-level preset of the recipe (``dmuon.train.ModelConfig``)."""

    n_layers: int
    dim: int
    n_heads: int
    ffn_dim: int
    vocab_size: int = 256
    max_seq_len: int = 1024
    n_experts: int = 0
    top_k: int = 2

    @property
    def num_params(self) -> int:
        """Parameters: embedding, blocks (experts and routers too), final norm, untied head."""
        mlp = 3 * self.dim * self.ffn_dim
        if self.n_experts > 0:
            mlp = self.n_experts * (mlp + self.dim)
        per_layer = 4 * self.dim * self.dim + mlp + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim

    @property
    def active_ffn_dim(self) -> int:
        """MLP width one token passes through: ``ffn_dim``, times ``top_k`` with experts."""
        return self.ffn_dim * (self.top_k if self.n_experts > 0 else 1)


PRESETS: dict[str, PresetShape] = {
    "tiny": PresetShape(n_layers=2, dim=64, n_heads=4, ffn_dim=192),
    "small": PresetShape(n_layers=4, dim=256, n_heads=4, ffn_dim=768),
    "base": PresetShape(n_layers=8, dim=512, n_heads=8, ffn_dim=1536),
    "moe": PresetShape(n_layers=2, dim=64, n_heads=4, ffn_dim=128, n_experts=4, top_k=2),
}
"""The ``--model`` presets by name; ``dmuon.train.PRESETS`` is built from this table."""

#: Files of a Hugging Face model directory.
HF_CONFIG_FILE = "config.json"
WEIGHT_SUFFIXES = (".safetensors",)
#: Files that make a directory a tokenizer ``AutoTokenizer`` loads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_model_directory(path: str | Path) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory (has ``config.json``)."""
    return (Path(path) / HF_CONFIG_FILE).is_file()


# ----- data formats ----------------------------------------------------------------------
DEFAULT_TEXT_FIELD = "text"
#: Files read as records (JSON lines, or a JSON array of objects for ``.json``).
RECORD_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
#: Pre-tokenized token files: raw little-endian unsigned integers, with a sidecar.
TOKEN_SUFFIX = ".bin"
#: Element types a token file may hold, with their sizes in bytes.
TOKEN_DTYPES: dict[str, int] = {"uint16": 2, "uint32": 4}

DataKind = Literal["text", "records", "parquet", "tokens"]

DATA_ROOTS_ENV = "DMUON_DATA_ROOTS"
"""Folders (``os.pathsep``-separated) that a symbolic link inside a ``--data`` folder may
also lead into, besides the folder itself: the job service sets its ``--data-root``
folders here, so that the recipe reads what the service admitted."""

TOKENIZE_BATCH_BYTES = 4 << 20
"""Text the recipe tokenizes per batch: what tokenization holds in memory at most (plus
the batch's ids), since the ids stream to a memory-mapped cache."""


def sidecar_path(token_file: str | Path) -> Path:
    """The JSON sidecar of a token file: ``FILE.bin`` -> ``FILE.bin.json``.

    It holds ``{"dtype": "uint16" | "uint32", "vocab_size": V}``: the element type and the
    vocabulary size of the tokenizer that wrote the file.
    """
    path = Path(token_file)
    return path.with_name(path.name + ".json")


def data_kind(path: str | Path) -> DataKind:
    """How ``--data`` reads one file, by its suffix (anything else is text)."""
    name = Path(path).name.lower()
    if name.endswith(TOKEN_SUFFIX):
        return "tokens"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(RECORD_SUFFIXES):
        return "records"
    return "text"


# ----- metrics file ----------------------------------------------------------------------
METRIC_KEYS = ("step", "loss", "lr", "tokens_per_s", "grad_norm", "time")
"""Keys present on every line of the metrics file (null where they do not apply)."""

OPTIONAL_METRIC_KEYS = (
    "val_loss",
    "peak_memory_bytes",
    "mfu",
    "max_logit",
    "qk_clipped_heads",
    "adamw_lr",
)
"""Keys some lines add: validation loss on evaluation steps, each rank's peak memory (a
list, index = rank), model FLOPs utilization where the peak is known, and under
``--qk-clip`` the step's largest attention logit and how many heads were clipped."""

EVENT_KEY = "event"
"""Lines with this key are events, not metric points."""
STOPPED_EVENT = "stopped"
"""``{"event": "stopped", "step": k, "signal": ..., "checkpoint": ...}`` ends a stopped run."""
CHECKPOINT_SKIPPED_EVENT = "checkpoint_skipped"
"""``{"event": "checkpoint_skipped", "checkpoint": ..., "problems": [...], "step": k}``:
``--resume auto`` passed over a damaged checkpoint and resumed from step ``k`` instead (0: no
whole checkpoint was left, the run started over)."""
TRACKERS_EVENT = "trackers"
"""``{"event": "trackers", "step": k, "trackers": {name: ids}}``: the experiment trackers'
runs this attempt reports to (``--report-to``), from step ``k + 1`` on: ``tensorboard``'s
``logdir``, ``mlflow``'s ``run_id``, ``experiment_id`` and ``tracking_uri``, ``wandb``'s
``run_id`` and ``path``."""
TRACKER_NAMES = ("tensorboard", "mlflow", "wandb")
SAMPLE_EVENT = "sample"
"""``{"event": "sample", "step": k, "prompt": ..., "text": ...}``: what the model wrote
after ``--sample-prompt`` with the weights of step ``k`` (``--sample-every``)."""
"""The trackers ``--report-to`` knows (besides ``none`` and ``all``)."""
CHECKPOINT_FAILED_EVENT = "checkpoint_failed"
"""``{"event": "checkpoint_failed", "step": k, "message": ...}``: a checkpoint could not be
written and ``--on-checkpoint-error warn`` kept the run going."""


# ----- checkpoints -----------------------------------------------------------------------
CHECKPOINT_PREFIX = "step_"
CHECKPOINT_NAME_PATTERN = re.compile(r"step_(\d{8})")
"""A complete checkpoint folder: ``step_`` and 8 digits (use ``fullmatch``)."""
TEMPORARY_PREFIX = ".tmp_"
"""Folders being written (checkpoints, exports) start with this; they are never complete."""
DCP_METADATA_FILE = ".metadata"
TRAINER_STATE_FILE = "trainer_state.pt"
"""Rank 0's file in a checkpoint (step and trainer state); with ``.metadata`` it marks the
checkpoint complete."""
HF_SNAPSHOT_DIR = "hf"
"""Folder of a checkpoint holding what an HF export needs besides the weights: the model's
``config.json`` and tokenizer files, and ``keys.json`` when the names differ from HF's."""


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint after ``step``: ``step_`` and 8 digits."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


MANIFEST_FILE = "dmuon-manifest.json"
"""Written last into a checkpoint: each file's size and SHA-256."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read 1 MiB at a time."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def read_manifest(root: Path) -> dict[str, Any] | str:
    """A checkpoint's manifest, or why it has none that can be read."""
    path = root / MANIFEST_FILE
    if not path.is_file():
        return f"it has no {MANIFEST_FILE}: the save did not finish (or it is not a checkpoint)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"its {MANIFEST_FILE} cannot be read ({error})"
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return f"its {MANIFEST_FILE} is not a DMuon manifest"
    return data


def checkpoint_problems(folder: str | os.PathLike[str], checksums: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder against its manifest; ``[]`` when whole.
    ``checksums=False`` checks that each file is there with its size (reads none)."""
    root = Path(folder)
    if not root.is_dir():
        return [f"{root} is not a folder"]
    data = read_manifest(root)
    if isinstance(data, str):
        return [data]
    problems = []
    for name, entry in sorted(data["files"].items()):
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (size := path.stat().st_size) != entry.get("bytes"):
            problems.append(f"{name} has {size} bytes, {entry.get('bytes')} were written")
        elif checksums and file_sha256(path) != entry.get("sha256"):
            problems.append(f"{name} has changed since it was written (its checksum differs)")
    return problems


def is_complete_checkpoint(folder: str | os.PathLike[str]) -> bool:
    """Whether a folder holds a finished save: DCP's metadata, the trainer state and the
    manifest written last (whether the files still match it: `checkpoint_problems`)."""
    root = Path(folder)
    names = (DCP_METADATA_FILE, TRAINER_STATE_FILE, MANIFEST_FILE)
    return all((root / name).is_file() for name in names)


# ----- messages of bad inputs (the recipe's, and the job service's 422s) -----------------
def not_model_directory_message(model: str) -> str:
    """``--model`` names a folder without ``config.json``."""
    presets = ", ".join(sorted(PRESETS))
    return (
        f"--model {model!r} is not a Hugging Face model directory: it has no "
        f"{HF_CONFIG_FILE}. Pass a directory written by save_pretrained (a config.json, with "
        f"or without *.safetensors weights) or a preset ({presets})"
    )


def remote_code_message(model: str, model_type: object) -> str:
    """``config.json`` names an architecture only code of its own builds."""
    return (
        f"--model {model}: model_type {model_type!r} in its config.json is not a causal "
        "language model this transformers builds. It asks for code of its own (auto_map), "
        "which the recipe never runs. Use an architecture AutoModelForCausalLM knows (llama, "
        "qwen2, mistral, mixtral, gpt2, ...)"
    )


def positions_message(seq_len: int, positions: int, model: str) -> str:
    """``--seq-len`` is above the model's ``max_position_embeddings``."""
    return (
        f"--seq-len {seq_len} is longer than the {positions} positions of --model {model} "
        f"(max_position_embeddings in its config.json); use --seq-len <= {positions}"
    )


def vocab_message(vocab_size: int, model_vocab: int, what: str, model: str) -> str:
    """Token ids of ``what`` (a tokenizer, a token file) do not fit the model's embedding."""
    return (
        f"{what} has a vocabulary of {vocab_size} tokens, but --model {model} embeds "
        f"only {model_vocab} (vocab_size in its config); use a tokenizer of at most "
        f"{model_vocab} tokens, or a model whose vocab_size is at least {vocab_size}"
    )


def no_tokenizer_message(model: str) -> str:
    """A model directory without a tokenizer, and no ``--tokenizer``."""
    return (
        f"--model {model} has no tokenizer (no tokenizer.json nor tokenizer_config.json); "
        "pass --tokenizer PATH"
    )


def link_message(data: str, relative: str, target: str, root: str) -> str:
    """A symbolic link inside a data folder points outside it."""
    return (
        f"--data {data!r}: {relative} is a symbolic link to {target}, outside the data folder "
        f"{root}; the recipe reads only files inside it. Copy what it points to into the "
        "folder, or remove the link"
    )


def sidecar_message(shown: str) -> str:
    """A ``.bin`` token file without its sidecar."""
    dtypes = ", ".join(TOKEN_DTYPES)
    return (
        f"--data: token file {shown} has no sidecar {sidecar_path(shown).name}; write one next "
        f"to it naming the element type ({dtypes}) and the tokenizer's vocabulary size, e.g. "
        '{"dtype": "uint16", "vocab_size": 50257}'
    )


# ----- exit codes ------------------------------------------------------------------------
EXIT_OK = 0
EXIT_USAGE = 2
"""Bad flags or inputs (argparse's own status too)."""
EXIT_DIVERGED = 3
"""A NaN or infinite loss or gradient norm."""
EXIT_CHECKPOINT_WRITE = 4
"""A checkpoint could not be written (a full disk) under ``--on-checkpoint-error stop``."""


# ----- flags -----------------------------------------------------------------------------
ADAMW_LR = 3.75e-4
"""Peak AdamW rate when ``--adamw-lr`` is not given: every parameter under the ``adamw``
baseline; the embedding, norms and output head under ``dmuon``. With ``--lr``'s default it is
the best rate of the ``small`` sweep over 1,000 steps (``benchmarks/quality_scale.py``)."""

FlagKind = Literal["int", "float", "str", "path", "choice", "bool", "model", "checkpoint"]
Bound = Literal["positive", "non_negative", "fraction", "open_fraction"]


@dataclass(frozen=True)
class Flag:
    """One flag of the recipe.

    Attributes:
        dest: the field name (``micro_batch_size``); also the job spec's field name.
        kind: ``int``; ``float`` (see ``bound``); ``str``; ``path`` (a file or folder);
            ``choice`` (one of ``choices``); ``bool`` (a switch, no value); ``model`` (a
            preset name or a model directory); ``checkpoint`` (a checkpoint folder, or
            one of ``choices``).
        default: the value when the flag is absent (None: decided at run time).
        help: the ``--help`` text.
        group: the ``--help`` section.
        minimum: the smallest value of an ``int`` flag.
        bound: the range of a ``float`` flag.
        choices: the allowed values of a ``choice`` flag, or the keywords of a
            ``checkpoint`` flag.
        metavar: how ``--help`` names the value.
    """

    dest: str
    kind: FlagKind
    default: Any
    help: str
    group: str
    minimum: int | None = None
    bound: Bound | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def option(self) -> str:
        """The spelling on the command line: ``--`` and ``dest`` with ``-`` for ``_``."""
        return "--" + self.dest.replace("_", "-")


_MODEL = "model and data"
_LOOP = "loop"
_PRECISION = "precision, memory and compile"
_OPT = "optimizer"
_OUT = "evaluation and output"
_CKPT = "checkpoints and export"

FLAGS: tuple[Flag, ...] = (
    Flag("model", "model", "small", "a preset name (sizes in dmuon.train.PRESETS) or a local "
         "Hugging Face model directory (config.json, with or without *.safetensors weights)",
         _MODEL, metavar="{" + ",".join(sorted(PRESETS)) + "} | DIR"),
    Flag("tokenizer", "path", None, "tokenizer.json or a tokenizer directory; default: the "
         "model directory's tokenizer, byte-level for presets", _MODEL, metavar="PATH"),
    Flag("data", "path", None, "text file or folder, .jsonl/.json, .parquet, or .bin token "
         "files with a FILE.bin.json sidecar; default: the Python standard library source",
         _MODEL, metavar="PATH"),
    Flag("text_field", "str", DEFAULT_TEXT_FIELD, "field holding the text in .jsonl, .json "
         "and .parquet records", _MODEL, metavar="NAME"),
    Flag("cache_dir", "path", None, "tokenized-corpus cache; default $DMUON_CACHE_DIR or "
         "~/.cache/dmuon", _MODEL, metavar="DIR"),
    Flag("val_fraction", "float", 0.05, "share of files (of tokens, for one file) held out "
         "for validation", _MODEL, bound="open_fraction"),
    Flag("steps", "int", 60, "optimizer steps", _LOOP, minimum=1),
    Flag("micro_batch_size", "int", 4, "sequences per micro-batch per process", _LOOP,
         minimum=1),
    Flag("accum_steps", "int", 1, "micro-batches accumulated per optimizer step", _LOOP,
         minimum=1),
    Flag("seq_len", "int", 128, "tokens per sequence", _LOOP, minimum=1),
    Flag("seed", "int", 0, "initialization and data-order seed", _LOOP, minimum=0),
    Flag("device", "choice", "auto", "auto = cuda if available, else cpu", _LOOP,
         choices=("auto", "cpu", "cuda")),
    Flag("threads", "int", None, "intra-op CPU threads per process; default: OMP_NUM_THREADS "
         "if set, else the available cores divided by the local process count", _LOOP,
         minimum=1),
    Flag("collective_timeout", "int", 600, "seconds a collective waits for every process "
         "before the run fails naming it (a dead or stalled process); torch's own default "
         "is 600 under NCCL and 1800 under gloo", _LOOP, minimum=1, metavar="SECONDS"),
    Flag("dtype", "choice", "float32", "master parameter dtype (float64 for exactness checks)",
         _PRECISION, choices=("float32", "float64")),
    Flag("param_dtype", "choice", "float32", "compute dtype of forward and backward: "
         "bfloat16 = FSDP2 MixedPrecisionPolicy and dedicate_params(param_dtype=...) with "
         "float32 masters and gradient reduction (torch.autocast in one process)",
         _PRECISION, choices=("float32", "bfloat16")),
    Flag("activation_checkpointing", "bool", False, "recompute each decoder layer's "
         "activations in backward instead of keeping them", _PRECISION),
    Flag("compile", "bool", False, "torch.compile each decoder layer's forward", _PRECISION),
    Flag("peak_tflops", "float", None, "peak TFLOP/s of one device for the mfu metric; "
         "default: known for some CUDA devices in bfloat16, else no mfu", _PRECISION,
         bound="positive", metavar="TFLOPS"),
    Flag("optimizer", "choice", "dmuon", "dmuon = DMuon on the hidden matrices + AdamW on "
         "the rest; adamw = torch.optim.AdamW on everything (the baseline)", _OPT,
         choices=("dmuon", "adamw")),
    Flag("mode", "choice", "z3", "sharding mode of DMuon and FSDP2: z3 reshards parameters "
         "after forward, z2 keeps them resident until the optimizer step", _OPT,
         choices=("z2", "z3")),
    Flag("hsdp", "int", 1, "replicate degree of an HSDP (replicate, shard) mesh: R replicas "
         "of world_size / R shards each (usually R = number of nodes); 1 = a 1-D mesh",
         _OPT, minimum=1, metavar="R"),
    Flag("ns_split", "int", 1, "consecutive ranks of a shard group that share the "
         "Newton-Schulz iterations of the largest matrices (dedicate_params(ns_split=G)); "
         "G must divide the shard size (world size / --hsdp); 1 = each matrix iterated "
         "whole by the rank that steps it", _OPT, minimum=1, metavar="G"),
    Flag("reduce_dtype", "choice", "float32", "dtype every gradient is summed in between "
         "ranks, FSDP2's parameters and dmuon's matrices alike (one MixedPrecisionPolicy); "
         "bfloat16 halves the reduces' bytes (accumulation, masters, momentum stay float32)",
         _OPT,
         choices=("float32", "bfloat16")),
    Flag("broadcast_dtype", "choice", "auto", "dtype dmuon broadcasts the dedicated matrices "
         "in; auto = the compute dtype (--param-dtype); bfloat16 halves the broadcasts' bytes",
         _OPT, choices=("auto", "float32", "bfloat16")),
    Flag("ns_dtype", "choice", "auto", "Newton-Schulz dtype of dmuon; auto = bfloat16 on "
         "CUDA and on CPUs that multiply it natively (AMX-BF16, AVX512-BF16), float32 "
         "elsewhere", _OPT, choices=("auto", "float32", "bfloat16")),
    Flag("muon_variant", "choice", "muon", "update rule of dmuon's matrices: muon, or "
         "normuon (Muon with per-neuron second-moment normalization, beta2 0.95)", _OPT,
         choices=("muon", "normuon")),
    Flag("lr", "float", 1.25e-3, "peak Muon learning rate of the dedicated matrices (dmuon "
         "only)", _OPT, bound="positive"),
    Flag("adamw_lr", "float", ADAMW_LR, "peak AdamW rate: embeddings, norms and lm_head "
         "under dmuon; every parameter under the adamw baseline", _OPT, bound="positive"),
    Flag("warmup_steps", "int", 10, "linear warmup steps, then the --lr-schedule", _OPT,
         minimum=0),
    Flag("min_lr_ratio", "float", 0.1, "final learning rate as a fraction of the peak", _OPT,
         bound="fraction"),
    Flag("lr_schedule", "choice", "cosine", "after warmup: cosine or linear decay to "
         "min-lr-ratio x peak, constant, or wsd (constant, then linear decay over the last "
         "--decay-fraction of the steps)", _OPT,
         choices=("cosine", "linear", "constant", "wsd")),
    Flag("decay_fraction", "float", 0.2, "the final share of the steps that decays under "
         "--lr-schedule wsd", _OPT, bound="fraction"),
    Flag("weight_decay", "float", 0.0, "decoupled weight decay of the Muon matrices (dmuon "
         "only)", _OPT, bound="non_negative"),
    Flag("adamw_weight_decay", "float", 0.01, "decoupled weight decay of AdamW (the "
         "embedding, norms and head under dmuon; every parameter under adamw)", _OPT,
         bound="non_negative"),
    Flag("momentum", "float", 0.95, "Muon's momentum (dmuon only)", _OPT, bound="fraction"),
    Flag("adamw_beta1", "float", 0.9, "AdamW's first-moment decay", _OPT, bound="fraction"),
    Flag("adamw_beta2", "float", 0.999, "AdamW's second-moment decay", _OPT,
         bound="fraction"),
    Flag("split", "choice", "none", "which matrices dmuon orthogonalizes in parts, as if "
         "they were separate parameters: none; auto = fused gate_up expert stacks into gate "
         "and up; per_head = that, and each attention head's q, k and v rows", _OPT,
         choices=("none", "auto", "per_head")),
    Flag("qk_clip", "float", None, "QK-clip (MuonClip) threshold: after each step, the "
         "query and key rows of every attention head whose largest logit passed TAU are "
         "scaled back to it (dmuon only); logs max_logit and qk_clipped_heads", _OPT,
         bound="positive", metavar="TAU"),
    Flag("clip_grad", "float", 1.0, "clip the global gradient norm to this value (0 "
         "disables); the logged grad_norm is the norm before clipping", _OPT,
         bound="non_negative"),
    Flag("eval_every", "int", 20, "evaluate at step 0, every N steps and at the end; "
         "0 = never", _OUT, minimum=0),
    Flag("eval_sequences", "int", 64, "fixed validation windows per evaluation", _OUT,
         minimum=1),
    Flag("metrics_file", "path", None, "append one JSON object per optimizer step here "
         "(rank 0)", _OUT, metavar="PATH"),
    Flag("log_every", "int", 1, "print every N steps when not showing a progress bar", _OUT,
         minimum=1),
    Flag("sample_every", "int", 0, "every N steps (and at the end), every rank generates "
         "--sample-tokens tokens greedily after --sample-prompt with the current weights; "
         "rank 0 logs the text (metrics file, trackers, the job page); 0 = never", _OUT,
         minimum=0, metavar="N"),
    Flag("sample_prompt", "str", "The", "the text samples continue", _OUT, metavar="TEXT"),
    Flag("sample_tokens", "int", 32, "tokens each sample generates (prompt and sample must "
         "fit --seq-len)", _OUT, minimum=1, metavar="K"),
    Flag("report_to", "str", "none", "experiment trackers to report to, as Hugging Face's "
         "report_to: none, all (every one installed), or a comma-separated list of "
         "tensorboard, mlflow and wandb (pip install tensorboard mlflow wandb); rank 0 logs every "
         "metric, the config and the exported model", _OUT,
         metavar="{none,all,tensorboard,mlflow,wandb}[,...]"),
    Flag("run_name", "str", None, "the trackers' run name; default: model, optimizer and "
         "start time", _OUT, metavar="NAME"),
    Flag("profile_steps", "str", None, "record a torch.profiler trace of steps A to B (A:B, "
         "e.g. 10:12; CPU and CUDA activity, memory, shapes), one file per rank under "
         "--tracking-dir's tensorboard/profile/, which TensorBoard's profiler and Perfetto "
         "open", _OUT, metavar="A:B"),
    Flag("memory_snapshot", "bool", False, "record memory over the --profile-steps range "
         "(1:1 without it), one file per rank under --tracking-dir's memory/: on a GPU the "
         "CUDA allocator's snapshot (pytorch.org/memory_viz opens it), on CPU the peak "
         "tensor bytes of the forward and backward and of the optimizer step", _OUT),
    Flag("tracking_dir", "path", None, "where trackers keep local files (TensorBoard "
         "events, the MLflow store unless MLFLOW_TRACKING_URI is set, W&B runs); default "
         "./runs", _OUT, metavar="DIR"),
    Flag("progress", "choice", "auto", "auto = a tqdm bar on a terminal, plain lines "
         "otherwise (step, percent, loss, lr, tokens/s, elapsed time and ETA)", _OUT,
         choices=("auto", "bar", "plain")),
    Flag("checkpoint_dir", "path", None, "write checkpoints here (step_NNNNNNNN folders); a "
         "final one is always written at the end and on SIGTERM/SIGINT", _CKPT,
         metavar="DIR"),
    Flag("checkpoint_every", "int", 0, "also checkpoint every N steps (needs "
         "--checkpoint-dir); 0 = only at the end", _CKPT, minimum=0, metavar="N"),
    Flag("keep_checkpoints", "int", 3, "keep the newest K complete checkpoints in "
         "--checkpoint-dir; 0 keeps all", _CKPT, minimum=0, metavar="K"),
    Flag("on_checkpoint_error", "choice", "stop", "a checkpoint that cannot be written (a "
         "full disk): stop = end the run with an error naming the folder and the space it "
         "needs; warn = say so each time and keep training; the earlier checkpoints stay "
         "intact either way", _CKPT, choices=("stop", "warn")),
    Flag("resume", "checkpoint", "auto", "auto = continue from the latest checkpoint in "
         "--checkpoint-dir if there is one; never = start fresh; PATH = continue from that "
         "checkpoint", _CKPT, choices=("auto", "never"), metavar="{auto,never,PATH}"),
    Flag("init_from", "checkpoint", None, "start from the weights of this checkpoint "
         "(optimizer, schedule and step start fresh); an error if --resume also finds a "
         "checkpoint", _CKPT, choices=(), metavar="PATH"),
    Flag("export_hf", "path", None, "at the end of training, write a Hugging Face model "
         "directory here (config, safetensors weights, tokenizer, generation config)",
         _CKPT, metavar="DIR"),
)  # fmt: skip
"""Every flag of ``dmuon-train``, in ``--help`` order."""

MUON_ONLY_FLAGS = ("qk_clip", "split")
"""Flags that change how DMuon's Muon matrices are updated: refused with ``--optimizer
adamw`` (by the recipe, the job service and the dashboard's DMuon-vs-AdamW pair)."""

_BY_DEST = {f.dest: f for f in FLAGS}


def flag(dest: str) -> Flag:
    """The flag whose field name is ``dest`` (``KeyError`` if there is none)."""
    return _BY_DEST[dest]
