"""Hugging Face model directories and tokenizers, read from their JSON files alone.

The server never imports torch or transformers, so admission control counts an HF
model's parameters from ``config.json`` with the formulas below, and a tokenizer's
vocabulary from ``tokenizer.json``; a test compares both with what transformers builds.

Counted exactly (``num_params``), for the families the recipe is tested on and their
close relatives:

* Llama-like decoders (``llama``, ``mistral``, ``qwen2``, ``qwen3``): embedding ``V d``;
  per layer ``q`` ``d (H h)``, ``k``/``v`` ``d (K h)`` each (with biases for ``qwen2``, or
  when ``attention_bias``), ``o`` ``(H h) d``, the MLP ``3 d f`` (biases when
  ``mlp_bias``), two norms ``2 d`` (``qwen3`` adds its ``q``/``k`` norms, ``2 h``); the
  final norm ``d``; the head ``V d`` unless tied. ``h`` is ``head_dim``, else ``d / H``.
* ``mixtral``: the same attention and norms; per layer a router ``E d`` and ``E`` experts
  of ``3 d f``.
* ``gpt2``: token and position embeddings ``V d + P d``; per layer two LayerNorms
  ``4 d``, ``c_attn`` ``3 d^2 + 3 d``, ``c_proj`` ``d^2 + d``, the MLP ``2 d i + i + d``
  (``i`` = ``n_inner``, else ``4 d``); the final LayerNorm ``2 d``; the head tied.

Another ``model_type`` with the Llama keys (``hidden_size``, ``intermediate_size``,
``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``) is counted as a
Llama-like decoder and marked approximate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract

__all__ = ["HFModel", "ModelDirError", "read_model_dir", "tokenizer_vocab"]

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
_LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


class ModelDirError(ValueError):
    """A model directory or tokenizer the recipe would refuse (the recipe's message)."""


@dataclass(frozen=True)
class HFModel:
    """The sizes of a model directory that the estimates need.

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        num_params: parameters (see the module docstring).
        exact: whether ``num_params`` follows this family's layout (else approximate).
        n_layers, dim, vocab_size: depth, width, embedding rows.
        active_ffn_dim: MLP width one token passes through (experts times ``top_k``).
        max_positions: ``max_position_embeddings`` (``n_positions``), or None.
        has_tokenizer: whether the directory holds tokenizer files.
    """

    model_type: str
    num_params: int
    exact: bool
    n_layers: int
    dim: int
    vocab_size: int
    active_ffn_dim: int
    max_positions: int | None
    has_tokenizer: bool


def _int(config: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise KeyError(keys[0])
    return default


def _llama_like(c: dict[str, Any], model_type: str) -> tuple[int, int]:
    """``(parameters, active MLP width)`` of a Llama-like decoder or Mixtral."""
    d, f, layers = (
        _int(c, "hidden_size"),
        _int(c, "intermediate_size"),
        _int(c, "num_hidden_layers"),
    )
    heads = _int(c, "num_attention_heads")
    kv = _int(c, "num_key_value_heads", default=heads)
    hd = _int(c, "head_dim", default=d // heads)
    vocab = _int(c, "vocab_size")
    qkv_bias = model_type == "qwen2" or bool(c.get("attention_bias"))
    o_bias = bool(c.get("attention_bias")) and model_type != "qwen2"
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    attention += (heads * hd + 2 * kv * hd if qkv_bias else 0) + (d if o_bias else 0)
    if model_type == "qwen3":
        attention += 2 * hd
    if model_type == "mixtral":
        experts, top_k = _int(c, "num_local_experts"), _int(c, "num_experts_per_tok")
        mlp, active = experts * (3 * d * f) + experts * d, f * top_k
    else:
        mlp, active = 3 * d * f + ((2 * f + d) if c.get("mlp_bias") else 0), f
    per_layer = attention + mlp + 2 * d
    head = 0 if c.get("tie_word_embeddings", False) else vocab * d
    return vocab * d + layers * per_layer + d + head, active


def _gpt2(c: dict[str, Any]) -> tuple[int, int]:
    d, layers = _int(c, "n_embd"), _int(c, "n_layer")
    inner = _int(c, "n_inner", default=4 * d)
    vocab, positions = _int(c, "vocab_size"), _int(c, "n_positions")
    per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * inner + inner + d)
    return vocab * d + positions * d + layers * per_layer + 2 * d, inner


def read_model_dir(path: Path, shown: str) -> HFModel:
    """Read ``config.json`` of the model directory ``path`` (shown to clients as ``shown``).

    Raises:
        ModelDirError: no ``config.json``, not JSON, remote code, or no sizes to count.
    """
    if not path.is_dir() or not contract.is_model_directory(path):
        raise ModelDirError(contract.not_model_directory_message(shown))
    try:
        config = json.loads((path / contract.HF_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"--model {shown}: config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"--model {shown}: config.json is not a JSON object")
    model_type = str(config.get("model_type"))
    if "auto_map" in config and model_type not in (*_LLAMA_LIKE, "mixtral", "gpt2"):
        raise ModelDirError(contract.remote_code_message(shown, config.get("model_type")))
    try:
        if model_type == "gpt2":
            params, active = _gpt2(config)
            dims = (_int(config, "n_layer"), _int(config, "n_embd"))
            exact = True
        elif model_type in (*_LLAMA_LIKE, "mixtral") or all(k in config for k in _LLAMA_KEYS):
            params, active = _llama_like(config, model_type)
            dims = (_int(config, "num_hidden_layers"), _int(config, "hidden_size"))
            exact = model_type in (*_LLAMA_LIKE, "mixtral")
        else:
            raise KeyError("hidden_size")
    except (KeyError, ZeroDivisionError) as e:
        raise ModelDirError(
            f"--model {shown}: config.json of model_type {model_type!r} lacks {e.args[0]!r}, "
            "so the server cannot estimate its size; use a Llama-, Mistral-, Qwen2/3-, "
            "Mixtral- or GPT-2-style config"
        ) from None
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    return HFModel(
        model_type=model_type,
        num_params=params,
        exact=exact,
        n_layers=dims[0],
        dim=dims[1],
        vocab_size=_int(config, "vocab_size"),
        active_ffn_dim=active,
        max_positions=positions if isinstance(positions, int) else None,
        has_tokenizer=any((path / n).is_file() for n in contract.TOKENIZER_FILES),
    )


def tokenizer_vocab(path: Path) -> int | None:
    """Tokens a tokenizer can produce (its vocabulary and added tokens), from
    ``tokenizer.json`` (``path`` is the file or a directory holding it); None when there
    is no ``tokenizer.json`` to read."""
    file = path if path.is_file() else path / "tokenizer.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    vocab = (data.get("model") or {}).get("vocab")
    ids: set[int] = set()
    if isinstance(vocab, dict):
        ids = {i for i in vocab.values() if isinstance(i, int)}
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs, id = position
        ids = set(range(len(vocab)))
    for token in data.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            ids.add(token["id"])
    return len(ids) if ids else None
