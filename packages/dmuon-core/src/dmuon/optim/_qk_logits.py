"""Recording each attention head's largest logit, through transformers' attention registry.

QK-clip needs, per attention head ``h``, ``S_h = max_{i,j} q_i . k_j * scaling`` over the
positions the head attends to, in every training forward of the step. Hugging Face
attention layers call the function that ``model.config._attn_implementation`` names in
transformers' ``AttentionInterface`` with the query and key states after the rotary
embedding. `install` registers, under a name of its own, a function that records the
maxima and then calls the model's own implementation (``sdpa``, ``eager`` or a flash
kernel) unchanged, with that implementation's mask function; the model's code is not
touched. A model of one's own calls `record_attention_logits` from its attention's forward
instead (the recipe's presets do).

The logits are computed a second time, in float32 and without gradient, in chunks of
queries so the extra memory stays bounded. Only the positions the mask lets a query see
count: the causal triangle (with the offset of a key-value cache), a sliding window, and
padding, in whichever form the implementation's mask arrives (none, boolean, additive, or
a flash kernel's 2-D padding mask). Only modules in training mode record, so evaluation
between steps does not move the step's maxima.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "SUPPORTED_IMPLEMENTATIONS",
    "HeadMaxima",
    "attach",
    "install",
    "is_hugging_face",
    "record_attention_logits",
]

#: The attention implementations whose masks `_valid_positions` understands.
SUPPORTED_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)

_PREFIX = "dmuon_qk_clip|"

#: Logit elements computed at once per chunk of queries (float32: 256 MiB).
_CHUNK_ELEMENTS = 1 << 26

_ATTR = "_dmuon_head_maxima"


class HeadMaxima:
    """The running per-head maximum logit of one attention module in this step."""

    def __init__(self) -> None:
        #: ``(local query heads,)`` float32, ``-inf`` before any training forward.
        self.values: Tensor | None = None

    def update(self, maxima: Tensor) -> None:
        """Fold one forward's per-head maxima in."""
        if self.values is None or self.values.shape != maxima.shape:
            self.values = maxima
        else:
            torch.maximum(self.values, maxima, out=self.values)

    def take(self) -> Tensor | None:
        """The step's maxima (``None`` if nothing was recorded); starts the next step."""
        values, self.values = self.values, None
        return values


def attach(module: nn.Module) -> HeadMaxima:
    """Give an attention module a recorder (or return the one it has)."""
    global _record_eagerly
    if _record_eagerly is _record:
        # Done here, not at import: ``torch.compiler.disable`` loads torch's compiler
        # (0.8 s of CPU), which a process that never clips should not pay. The recording
        # sites call `_record_eagerly` only for a module that has a recorder, so only once
        # this has run.
        _record_eagerly = torch.compiler.disable(_record)
    existing = module.__dict__.get(_ATTR)
    if isinstance(existing, HeadMaxima):
        return existing
    recorder = HeadMaxima()
    object.__setattr__(module, _ATTR, recorder)  # a plain attribute, not a submodule
    return recorder


def record_attention_logits(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None = None,
    *,
    scaling: float | None = None,
    is_causal: bool = True,
) -> None:
    """Record an attention layer's per-head maximum logits for ``dmuon.Muon(qk_clip=...)``.

    Hugging Face models need no call: their attention is recorded through transformers'
    ``AttentionInterface``. A model of one's own calls this in its attention's forward,
    with the query and key states as attention sees them (after any rotary embedding);
    it does nothing unless the module belongs to a QK-clipped optimizer and is in training
    mode, and is skipped by ``torch.compile``.

    Args:
        module: the attention module, holding ``q_proj`` and ``k_proj``.
        query: ``(batch, heads, queries, head_dim)``.
        key: ``(batch, kv_heads, keys, head_dim)``; query head ``h`` reads key head
            ``h // (heads // kv_heads)``.
        attention_mask: ``None``, or a boolean (``True``: attend) or additive mask
            broadcastable to ``(batch, heads, queries, keys)``.
        scaling: the factor applied to ``q . k`` (default ``head_dim ** -0.5``).
        is_causal: with no mask, whether query ``i`` sees only keys up to ``i``.
    """
    recorder = module.__dict__.get(_ATTR)
    if recorder is not None and module.training:
        kwargs = {"scaling": scaling, "is_causal": is_causal}
        _record_eagerly(recorder, module, query, key, attention_mask, kwargs)


def is_hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` dispatches attention through transformers' ``AttentionInterface``."""
    config = getattr(model, "config", None)
    return hasattr(config, "_attn_implementation") and hasattr(model, "set_attn_implementation")


def install(model: nn.Module) -> str:
    """Route a Hugging Face model's attention through the recording function; return
    the implementation it wraps.

    Raises:
        ValueError: the model is not a Hugging Face one, or its attention implementation is
            one whose masks cannot be read (flex or paged attention).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not is_hugging_face(model):
        raise ValueError(
            "install() routes a Hugging Face model's attention; other models call "
            "dmuon.optim.record_attention_logits themselves"
        )
    current = model.config._attn_implementation
    inner = (current or "eager").removeprefix(_PREFIX)
    if inner not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"qk_clip cannot read the masks of attn_implementation={inner!r}; load the model "
            f"with one of {list(SUPPORTED_IMPLEMENTATIONS)} (sdpa is transformers' default)"
        )
    name = _PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _recording(inner))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    if current != name:
        model.set_attn_implementation(name)
    return inner


def _recording(inner: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> Any:
        recorder = module.__dict__.get(_ATTR)
        if recorder is not None and module.training:
            _record_eagerly(recorder, module, query, key, attention_mask, kwargs)
        implementation = _eager_of(module) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
        return implementation(module, query, key, value, attention_mask, **kwargs)

    return attention


def _eager_of(module: nn.Module) -> Callable[..., Any]:
    """The model family's own eager attention (Gemma 2's soft-capping, say)."""
    family = sys.modules[type(module).__module__]
    function = getattr(family, "eager_attention_forward", None)
    if function is None:
        raise ValueError(
            f"{type(module).__name__} has no eager_attention_forward in its modeling file; "
            "load the model with attn_implementation='sdpa' to use qk_clip"
        )
    return function  # type: ignore[no-any-return]


@torch.no_grad()
def _record(
    recorder: HeadMaxima,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: Any,
    kwargs: dict[str, Any],
) -> None:
    recorder.update(head_maxima(module, query, key, attention_mask, kwargs))


#: `_record` as ``torch.compile`` leaves it, once `attach` has wrapped it.
_record_eagerly: Callable[..., None] = _record


def head_maxima(
    module: nn.Module, query: Tensor, key: Tensor, attention_mask: Any, kwargs: dict[str, Any]
) -> Tensor:
    """``(query heads,)``: each head's largest ``q . k * scaling`` over the positions it sees.

    ``query`` is ``(batch, heads, queries, dim)`` and ``key`` ``(batch, kv heads, keys,
    dim)``; query head ``h`` reads key head ``h // (heads // kv heads)``.
    """
    batch, heads, queries, _ = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    k = key.float().repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2)
    q = query.float()
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * keys))
    best = torch.full((heads,), float("-inf"), device=query.device)
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        logits = q[:, :, start:stop] @ k * scaling
        valid = _valid_positions(attention_mask, start, stop, queries, keys, causal, window)
        if valid is not None:
            logits = logits.masked_fill(~valid.to(logits.device), float("-inf"))
        torch.maximum(best, logits.amax(dim=(0, 2, 3)), out=best)
    return best


def _valid_positions(
    mask: Any,
    start: int,
    stop: int,
    queries: int,
    keys: int,
    causal: bool,
    window: int | None,
) -> Tensor | None:
    """Which ``(query, key)`` pairs of queries ``[start, stop)`` are attended, broadcastable
    to ``(batch, heads, stop - start, keys)``; ``None`` for all of them."""
    if isinstance(mask, Tensor) and mask.dim() == 4:
        rows = mask[:, :, start:stop, :keys]
        if rows.dtype == torch.bool:
            return rows
        return rows > torch.finfo(rows.dtype).min / 2  # an additive mask: 0 or the minimum
    if mask is not None and not isinstance(mask, Tensor):
        raise ValueError(
            f"qk_clip cannot read an attention mask of type {type(mask).__name__}; use the "
            "sdpa, eager or flash attention implementation"
        )
    valid: Tensor | None = None
    if (causal and queries > 1) or window is not None:
        position = torch.arange(start, stop).unsqueeze(1) + (keys - queries)
        key_position = torch.arange(keys).unsqueeze(0)
        valid = key_position <= position if causal else torch.ones(1, dtype=torch.bool)
        if window is not None:
            valid = valid & (position - key_position < window)
        valid = valid[None, None]
    if isinstance(mask, Tensor):  # a flash kernel's (batch, keys) padding mask
        padding = mask[:, None, None, :keys].bool()
        valid = padding if valid is None else valid.to(mask.device) & padding
    return valid
