"""Which matrices Muon orthogonalizes: stacks per matrix, fused projections per part.

A dedicated parameter is one matrix, or a 3-D stack ``(matrices, ., .)`` of independent
matrices (the fused experts of a mixture-of-experts layer). Muon orthogonalizes each matrix
of a stack on its own. With ``split``, a matrix that fuses several projections along its
output dimension (gate and up in ``gate_up_proj``; q, k and v in a ``qkv_proj``) is cut
into its parts along that dimension, and each part is orthogonalized on its own, with the
learning-rate adjustment of the part's own ``(out, in)`` shape: the update is exactly the
one the parts would get as separate parameters.

The ``split`` argument of ``dmuon.Muon``:

* ``None`` (the default) or ``{}``: split nothing.
* ``"auto"``: split the layouts known to fuse equal parts by concatenation, namely
  transformers' ``gate_up_proj`` (an expert stack, or Phi-3's ``nn.Linear``) into gate and
  up (`dmuon._ownership.param.DedicatedParam.fused_parts`).
* ``"per_head"``: what ``"auto"`` splits, and each attention head's rows of the query,
  key and value projections on their own, read from the model's Hugging Face config
  (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``): ``q_proj`` into
  query heads, ``k_proj`` and ``v_proj`` into key-value heads, and the fused layouts that
  concatenate q, k and v (``qkv_proj``, GPT-2's ``c_attn``, ``W_pack``) into all of them.
* A mapping ``{pattern: parts}``: ``pattern`` selects parameters by name; it matches a
  parameter whose dotted name has ``pattern`` as one of its components
  (``"gate_up_proj"`` matches ``"model.layers.0.mlp.experts.gate_up_proj"``, ``"c_attn"``
  matches ``"transformer.h.0.attn.c_attn.weight"``), or whose whole name matches it as an
  ``fnmatch`` glob (``"*.self_attn.qkv_proj.weight"``). ``parts`` is an integer ``n``
  (``n`` equal parts; ``n`` must divide the output dimension) or a sequence of part sizes
  in order, summing to the output dimension (a grouped-query ``qkv_proj`` of ``q`` query
  rows and ``kv`` key and value rows is ``(q, kv, kv)``). The output dimension is the
  rows of an ``(out, in)`` matrix and the columns of an ``(in, out)`` one (``Conv1D``,
  transposed expert stacks). Only layouts that concatenate their parts qualify: the
  per-head interleaved ``query_key_value`` of GPT-NeoX or Falcon does not.
"""

from __future__ import annotations

import fnmatch
import numbers
from collections.abc import Mapping, Sequence

from torch import Tensor
from torch.nn import Module

from dmuon._ownership.param import DedicatedParam

__all__ = ["SPLIT_AUTO", "SPLIT_PER_HEAD", "Split", "matrix_pieces", "resolve_split"]

Split = str | Mapping[str, int | Sequence[int]] | None
"""What ``dmuon.Muon(split=...)`` accepts: ``"auto"``, ``"per_head"``, ``None``, or
``{pattern: parts}``."""

SPLIT_AUTO = "auto"
"""``split`` value that splits the known fused layouts (transformers' ``gate_up_proj``)."""

SPLIT_PER_HEAD = "per_head"
"""``split`` value that also orthogonalizes each attention head's q, k and v rows alone."""

#: Projections by what their rows hold: query heads, key-value heads, or q, k and v fused.
_QUERY, _KEY_VALUE, _FUSED_QKV = (
    ("q_proj", "query"),
    ("k_proj", "v_proj", "key", "value"),
    (
        "qkv_proj",
        "c_attn",
        "W_pack",
    ),
)


def _heads(model: Module | None) -> tuple[int, int, int]:
    """``(query heads, key-value heads, head dim)`` from the model's config."""
    config = getattr(model, "config", None)
    heads = next(
        (
            getattr(config, k)
            for k in ("num_attention_heads", "n_head", "n_heads")
            if getattr(config, k, None)
        ),
        None,
    )
    hidden = next(
        (getattr(config, k) for k in ("hidden_size", "n_embd", "dim") if getattr(config, k, None)),
        None,
    )
    if not heads:
        raise ValueError(
            'split="per_head" reads the head counts from the model\'s Hugging Face config '
            "(model.config.num_attention_heads), which this model has not; give the parts "
            "yourself: split={'q_proj': query_heads, 'k_proj': kv_heads, 'v_proj': kv_heads}"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    if not head_dim:
        raise ValueError('split="per_head" needs model.config.head_dim or hidden_size')
    return int(heads), int(kv_heads), int(head_dim)


def _per_head(model: Module | None, params: Sequence[DedicatedParam]) -> dict[str, tuple[int, ...]]:
    heads, kv_heads, head_dim = _heads(model)
    resolved: dict[str, tuple[int, ...]] = {}
    for dp in params:
        parts = dp.fqn.split(".")
        owner = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
        count = (
            heads if owner in _QUERY else kv_heads if owner in _KEY_VALUE
            else heads + 2 * kv_heads if owner in _FUSED_QKV else None
        )  # fmt: skip
        if count is None:
            continue
        out = dp.out_in_shape[0]
        if out != count * head_dim:
            raise ValueError(
                f'split="per_head": {dp.fqn!r} has {out} output rows, not {count} heads x '
                f"{head_dim} (model.config); give its parts with a mapping instead"
            )
        resolved[dp.fqn] = (head_dim,) * count
    return resolved


def _matches(pattern: str, name: str) -> bool:
    return pattern in name.split(".") or fnmatch.fnmatchcase(name, pattern)


def _sizes(fqn: str, out: int, parts: object, pattern: str) -> tuple[int, ...]:
    where = f"split[{pattern!r}] for {fqn!r} (output dimension {out})"
    if isinstance(parts, numbers.Integral) and not isinstance(parts, bool):
        n = int(parts)
        if n < 1 or out % n != 0:
            raise ValueError(
                f"{where}: {n} equal parts do not divide {out}; give a number of parts that "
                "divides the output dimension, or the part sizes as a sequence"
            )
        return (out // n,) * n
    if isinstance(parts, Sequence) and not isinstance(parts, (str, bytes)):
        sizes = tuple(parts)
        valid = all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in sizes)
        if sizes and valid and all(s > 0 for s in sizes) and sum(sizes) == out:
            return tuple(int(s) for s in sizes)
        raise ValueError(
            f"{where}: part sizes {parts!r} must be positive integers summing to {out}"
        )
    raise ValueError(
        f"{where}: expected a number of equal parts or a sequence of part sizes, got {parts!r}"
    )


def resolve_split(
    split: Split, params: Sequence[DedicatedParam], model: Module | None = None
) -> dict[str, tuple[int, ...]]:
    """``{fqn: output sizes of its parts}`` for every dedicated parameter that is split.

    Parameters left whole are absent. See the module docstring for what ``split`` means.

    Raises:
        ValueError: an unknown string, a malformed part count or size list, a pattern that
            matches no dedicated parameter, or two patterns matching the same parameter.
    """
    if split is None:
        return {}
    if isinstance(split, str):
        if split not in (SPLIT_AUTO, SPLIT_PER_HEAD):
            raise ValueError(
                f'split must be "auto", "per_head", None or a mapping {{name pattern: parts}}, '
                f"got {split!r}"
            )
        fused = {
            dp.fqn: (dp.out_in_shape[0] // dp.fused_parts,) * dp.fused_parts
            for dp in params
            if dp.fused_parts > 1
        }
        return fused if split == SPLIT_AUTO else {**fused, **_per_head(model, params)}
    if not isinstance(split, Mapping):
        raise ValueError(
            f'split must be "auto", None or a mapping {{name pattern: parts}}, got '
            f"{type(split).__name__}"
        )
    resolved: dict[str, tuple[int, ...]] = {}
    used: set[str] = set()
    for dp in params:
        patterns = [pattern for pattern in split if _matches(pattern, dp.fqn)]
        if len(patterns) > 1:
            raise ValueError(
                f"split patterns {patterns} all match {dp.fqn!r}; make them select disjoint "
                "parameters"
            )
        if not patterns:
            continue
        used.add(patterns[0])
        sizes = _sizes(dp.fqn, dp.out_in_shape[0], split[patterns[0]], patterns[0])
        if len(sizes) > 1:
            resolved[dp.fqn] = sizes
    unused = [pattern for pattern in split if pattern not in used]
    if unused:
        names = [dp.fqn for dp in params][:5]
        raise ValueError(
            f"split patterns {unused} match no dedicated parameter (dedicated parameters "
            f"include {names}); a pattern is a component of the dotted name (e.g. "
            "'gate_up_proj') or an fnmatch glob of the whole name"
        )
    return resolved


def matrix_pieces(tensor: Tensor, transposed: bool, sizes: tuple[int, ...] | None) -> list[Tensor]:
    """The matrices Muon orthogonalizes separately, as views of ``tensor``.

    ``tensor`` has a dedicated parameter's shape: a matrix, or a 3-D stack whose matrices
    come out one by one. With ``sizes`` each matrix is cut along its output dimension
    (rows, or columns when ``transposed``) into parts of those sizes. Views keep the
    storage orientation.
    """
    matrices = list(tensor.unbind(0)) if tensor.dim() == 3 else [tensor]
    if sizes is None:
        return matrices
    dim = 1 if transposed else 0
    return [part for matrix in matrices for part in matrix.split(list(sizes), dim=dim)]
