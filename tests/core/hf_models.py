"""Tiny Hugging Face models, a BPE tokenizer and corpora, all made at test time.

Nothing is downloaded: model directories are written from configs (optionally with
weights), the tokenizer is trained with ``tokenizers`` on generated text, and the corpora
are written as text files, JSON lines, parquet and ``.bin`` token files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

#: Embedding rows of every test model (the tokenizer below has fewer tokens).
MODEL_VOCAB = 384
TOKENIZER_VOCAB = 320
EOS = "<|endoftext|>"
MAX_POSITIONS = 64
ARCHS = ("llama", "qwen2", "mixtral", "gpt2")

_WORDS = (
    "muon",
    "owner",
    "rank",
    "shard",
    "gradient",
    "momentum",
    "matrix",
    "broadcast",
    "reduce",
    "layer",
    "token",
    "batch",
    "step",
    "norm",
    "expert",
    "router",
    "scale",
    "orthogonal",
    "iterate",
    "update",
    "weight",
    "bias",
    "head",
    "model",
    "train",
)


def config_of(
    arch: str, vocab: int = MODEL_VOCAB, positions: int = MAX_POSITIONS, **overrides: Any
) -> Any:
    """A config of ``arch`` with two layers of width 32 and no dropout; ``overrides`` set
    other fields (``tie_word_embeddings=True``, say)."""
    import transformers

    common = {"vocab_size": vocab, "max_position_embeddings": positions}
    attention = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    kinds: dict[str, tuple[Any, dict[str, Any]]] = {
        "llama": (transformers.LlamaConfig, {
            "hidden_size": 32, "intermediate_size": 64, **attention,
            "tie_word_embeddings": False, **common}),
        "qwen2": (transformers.Qwen2Config, {
            "hidden_size": 32, "intermediate_size": 64, **attention,
            "tie_word_embeddings": True, **common}),
        "mixtral": (transformers.MixtralConfig, {
            "hidden_size": 32, "intermediate_size": 48, **attention, "num_local_experts": 4,
            "num_experts_per_tok": 2, "tie_word_embeddings": False, **common}),
        "gpt2": (transformers.GPT2Config, {
            "vocab_size": vocab, "n_positions": positions, "n_embd": 32, "n_layer": 2,
            "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": 0, "eos_token_id": 0}),
    }  # fmt: skip
    if arch not in kinds:
        raise ValueError(arch)
    make, fields = kinds[arch]
    return make(**{**fields, **overrides})


def model_dir(
    path: Path,
    arch: str,
    *,
    weights_seed: int | None = None,
    tokenizer: Any = None,
    **config: Any,
) -> Path:
    """Write a model directory: ``config.json``, weights when ``weights_seed`` is given
    (a model initialized from that seed), and the tokenizer's files when one is given."""
    import torch
    import transformers

    cfg = config_of(arch, **config)
    path.mkdir(parents=True, exist_ok=True)
    if weights_seed is None:
        cfg.save_pretrained(path)
    else:
        torch.manual_seed(weights_seed)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of random words (and a non-ASCII one now and then)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(20, 60))]
        if i % 7 == 0:
            words.append("résumé")
        docs.append(" ".join(words) + ".")
    return docs


def train_tokenizer(texts: list[str], vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, with ``<|endoftext|>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)


def expected_tokens(tokenizer: Any, docs: list[str]) -> list[int]:
    """The oracle stream: every document encoded alone, joined with the EOS id."""
    out: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            out.append(tokenizer.eos_token_id)
        out.extend(tokenizer.backend_tokenizer.encode(doc, add_special_tokens=False).ids)
    return out


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    """One JSON object per document, with an extra field the recipe ignores."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for i, doc in enumerate(docs):
            out.write(json.dumps({"id": i, field: doc}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    """A parquet file of the documents in several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=max(1, len(docs) // 3))
    return path


def write_bin(path: Path, tokens: list[int], vocab_size: int, dtype: str = "uint16") -> Path:
    """A token file and its sidecar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=dtype).tofile(path)
    sidecar = path.with_name(path.name + ".json")
    sidecar.write_text(json.dumps({"dtype": dtype, "vocab_size": vocab_size}))
    return path


def write_text_folder(path: Path, docs: list[str]) -> Path:
    """One text file per document."""
    path.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (path / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return path


def rank_runs(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """Run the recipe with each ``(name, argv)`` in turn on this rank (a spawned rank of
    `dist_harness.spawn_ranks`, whose process group the recipe joins)."""
    import os
    from functools import partial

    from dist_harness import run_in_order

    from dmuon.train import run

    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)

    def one(argv: list[str]) -> dict[str, Any]:
        summary = run(argv)
        return {"final_loss": summary["final_loss"], "world_size": summary["world_size"]}

    return run_in_order((name, partial(one, argv)) for name, argv in runs)
