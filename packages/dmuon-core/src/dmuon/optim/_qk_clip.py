"""QK-clip (MuonClip): rescale the query and key projections of heads whose logits grew past
``tau``.

During the step's training forwards every attention layer records, per query head ``h``,
the largest logit ``S_h = max q_i . k_j * scaling`` over the positions the head sees
(`dmuon.optim._qk_logits`). At the end of ``Muon.step()``, after the update:

1. the maxima of all layers, packed in one float32 vector, are combined over every rank with
   one MAX all-reduce per mesh dimension (one on a 1-D mesh; the shard and replicate groups
   under HSDP; plus the tensor-parallel group), through the dedication's communicator;
2. each head with ``S_h > tau`` gets ``gamma_h = tau / S_h``, the others ``1``;
3. the owner that stepped a projection scales its master's rows, and every rank its share of
   the biases and norm weights, in place, so the next forward (whatever the layout) sees the
   clipped weights:

   - one key head per query head: query rows and bias times ``gamma_h ** alpha``, key rows
     and bias times ``gamma_h ** (1 - alpha)``;
   - grouped-query attention (a key head shared by several query heads): each query head
     takes its whole ``gamma_h`` and the shared key head is left alone, so a head below
     ``tau`` never changes because another head of its group was clipped;
   - a per-head norm after the projections (``q_norm`` and ``k_norm`` of Qwen3 and Gemma 3)
     makes the projections' scale irrelevant: the norms' weights are scaled instead, and
     since one weight serves all the layer's heads, by the layer's smallest ``gamma``
     (``** alpha`` on queries, ``** (1 - alpha)`` on keys).

Logits are bilinear in the query and key rows, and the rotary embedding is linear, so a
head's logits on the step's batch scale by exactly ``gamma_h``. Momentum is not rescaled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon._comm import Communicator
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.replica_updates import UpdateSlot
from dmuon.optim._qk_logits import HeadMaxima, attach, install, is_hugging_face

__all__ = ["QKClip", "QKClipReport"]


@dataclass(frozen=True)
class QKClipReport:
    """What QK-clip saw and did in the last ``step()``, the same on every rank."""

    #: ``{attention module name: its largest logit over heads}`` (``-inf``: no training
    #: forward reached it this step).
    max_logits: dict[str, float] = field(default_factory=dict)
    #: Heads whose logits exceeded ``tau`` and were scaled.
    clipped_heads: int = 0

    @property
    def max_logit(self) -> float:
        """The largest logit of any head in any layer (``-inf`` with no forward)."""
        return max(self.max_logits.values(), default=float("-inf"))


@dataclass(eq=False)
class _Layer:
    name: str
    recorder: HeadMaxima
    q: DedicatedParam
    k: DedicatedParam
    q_bias: nn.Parameter | None
    k_bias: nn.Parameter | None
    #: ``((q_norm, offset), (k_norm, offset))``: norms after the projections, whose
    #: weights act as ``offset + weight`` (Gemma's norms use ``1 + weight``).
    norms: tuple[tuple[nn.Module, float], tuple[nn.Module, float]] | None
    head_dim: int
    heads: int
    kv_heads: int
    #: Where the layer's heads start in the packed vector of maxima.
    base: int


class QKClip:
    """The QK-clip of one `dmuon.Muon`: layers found at construction, applied per step."""

    def __init__(
        self, model: nn.Module, params: list[DedicatedParam], tau: float, alpha: float
    ) -> None:
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"qk_clip (tau) must be a positive finite number, got {tau!r}")
        if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
            raise ValueError(f"qk_clip_alpha must be in [0, 1], got {alpha!r}")
        self.tau = float(tau)
        self.alpha = float(alpha)
        self.layers = _find_layers(model, params)
        #: Hugging Face attention is recorded through transformers; other models must call
        #: ``record_attention_logits``, which the first step checks.
        self._checked = is_hugging_face(model)
        if self._checked:
            install(model)
        self.report = QKClipReport()

    @torch.no_grad()
    def measure(self, comm: Communicator, groups: list[dist.ProcessGroup]) -> Tensor:
        """Agree on the step's per-head maxima over every rank (before the update, so a
        model that records nothing is refused before anything changes)."""
        total = sum(layer.heads for layer in self.layers)
        maxima = torch.full((total,), float("-inf"), device=comm.device)
        for layer in self.layers:
            local = layer.recorder.take()
            if local is not None:
                start = layer.base + _row_start(layer.q) // layer.head_dim
                maxima[start : start + local.numel()] = local.to(comm.device)
        for group in groups:
            comm.all_reduce_control(maxima, dist.ReduceOp.MAX, group)
        maxima = maxima.cpu()
        if not self._checked:
            if not bool(torch.isfinite(maxima).any()):  # the same on every rank
                raise ValueError(
                    "qk_clip recorded no attention logit in this step: a model that is not a "
                    "Hugging Face one must call dmuon.optim.record_attention_logits(self, q, k) "
                    "in its attention's forward (see its docstring)"
                )
            self._checked = True
        return maxima

    @torch.no_grad()
    def clip(
        self,
        maxima: Tensor,
        outgoing: Callable[[DedicatedParam], UpdateSlot | None] = lambda dp: None,
    ) -> QKClipReport:
        """Scale the heads whose maximum passed ``tau`` (after the update); the report.
        ``outgoing(dp)`` is where the factors go for the other replicas (HSDP)."""
        clipped = torch.isfinite(maxima) & (maxima > self.tau)
        gammas = torch.where(clipped, self.tau / maxima, torch.ones_like(maxima))
        report: dict[str, float] = {}
        for layer in self.layers:
            heads = slice(layer.base, layer.base + layer.heads)
            report[layer.name] = float(maxima[heads].max())
            if bool(clipped[heads].any()):
                self._scale(layer, gammas[heads], outgoing)
        self.report = QKClipReport(report, int(clipped.sum()))
        return self.report

    def _scale(
        self,
        layer: _Layer,
        gamma: Tensor,
        outgoing: Callable[[DedicatedParam], UpdateSlot | None],
    ) -> None:
        if layer.norms is not None:
            (q_norm, q_offset), (k_norm, k_offset) = layer.norms
            smallest = float(gamma.min())
            _scale_norm(q_norm, smallest**self.alpha, q_offset)
            _scale_norm(k_norm, smallest ** (1.0 - self.alpha), k_offset)
            return
        shared_keys = layer.kv_heads < layer.heads  # the query heads take all of gamma
        q_rows = (gamma if shared_keys else gamma**self.alpha).repeat_interleave(layer.head_dim)
        _scale_master_rows(layer.q, q_rows, outgoing(layer.q))
        _scale_vector(layer.q_bias, q_rows)
        if not shared_keys:
            k_rows = (gamma ** (1.0 - self.alpha)).repeat_interleave(layer.head_dim)
            _scale_master_rows(layer.k, k_rows, outgoing(layer.k))
            _scale_vector(layer.k_bias, k_rows)


def _find_layers(model: nn.Module, params: list[DedicatedParam]) -> list[_Layer]:
    """Every attention module with trainable ``q_proj`` and ``k_proj``; both must be
    dedicated."""
    by_fqn = {dp.fqn: dp for dp in params}
    layers: list[_Layer] = []
    base = 0
    for name, module in model.named_modules():
        q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if not isinstance(q_proj, nn.Module) or not isinstance(k_proj, nn.Module):
            continue
        if not (q_proj.weight.requires_grad and k_proj.weight.requires_grad):
            continue  # frozen attention is not trained, so not clipped
        prefix = f"{name}." if name else ""
        q, k = by_fqn.get(f"{prefix}q_proj.weight"), by_fqn.get(f"{prefix}k_proj.weight")
        if q is None or k is None:
            raise ValueError(
                f"qk_clip scales the query and key projections Muon steps, but "
                f"{prefix}q_proj.weight and {prefix}k_proj.weight are not both dedicated; "
                "dedicate them (dmuon.dedicate_params' default selection does)"
            )
        head_dim = int(getattr(module, "head_dim", 0))
        rows_q, rows_k = q.out_in_shape[0], k.out_in_shape[0]
        if (
            not head_dim
            or rows_q % head_dim
            or rows_k % head_dim
            or (rows_q // head_dim) % (rows_k // head_dim)
        ):
            raise ValueError(
                f"qk_clip: {name!r} has q rows {rows_q}, k rows {rows_k} and head_dim "
                f"{head_dim or 'missing'}, which are not whole heads with a key head per group"
            )
        layers.append(
            _Layer(
                name=name,
                recorder=attach(module),
                q=q,
                k=k,
                q_bias=_trainable(getattr(q_proj, "bias", None)),
                k_bias=_trainable(getattr(k_proj, "bias", None)),
                norms=_norms(module, head_dim),
                head_dim=head_dim,
                heads=rows_q // head_dim,
                kv_heads=rows_k // head_dim,
                base=base,
            )
        )
        base += rows_q // head_dim
    if not layers:
        raise ValueError(
            "qk_clip found no attention module with trainable q_proj and k_proj; it supports "
            "Hugging Face attention layers with separate query and key projections (Llama, "
            "Qwen2/3, Mistral, Gemma and their relatives)"
        )
    return layers


def _trainable(param: object) -> nn.Parameter | None:
    return param if isinstance(param, nn.Parameter) and param.requires_grad else None


def _norms(
    module: nn.Module, head_dim: int
) -> tuple[tuple[nn.Module, float], tuple[nn.Module, float]] | None:
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if not isinstance(q_norm, nn.Module) or not isinstance(k_norm, nn.Module):
        return None
    for norm in (q_norm, k_norm):
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.numel() != head_dim:
            raise ValueError(
                f"qk_clip scales a per-head q_norm/k_norm through its weight of head_dim "
                f"({head_dim}) elements; {type(norm).__name__} has none of that size"
            )
    return (q_norm, _weight_offset(q_norm, head_dim)), (k_norm, _weight_offset(k_norm, head_dim))


def _weight_offset(norm: nn.Module, head_dim: int) -> float:
    """``0`` for a norm that multiplies by ``weight``, ``1`` for one that multiplies by
    ``1 + weight`` (Gemma's): measured on a fresh instance of its class."""
    try:
        probe = type(norm)(head_dim)
        with torch.no_grad():
            probe.weight.fill_(2.0)
            value = float(probe(torch.ones(1, head_dim)).float().mean())
    except Exception as e:  # an unknown constructor: say what is unsupported
        raise ValueError(
            f"qk_clip cannot tell how {type(norm).__name__} applies its weight ({e})"
        ) from None
    offset = round(value - 2.0)
    if offset not in (0, 1) or abs(value - 2.0 - offset) > 1e-2:
        raise ValueError(f"qk_clip: {type(norm).__name__} scales by neither weight nor 1 + weight")
    return float(offset)


def _out_dim(dp: DedicatedParam) -> int:
    """The storage dimension of a projection's output rows (columns when transposed)."""
    return 1 if dp.transposed else 0


def _row_start(dp: DedicatedParam) -> int:
    """The first output row of this rank's share of a projection (tensor parallelism)."""
    tp = dp.tp
    if tp is None or tp.shard_dim != _out_dim(dp):
        return 0
    return tp.bounds(tp.rank)[0]


def _scale_master_rows(dp: DedicatedParam, factors: Tensor, slot: UpdateSlot | None) -> None:
    """The owner that stepped ``dp`` scales its master's output rows (its tp share), and
    writes the factors into ``slot`` for the other replicas."""
    if not dp.updates_here:
        return
    master = dp.param.detach()
    out_dim = _out_dim(dp)
    start = _row_start(dp)
    local = factors[start : start + master.shape[out_dim]].to(master.device, master.dtype)
    master.mul_(local.unsqueeze(1) if out_dim == 0 else local.unsqueeze(0))
    if slot is not None:
        slot.factors.copy_(local)


def _scale_vector(param: nn.Parameter | None, factors: Tensor) -> None:
    """Scale a bias by element, on this rank's share of it (FSDP2, tensor parallel or whole)."""
    if param is None:
        return
    if isinstance(param, DTensor):
        # Shard the factors exactly as the bias is sharded, with no communication.
        mine = distribute_tensor(
            factors.to(param.device, param.dtype),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        ).to_local()
        param.to_local().mul_(mine)
    else:
        param.detach().mul_(factors.to(param.device, param.dtype))


def _scale_norm(norm: nn.Module, factor: float, offset: float) -> None:
    """Make ``offset + weight`` ``factor`` times larger, on this rank's share of it."""
    weight = norm.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight.detach()
    local.mul_(factor).add_(offset * (factor - 1.0))
