"""Token streams and the deterministic global-batch sampler (the equivalence contract).

Sampling rule
-------------
The batch of optimizer step ``s`` (1-based) is defined on the **global** batch, never per
rank: ``G = world_size * accum_steps * micro_batch_size`` windows of ``seq_len + 1``
tokens whose start offsets are ``torch.randint`` draws from a generator seeded by
``(seed, s)`` alone. Rank ``r`` takes the ``r``-th contiguous block of
``accum_steps * micro_batch_size`` windows and cuts it, in order, into ``accum_steps``
micro-batches of ``micro_batch_size``.

Hence any two runs with the same seed and the same ``G`` see exactly the same sequences
at every step, whatever the split between processes, accumulation and micro-batch size
is, and whatever the data format (text, records and token files all become one token
stream): ``torchrun --nproc_per_node 2`` with micro-batch ``m`` matches one process with
micro-batch ``2m`` (or accumulation ``2k``). Because every micro-batch holds the same
number of tokens, the mean over micro-batches (loss divided by ``accum_steps``) and the
average over ranks equal the mean over the global batch.

Validation uses ``n`` fixed windows evenly spaced over the validation stream (independent
of the seed), rounded up to a multiple of the world size and split into contiguous
per-rank blocks; the loss is the token-weighted mean over all of them.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["GlobalBatchSampler", "TokenStream", "validation_windows"]


class TokenStream:
    """One sequence of token ids made of 1-D arrays laid end to end (memory maps, usually).

    Windows that cross from one array into the next are read from both; nothing is
    copied beyond the windows asked for.
    """

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        """Join ``parts`` (1-D unsigned integer arrays, possibly memory-mapped)."""
        self.parts = [p for p in parts if p.size > 0]
        self._starts = [0]
        for part in self.parts:
            self._starts.append(self._starts[-1] + int(part.size))

    @classmethod
    def of(cls, tokens: TokenStream | Tensor | np.ndarray) -> TokenStream:
        """A stream over ``tokens`` (a stream, a 1-D tensor or a 1-D array)."""
        if isinstance(tokens, TokenStream):
            return tokens
        if isinstance(tokens, Tensor):
            tokens = tokens.numpy()
        return cls([np.asarray(tokens)])

    def numel(self) -> int:
        """Number of tokens."""
        return self._starts[-1]

    __len__ = numel

    @property
    def dtype(self) -> np.dtype:
        """Element type of the stored ids."""
        return self.parts[0].dtype if self.parts else np.dtype(np.uint8)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start`` to ``stop - 1`` as one array (a view when inside one part)."""
        first = bisect.bisect_right(self._starts, start) - 1
        pieces = []
        index = first
        while start < stop and index < len(self.parts):
            offset = start - self._starts[index]
            take = min(stop, self._starts[index + 1]) - start
            pieces.append(self.parts[index][offset : offset + take])
            start += take
            index += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)

    def windows(self, starts: Tensor, length: int) -> Tensor:
        """``int64`` tensor (len(starts), length) of the windows beginning at ``starts``."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            out[row] = self.read(start, start + length)
        return torch.from_numpy(out)

    def tolist(self) -> list[int]:
        """Every token as a Python list (for small streams and tests)."""
        return self.read(0, self.numel()).tolist()


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.blake2b(f"dmuon.train:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _check_length(tokens: TokenStream, seq_len: int, what: str) -> None:
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"the {what} split has {tokens.numel()} tokens, fewer than --seq-len + 1 = "
            f"{seq_len + 1}; use a shorter --seq-len or more text"
        )


class GlobalBatchSampler:
    """Deterministic batches of token windows, defined on the global batch.

    See the module docstring for the rule. ``global_batch(step)`` returns all
    ``world_size * accum_steps * micro_batch_size`` windows of a step; ``rank_batch``
    returns this rank's slice shaped ``(accum_steps, micro_batch_size, seq_len + 1)``.
    """

    def __init__(
        self,
        tokens: TokenStream | Tensor | np.ndarray,
        *,
        seq_len: int,
        micro_batch_size: int,
        accum_steps: int,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        """Prepare sampling of ``seq_len + 1``-token windows from a token stream."""
        self.tokens = TokenStream.of(tokens)
        _check_length(self.tokens, seq_len, "training")
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.accum_steps = accum_steps
        self.world_size = world_size
        self.seed = seed
        self._num_windows = self.tokens.numel() - seq_len

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.world_size * self.accum_steps * self.micro_batch_size

    def global_starts(self, step: int) -> Tensor:
        """Start offsets of the ``global_batch_size`` windows of ``step``."""
        gen = torch.Generator().manual_seed(_step_seed(self.seed, step))
        return torch.randint(0, self._num_windows, (self.global_batch_size,), generator=gen)

    def global_batch(self, step: int) -> Tensor:
        """All windows of ``step`` as ``int64`` of shape (global_batch_size, seq_len + 1)."""
        return self.tokens.windows(self.global_starts(step), self.seq_len + 1)

    def rank_batch(self, step: int, rank: int = 0) -> Tensor:
        """Rank ``rank``'s windows of ``step``: (accum_steps, micro_batch_size, seq_len + 1)."""
        per_rank = self.accum_steps * self.micro_batch_size
        starts = self.global_starts(step)[rank * per_rank : (rank + 1) * per_rank]
        windows = self.tokens.windows(starts, self.seq_len + 1)
        return windows.view(self.accum_steps, self.micro_batch_size, self.seq_len + 1)


def validation_windows(
    tokens: TokenStream | Tensor | np.ndarray,
    *,
    seq_len: int,
    num_sequences: int,
    world_size: int = 1,
    rank: int = 0,
) -> Tensor:
    """This rank's block of the fixed, evenly spaced validation windows.

    ``num_sequences`` is rounded up to a multiple of ``world_size``; windows are
    ``seq_len + 1`` tokens, spread evenly from the start to the end of ``tokens``
    (they overlap when the validation split is short). Returns ``int64`` of shape
    (num_sequences_rounded / world_size, seq_len + 1).
    """
    stream = TokenStream.of(tokens)
    _check_length(stream, seq_len, "validation")
    total = math.ceil(num_sequences / world_size) * world_size
    last = stream.numel() - (seq_len + 1)
    starts = torch.linspace(0, last, total, dtype=torch.float64).round().long()
    per_rank = total // world_size
    return stream.windows(starts[rank * per_rank : (rank + 1) * per_rank], seq_len + 1)
