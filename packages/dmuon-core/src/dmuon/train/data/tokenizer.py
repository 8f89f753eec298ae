"""Tokenizers of the recipe: raw bytes for the presets, Hugging Face tokenizers otherwise.

``--tokenizer PATH`` takes a ``tokenizer.json`` file or a directory ``AutoTokenizer``
loads (offline, no remote code); by default a model directory's own tokenizer is used and
a preset reads raw bytes. Documents are joined with the tokenizer's EOS token (``\\n``,
byte 10, for raw bytes). A tokenizer whose vocabulary is larger than the model's
embedding is refused, naming both sizes (`check_fits`).

Both kinds can save themselves as files ``AutoTokenizer.from_pretrained`` loads (`save`):
the byte-level one as a ``tokenizers`` BPE model with the 256 byte symbols of GPT-2's
byte-level alphabet and no merges, so that token id ``b`` is byte ``b``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "check_fits", "load_tokenizer"]

#: Names an EOS token goes by, tried in order for a bare ``tokenizer.json``.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")


class ByteTokenizer:
    """Raw UTF-8 bytes: vocabulary 256, documents joined with ``\\n``."""

    vocab_size = 256
    separator = 10
    name = "bytes"
    fingerprint = "bytes"
    dtype = np.uint8

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The UTF-8 bytes of every text."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """The text of byte ids (an incomplete UTF-8 sequence shown as U+FFFD)."""
        return bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer``."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        by_byte = _byte_symbols()
        assert set(by_byte) == set(alphabet)
        backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(by_byte)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(directory)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-symbol table: the symbol of byte ``b`` at index ``b``."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@dataclass
class HFTokenizer:
    """A Hugging Face (fast) tokenizer loaded from local files.

    Attributes:
        tokenizer: the ``transformers`` tokenizer.
        name: the path it came from.
        separator: the EOS token id documents are joined with.
    """

    tokenizer: Any
    name: str
    separator: int
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(self.tokenizer.backend_tokenizer.to_str().encode("utf-8"))
        digest.update(f"\0eos={self.separator}".encode())
        self.fingerprint = digest.hexdigest()

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: its vocabulary and added tokens."""
        return len(self.tokenizer)

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        """The smallest unsigned type that holds every id."""
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of every text, without special tokens (parallel, in Rust)."""
        backend = self.tokenizer.backend_tokenizer
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [
            np.asarray(e.ids, dtype=self.dtype) for e in encode(texts, add_special_tokens=False)
        ]

    def decode(self, ids: list[int]) -> str:
        """The text of token ids."""
        return str(self.tokenizer.decode(ids))

    def save(self, directory: Path) -> None:
        """Write the tokenizer's files (``save_pretrained``)."""
        self.tokenizer.save_pretrained(directory)


TextTokenizer = ByteTokenizer | HFTokenizer


def _load_hf(path: Path, shown: str) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if path.is_file():
            if path.suffix != ".json":
                raise ValueError(
                    f"--tokenizer {shown} is a file but not a tokenizer.json; pass a "
                    "tokenizer.json or a directory AutoTokenizer loads"
                )
            from tokenizers import Tokenizer

            try:
                backend = Tokenizer.from_file(str(path))
            except Exception as exc:
                raise ValueError(f"--tokenizer {shown}: not a tokenizer.json ({exc})") from None
            return PreTrainedTokenizerFast(tokenizer_object=backend)
        try:
            return AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"--tokenizer {shown}: AutoTokenizer cannot load this directory ({exc}); "
                "pass a directory with tokenizer.json (and tokenizer_config.json), or a "
                "tokenizer.json file"
            ) from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _eos_id(tokenizer: Any, shown: str) -> int:
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for name in _EOS_NAMES:
        if name in vocab:
            return int(vocab[name])
    raise ValueError(
        f"--tokenizer {shown} has no EOS token to join documents with (none set, and none "
        f"of {', '.join(_EOS_NAMES)} in its vocabulary); save it with save_pretrained and "
        "eos_token set, or add one of those tokens"
    )


def load_tokenizer(path: str | Path | None, model_dir: Path | None) -> TextTokenizer:
    """The tokenizer of a run: ``--tokenizer PATH``, else the model directory's, else bytes.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a tokenizer, no fast tokenizer, no EOS token, or a model
            directory without a tokenizer and no ``--tokenizer``.
    """
    if path is None and model_dir is None:
        return ByteTokenizer()
    if path is None:
        assert model_dir is not None
        if not any((model_dir / n).is_file() for n in contract.TOKENIZER_FILES):
            raise ValueError(contract.no_tokenizer_message(str(model_dir)))
        source, shown = model_dir, str(model_dir)
    else:
        source, shown = Path(path).expanduser(), str(path)
        if not source.exists():
            raise FileNotFoundError(
                f"--tokenizer {shown} does not exist; pass a tokenizer.json or a tokenizer "
                "directory"
            )
        source = source.resolve()
    tokenizer = _load_hf(source, shown)
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ValueError(
            f"--tokenizer {shown} is a slow (Python) tokenizer; the recipe needs a fast one "
            "(a tokenizer.json), which AutoTokenizer.from_pretrained(..., use_fast=True) "
            "and save_pretrained write"
        )
    return HFTokenizer(tokenizer, str(source), _eos_id(tokenizer, shown))


def check_fits(vocab_size: int, model_vocab: int, what: str, model: str) -> None:
    """Refuse token ids that would not fit the model's embedding.

    Raises:
        ValueError: ``vocab_size`` (of ``what``) exceeds ``model_vocab``.
    """
    if vocab_size > model_vocab:
        raise ValueError(contract.vocab_message(vocab_size, model_vocab, what, model))
