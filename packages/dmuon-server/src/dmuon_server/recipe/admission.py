"""Admission control: can the recipe run a job spec on this host?

The server never imports the recipe: it knows the presets from the recipe's torch-free
contract (``dmuon_recipe_contract.PRESETS``), counts a Hugging Face model's parameters from
its ``config.json`` (:mod:`dmuon_server.recipe.hf_models`), and estimates what a job needs from
the spec alone.

Memory per rank (bytes; float32 parameters and activations, int64 token windows)::

    parameters  = 16 * P                     weights, gradients, two optimizer states
    activations = 4 * B * T * (L * (12*d + 4*f) + 2*d + 3*V)
    batch       = 8 * (T + 1) * (A * B + ceil(64 / N))
    corpus      = 3 * min(C, 4 MiB)          tokenization's batch of text and its ids
    runtime     = 512 MiB                    interpreter, torch, gloo, allocator slack

with ``P`` parameters, micro-batch ``B``, sequence length ``T``, ``L`` layers of width
``d`` and MLP width ``f`` (for a mixture of experts, one expert's width times the experts
each token goes to), vocabulary ``V``, accumulation ``A``, ``N`` ranks, and ``C``
bytes of data to tokenize (the recipe streams it to a memory-mapped cache, a batch of
``TOKENIZE_BATCH_BYTES`` at a time; token files are not tokenized, ``C`` = 0). The
parameter term ignores sharding (every rank builds the whole model before FSDP2 shards
it), the activation term counts what autograd keeps per token and layer (norm inputs and
outputs, q/k/v, attention output, SwiGLU's four tensors) plus the logits, their
log-softmax and gradient; attention itself is the fused kernel, linear in ``T``. The job
needs ``N`` times the per-rank figure.

The data is checked the way the recipe reads it (`dmuon_recipe_contract.data_kind`): a
file, or every non-hidden, non-empty file of a folder (binary text files skipped, token
files' sidecars not counted); a symbolic link out of the folder, a token file without
its sidecar, or a vocabulary that does not fit the model is refused with the recipe's
message. The validation split is the last 5 % of a single file's tokens, or the
``ceil(5 % of the files)`` files of a folder, and both splits need at least ``T + 1``
tokens: exact for raw bytes and token files, estimated at 4 bytes per token for a
tokenizer (then only a warning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import dmuon_recipe_contract as contract
import psutil

from dmuon_server.config import format_gib
from dmuon_server.recipe.data_survey import DataFiles, builtin_corpus, scan_data, split_tokens
from dmuon_server.recipe.hf_models import HFModel
from dmuon_server.schemas import Admission, DataEstimate, MemoryEstimate, TrainSpec

#: Validation windows of the recipe (``--eval-sequences`` default).
EVAL_SEQUENCES = contract.flag("eval_sequences").default
#: Memory of one rank before the model: interpreter, torch, gloo, allocator slack.
RUNTIME_BYTES = 512 << 20
#: Bytes per token the estimates assume for a tokenizer (raw bytes: 1).
BYTES_PER_TOKEN = 4

#: The recipe's presets (``dmuon_recipe_contract.PRESETS``).
ModelShape = contract.PresetShape
RECIPE_MODELS: dict[str, ModelShape] = contract.PRESETS


@dataclass(frozen=True)
class Sizes:
    """What the memory estimate needs of a model: a preset's or a model directory's."""

    num_params: int
    n_layers: int
    dim: int
    active_ffn_dim: int
    vocab_size: int

    @classmethod
    def of(cls, model: ModelShape | HFModel) -> Sizes:
        """The sizes of a preset or of an `HFModel`."""
        return cls(model.num_params, model.n_layers, model.dim, model.active_ffn_dim,
                   model.vocab_size)  # fmt: skip


@dataclass(frozen=True)
class Refusal:
    """A reason the recipe cannot run a spec, tied to the field to change."""

    loc: tuple[str, ...]
    message: str


def estimate_memory(
    sizes: Sizes, train: TrainSpec, nproc: int, corpus_bytes: int, limit: int
) -> MemoryEstimate:
    """Memory a job needs per rank and in all (see the module docstring for the formula)."""
    b, t = train.micro_batch_size, train.seq_len
    params = 16 * sizes.num_params
    per_token = sizes.n_layers * (12 * sizes.dim + 4 * sizes.active_ffn_dim) + 2 * sizes.dim
    activations = 4 * b * t * (per_token + 3 * sizes.vocab_size)
    batch = 8 * (t + 1) * (train.accum_steps * b + math.ceil(EVAL_SEQUENCES / nproc))
    corpus = 3 * min(corpus_bytes, contract.TOKENIZE_BATCH_BYTES)
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


@dataclass(frozen=True)
class ModelInputs:
    """The model side of a spec, resolved by :func:`dmuon_server.recipe.review.review`.

    ``hf`` is None for a preset; ``label`` is how clients see the model; ``vocab`` is the
    tokenizer's vocabulary (256 for raw bytes, None when unknown).
    """

    label: str
    hf: HFModel | None
    vocab: int | None


def assess(
    train: TrainSpec,
    nproc: int,
    data_path: Path | None,
    data_label: str | None,
    limit: int,
    model: ModelInputs | None = None,
    roots: tuple[Path, ...] = (),
    limit_name: str = "--max-job-memory",
) -> tuple[Admission, list[Refusal], list[str]]:
    """Estimate what a job needs; return the figures, the refusals and the warnings.

    ``limit`` is the memory the job may use, and ``limit_name`` the setting it comes from.

    ``data_path`` is the resolved ``train.data`` (None: the built-in corpus), inside one
    of the data ``roots``, and ``data_label`` how clients see it; ``model`` the resolved
    model (None: the preset).
    """
    preset = train.preset
    model = model or ModelInputs(str(preset), None, 256)
    shape: ModelShape | HFModel = RECIPE_MODELS[preset] if preset is not None else model.hf  # type: ignore[assignment]
    refusals: list[Refusal] = []
    warnings: list[str] = []
    max_len = shape.max_seq_len if isinstance(shape, ModelShape) else shape.max_positions
    _check_model(train, model, max_len, refusals, warnings)
    found, data = _survey_data(data_path, data_label, roots, refusals)
    if found.token_counts and found.token_vocab > shape.vocab_size:
        refusals.append(Refusal(_DATA_LOC, contract.vocab_message(
            found.token_vocab, shape.vocab_size, f"token data {data.source}", model.label
        )))  # fmt: skip
    _check_splits(train.seq_len, data_path, found, data, model, refusals, warnings)
    tokens_per_step = train.micro_batch_size * train.accum_steps * nproc * train.seq_len
    if data.train_tokens and tokens_per_step > data.train_tokens:
        warnings.append(
            f"one step samples {tokens_per_step} tokens, "
            f"{tokens_per_step / data.train_tokens:.1f}x the training split: the run sees "
            "the same text many times over"
        )
    memory = estimate_memory(Sizes.of(shape), train, nproc, sum(found.text_sizes), limit)
    _check_memory(memory, nproc, limit, limit_name, refusals, warnings)
    admission = Admission(
        model=model.label,
        model_type=None if model.hf is None else model.hf.model_type,
        model_params=shape.num_params,
        params_exact=True if model.hf is None else model.hf.exact,
        max_seq_len=max_len,
        tokenizer_vocab=model.vocab,
        tokens_per_step=tokens_per_step,
        memory=memory,
        data=data,
    )
    return admission, refusals, warnings


_DATA_LOC = ("body", "train", "data")


def _check_model(
    train: TrainSpec,
    model: ModelInputs,
    max_len: int | None,
    refusals: list[Refusal],
    warnings: list[str],
) -> None:
    """Refuse a sequence longer than the model's positions; warn of an estimated count."""
    t = train.seq_len
    if max_len is not None and t > max_len:
        message = (
            f"{t} is longer than the maximum sequence length of the {train.preset} model "
            f"({max_len}); use seq_len <= {max_len}"
            if train.preset is not None
            else contract.positions_message(t, max_len, model.label)
        )
        refusals.append(Refusal(("body", "train", "seq_len"), message))
    if model.hf is not None and not model.hf.exact:
        warnings.append(
            f"model_type {model.hf.model_type!r}: its parameters are counted as a Llama-like "
            "decoder's (an estimate)"
        )


def _survey_data(
    data_path: Path | None,
    data_label: str | None,
    roots: tuple[Path, ...],
    refusals: list[Refusal],
) -> tuple[DataFiles, DataEstimate]:
    """What the job's data holds: the built-in corpus, or the files under ``data_path``."""
    if data_path is None:
        files, total = builtin_corpus()
        found = DataFiles([total // max(files, 1)] * files, [], 0, True)
        return found, DataEstimate(source="built-in", files=files, bytes=total, complete=True)
    found = scan_data(data_path, data_label or "", roots)
    data = DataEstimate(
        source=data_label or "",
        files=len(found.text_sizes) + len(found.token_counts),
        bytes=sum(found.text_sizes) + found.token_bytes,
        complete=found.complete,
        format=found.format,  # type: ignore[arg-type]
    )
    if found.problem is not None:
        refusals.append(Refusal(_DATA_LOC, found.problem))
    return found, data


def _check_splits(
    t: int,
    data_path: Path | None,
    found: DataFiles,
    data: DataEstimate,
    model: ModelInputs,
    refusals: list[Refusal],
    warnings: list[str],
) -> None:
    """Count the tokens of both splits into ``data``; refuse or warn where one is too short.

    A split shorter than one sequence is refused when its count is exact and the survey
    complete, and warned of otherwise.
    """
    bytes_per_token = 1 if model.vocab == 256 and model.hf is None else BYTES_PER_TOKEN
    if found.token_counts:
        units = list(found.token_counts)
        exact = True
    else:
        units = [max(1, n // bytes_per_token) for n in found.text_sizes]
        exact = bytes_per_token == 1
    data.tokens_exact = exact
    data.train_tokens, data.val_tokens = split_tokens(units)
    exact_split = exact and (len(units) <= 1 or sum(units) < t + 1)
    if data_path is not None and not units and found.problem is None:
        refusals.append(
            Refusal(
                _DATA_LOC,
                f"{data.source} holds no non-empty file to read (hidden and binary files are "
                "skipped); put text, .jsonl, .parquet or .bin files in it",
            )
        )
        return
    if not units:
        return
    for what, n in (("training", data.train_tokens), ("validation", data.val_tokens)):
        if n >= t + 1:
            continue
        message = (
            f"the {what} split of {data.source} has {'' if exact_split else 'about '}{n} "
            f"tokens, fewer than seq_len + 1 = {t + 1}; use a shorter seq_len or more text"
        )
        if exact_split and found.complete:
            refusals.append(Refusal(_DATA_LOC, message))
        else:
            warnings.append(message)


def _check_memory(
    memory: MemoryEstimate,
    nproc: int,
    limit: int,
    limit_name: str,
    refusals: list[Refusal],
    warnings: list[str],
) -> None:
    """Refuse a job over the server's limit or the host's RAM; warn past the free memory."""
    loc = ("body", "train", "micro_batch_size")
    per_rank = format_gib(memory.per_rank_bytes)
    need = f"{format_gib(memory.job_bytes)} ({per_rank} per rank x {nproc})"
    lower = "lower micro_batch_size, seq_len or nproc_per_node"
    if memory.job_bytes > limit:
        refusals.append(Refusal(loc, (
            f"the job needs an estimated {need}, more than this server allows per job "
            f"({format_gib(limit)}, {limit_name}); {lower}"
        )))  # fmt: skip
    elif memory.job_bytes > memory.host_total_bytes:
        refusals.append(Refusal(loc, (
            f"the job needs an estimated {need}, more than the host's RAM "
            f"({format_gib(memory.host_total_bytes)}); {lower}"
        )))  # fmt: skip
    elif memory.job_bytes > memory.host_available_bytes:
        warnings.append(
            f"the job needs an estimated {need}, more than the host has free right now "
            f"({format_gib(memory.host_available_bytes)})"
        )
