"""Admission control: can the recipe run a job spec on this host?

The server never imports the recipe, so it knows the model presets through the static
table :data:`RECIPE_MODELS` (a test keeps it equal to ``dmuon.train.PRESETS``) and
estimates what a job needs from the spec alone.

Memory per rank (bytes; float32 parameters and activations, int64 token windows)::

    parameters  = 16 * P                     weights, gradients, two optimizer states
    activations = 4 * B * T * (L * (12*d + 4*f) + 2*d + 3*V)
    batch       = 8 * (T + 1) * (A * B + ceil(64 / N))
    corpus      = 3 * C                      raw bytes while the corpus is built
    runtime     = 512 MiB                    interpreter, torch, gloo, allocator slack

with ``P`` parameters, micro-batch ``B``, sequence length ``T``, ``L`` layers of width
``d`` and MLP width ``f`` (for a mixture of experts, one expert's width times the experts
each token goes to), vocabulary ``V``, accumulation ``A``, ``N`` ranks, and ``C``
bytes of text. The parameter term ignores sharding (every rank builds the whole model
before FSDP2 shards it), the activation term counts what autograd keeps per token and
layer (norm inputs and outputs, q/k/v, attention output, SwiGLU's four tensors) plus the
logits, their log-softmax and gradient; attention itself is the fused kernel, linear in
``T``. The job needs ``N`` times the per-rank figure.

The data is checked the way the recipe reads it: a file, or every non-hidden, non-empty,
non-binary file of a folder; the validation split is the last 5 % of a single file's
bytes, or the ``ceil(5 % of the files)`` files of a folder, and both splits need at least
``T + 1`` tokens.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dmuon_server.schemas import Admission, DataEstimate, MemoryEstimate, TrainSpec

#: Validation share of the recipe (``--val-fraction`` default; the server does not set it).
VAL_FRACTION = 0.05
#: Validation windows of the recipe (``--eval-sequences`` default).
EVAL_SEQUENCES = 64
#: Memory of one rank before the model: interpreter, torch, gloo, allocator slack.
RUNTIME_BYTES = 512 << 20
#: Folder entries the data check looks at before it stops counting file sizes.
MAX_FILES_SCANNED = 20_000
#: Folder entries the symbolic-link check looks at; a larger folder is refused.
MAX_ENTRIES_CHECKED = 1_000_000
#: Links outside the data roots a refusal names.
MAX_ESCAPES_REPORTED = 3
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a recipe preset that the estimates need."""

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


#: The recipe's presets (``dmuon.train.PRESETS``), restated so the server needs no torch.
RECIPE_MODELS: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layers=2, dim=64, n_heads=4, ffn_dim=192),
    "small": ModelShape(n_layers=4, dim=256, n_heads=4, ffn_dim=768),
    "base": ModelShape(n_layers=8, dim=512, n_heads=8, ffn_dim=1536),
    "moe": ModelShape(n_layers=2, dim=64, n_heads=4, ffn_dim=128, n_experts=4, top_k=2),
}


@dataclass(frozen=True)
class Refusal:
    """A reason the recipe cannot run a spec, tied to the field to change."""

    loc: tuple[str, ...]
    message: str


def _is_binary(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return b"\0" in f.read(_BINARY_SNIFF_BYTES)
    except OSError:
        return True


@dataclass
class TextScan:
    """What :func:`scan_text` found under a data path.

    Attributes:
        sizes: Sizes of the files the recipe would read (at most ``MAX_FILES_SCANNED``).
        complete: False when the folder had more entries than were counted.
        escapes: Entries (relative to the data path) that are symbolic links resolving
            outside every data root, at most ``MAX_ESCAPES_REPORTED`` of them.
        unchecked: True when the folder had more entries than the link check looks at.
    """

    sizes: list[int] = field(default_factory=list)
    complete: bool = True
    escapes: list[str] = field(default_factory=list)
    unchecked: bool = False


def _inside(path: str, roots: tuple[Path, ...]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or real.is_relative_to(r) for r in roots)


def scan_text(path: Path, roots: tuple[Path, ...]) -> TextScan:
    """Sizes of the files the recipe would read from ``path``, and the symbolic links in
    it that lead outside ``roots``.

    Every entry of the folder is looked at, hidden ones too (``lstat`` only, so the count
    of files does not limit the check), and a link is followed only to see where it ends:
    a file or folder the recipe would reach through a link must lie inside a data root,
    as ``path`` itself must. Hidden folders are not entered (the recipe skips them).
    """
    out = TextScan()
    if not path.is_dir():
        out.sizes = [path.stat().st_size]
        return out
    stack = [path]
    seen = 0
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES_CHECKED:
                out.unchecked = True
                return out
            hidden = entry.name.startswith(".")
            try:
                if entry.is_symlink() and not _inside(entry.path, roots):
                    if len(out.escapes) < MAX_ESCAPES_REPORTED:
                        out.escapes.append(Path(entry.path).relative_to(path).as_posix())
                    continue
                if hidden:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                    continue
                if seen > MAX_FILES_SCANNED:
                    out.complete = False
                    continue
                f = Path(entry.path)
                if not f.is_file() or f.stat().st_size == 0 or _is_binary(f):
                    continue
                out.sizes.append(f.stat().st_size)
            except OSError:
                continue
    return out


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> tuple[int, int]:
    """Files and bytes of the recipe's default corpus: the standard library's ``*.py``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        for name in filenames:
            if name.endswith(".py"):
                try:
                    total += (Path(dirpath) / name).stat().st_size
                    files += 1
                except OSError:
                    continue
    return files, total


def split_tokens(sizes: list[int]) -> tuple[int, int]:
    """Train and validation tokens the recipe makes of files of these sizes.

    Exact for one file; for a folder the validation files are a hashed choice, so the
    figures assume files of average size.
    """
    total = sum(sizes)
    if len(sizes) <= 1:
        val = max(1, round(total * VAL_FRACTION)) if total else 0
        return total - val, val
    n_val = min(len(sizes) - 1, max(1, math.ceil(VAL_FRACTION * len(sizes))))
    joined = total + len(sizes) - 2  # one newline between files, within each split
    val = round(joined * n_val / len(sizes))
    return joined - val, val


def estimate_memory(train: TrainSpec, nproc: int, corpus_bytes: int, limit: int) -> MemoryEstimate:
    """Memory a job needs per rank and in all (see the module docstring for the formula)."""
    m = RECIPE_MODELS[train.model]
    b, t = train.micro_batch_size, train.seq_len
    params = 16 * m.num_params
    per_token = m.n_layers * (12 * m.dim + 4 * m.active_ffn_dim) + 2 * m.dim + 3 * m.vocab_size
    activations = 4 * b * t * per_token
    batch = 8 * (t + 1) * (train.accum_steps * b + math.ceil(EVAL_SEQUENCES / nproc))
    corpus = 3 * corpus_bytes
    per_rank = params + activations + batch + corpus + RUNTIME_BYTES
    vm = psutil.virtual_memory()
    return MemoryEstimate(
        parameters_bytes=params,
        activations_bytes=activations,
        batch_bytes=batch,
        corpus_bytes=corpus,
        runtime_bytes=RUNTIME_BYTES,
        per_rank_bytes=per_rank,
        job_bytes=per_rank * nproc,
        limit_bytes=limit,
        host_total_bytes=vm.total,
        host_available_bytes=vm.available,
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def assess(
    train: TrainSpec,
    nproc: int,
    data_path: Path | None,
    data_label: str | None,
    limit: int,
    roots: tuple[Path, ...] = (),
) -> tuple[Admission, list[Refusal], list[str]]:
    """Estimate what a job needs; return the figures, the refusals and the warnings.

    ``data_path`` is the resolved ``train.data`` (None: the built-in corpus), inside one
    of the data ``roots``, and ``data_label`` how clients see it.
    """
    m = RECIPE_MODELS[train.model]
    refusals: list[Refusal] = []
    warnings: list[str] = []
    t = train.seq_len
    if t > m.max_seq_len:
        refusals.append(
            Refusal(
                ("body", "train", "seq_len"),
                f"{t} is longer than the maximum sequence length of the {train.model} "
                f"model ({m.max_seq_len}); use seq_len <= {m.max_seq_len}",
            )
        )
    data_refused = False
    if data_path is None:
        files, total = builtin_corpus()
        sizes, complete = [total // max(files, 1)] * files, True
        data = DataEstimate(source="built-in", files=files, bytes=total, complete=True)
    else:
        scan = scan_text(data_path, roots)
        sizes, complete = scan.sizes, scan.complete
        data = DataEstimate(
            source=data_label or "", files=len(sizes), bytes=sum(sizes), complete=complete
        )
        data_refused = bool(scan.escapes or scan.unchecked)
        if scan.escapes:
            shown = ", ".join(repr(e) for e in scan.escapes)
            refusals.append(
                Refusal(
                    ("body", "train", "data"),
                    f"{data.source} holds symbolic links that lead outside the data roots "
                    f"({shown}); the recipe would read what they point to. Remove the "
                    "links, or copy their files into a data root",
                )
            )
        if scan.unchecked:
            refusals.append(
                Refusal(
                    ("body", "train", "data"),
                    f"{data.source} has more than {MAX_ENTRIES_CHECKED:,} entries, more than "
                    "the server checks for links leading outside the data roots; point "
                    "train.data at a smaller folder",
                )
            )
    train_tokens, val_tokens = split_tokens(sizes)
    data.train_tokens, data.val_tokens = train_tokens, val_tokens
    data_loc = ("body", "train", "data")
    exact = len(sizes) <= 1 or sum(sizes) < t + 1
    if data_path is not None and not sizes and not data_refused:
        refusals.append(
            Refusal(
                data_loc,
                f"{data.source} holds no non-empty text file (hidden and binary files are "
                "skipped); put text in it",
            )
        )
    elif not data_refused:
        for what, n in (("training", train_tokens), ("validation", val_tokens)):
            if n >= t + 1:
                continue
            message = (
                f"the {what} split of {data.source} has {'' if exact else 'about '}{n} tokens, "
                f"fewer than seq_len + 1 = {t + 1}; use a shorter seq_len or more text"
            )
            if exact and complete:
                refusals.append(Refusal(data_loc, message))
            else:
                warnings.append(message)
    tokens_per_step = train.micro_batch_size * train.accum_steps * nproc * t
    if train_tokens and tokens_per_step > train_tokens:
        warnings.append(
            f"one step samples {tokens_per_step} tokens, {tokens_per_step / train_tokens:.1f}x "
            "the training split: the run sees the same text many times over"
        )
    memory = estimate_memory(train, nproc, data.bytes, limit)
    mem_loc = ("body", "train", "micro_batch_size")
    need = f"{_gib(memory.job_bytes)} ({_gib(memory.per_rank_bytes)} per rank x {nproc})"
    if memory.job_bytes > limit:
        refusals.append(
            Refusal(
                mem_loc,
                f"the job needs an estimated {need}, more than this server allows per job "
                f"({_gib(limit)}, --max-job-memory); lower micro_batch_size, seq_len or "
                "nproc_per_node",
            )
        )
    elif memory.job_bytes > memory.host_total_bytes:
        refusals.append(
            Refusal(
                mem_loc,
                f"the job needs an estimated {need}, more than the host's RAM "
                f"({_gib(memory.host_total_bytes)}); lower micro_batch_size, seq_len or "
                "nproc_per_node",
            )
        )
    elif memory.job_bytes > memory.host_available_bytes:
        warnings.append(
            f"the job needs an estimated {need}, more than the host has free right now "
            f"({_gib(memory.host_available_bytes)})"
        )
    admission = Admission(
        model_params=m.num_params,
        max_seq_len=m.max_seq_len,
        tokens_per_step=tokens_per_step,
        memory=memory,
        data=data,
    )
    return admission, refusals, warnings
