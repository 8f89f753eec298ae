"""The common naive way to run Muon on FSDP2, kept as a baseline for the benchmarks.

Every parameter stays sharded by FSDP2 (no ``dedicate_params``). In ``step()``, each Muon
matrix's momentum is updated on the local shard, the Nesterov-corrected shards are
all-gathered into the full matrix on every rank, every rank runs Newton-Schulz on every
matrix, and each keeps the slice of the update that belongs to its shard. That is one
extra all-gather per step (3 units for ZeRO-2-style FSDP2, 4 with resharding after forward)
and N times the Newton-Schulz work of dedicated ownership.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from dmuon._comm_audit import CommAudit
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.planner import ParamPredicate, default_predicate
from dmuon.optim._muon import Muon, adjust_lr_ratio
from dmuon.optim._orthogonalize import (
    _newton_schulz_unchecked,
    default_ns_dtype,
    resolve_coefficients,
)
from dmuon.optim._validation import group_defaults


def _full(tensor: Tensor) -> Tensor:
    """The full tensor behind a (possibly sharded) DTensor; plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local_slice(full: Tensor, like: Tensor) -> Tensor:
    """This rank's piece of ``full`` for a parameter sharded like ``like`` (on a 1-D mesh,
    or on HSDP's (replicate, shard) mesh: every ``Shard`` dimension cut in turn)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(like, DTensor):
        return full
    piece = full
    for mesh_dim, placement in enumerate(like.placements):
        if not isinstance(placement, Shard):
            continue
        rank = like.device_mesh.get_local_rank(mesh_dim)
        chunks = piece.chunk(like.device_mesh.size(mesh_dim), dim=placement.dim)
        piece = chunks[rank] if rank < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece


class NaiveMuon(Muon):
    """Muon on an FSDP2 model without dedicated ownership (a benchmark baseline).

    Takes the keyword hyperparameters of `dmuon.Muon` (same defaults) and applies the same
    math; Muon matrices are chosen with ``predicate`` (default: `dmuon.default_predicate`
    on ``nn.Linear`` weights, output heads excluded). ``audit`` records the all-gathers
    issued in ``step()``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        predicate: ParamPredicate | None = None,
        **hyperparameters: Any,
    ) -> None:
        linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        muon: list[nn.Parameter] = []
        others: list[nn.Parameter] = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            if predicate is not None:
                chosen = predicate(name, param)
            else:
                chosen = id(param) in linear_weights and default_predicate(name, param)
            (muon if chosen else others).append(param)
        if hyperparameters.get("split") is not None:
            raise ValueError(
                "NaiveMuon orthogonalizes every matrix whole; split is not supported (pass "
                "split=None)"
            )
        self.audit = CommAudit(sum(p.numel() for p in muon))
        defaults = inspect.signature(Muon.__init__).parameters
        values = {
            name: hyperparameters.pop(name, parameter.default)
            for name, parameter in defaults.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        }
        wanted = inspect.signature(group_defaults).parameters
        self._group_defaults = group_defaults(**{k: v for k, v in values.items() if k in wanted})
        hyperparameters.pop("param_groups", None)
        if hyperparameters:
            raise TypeError(f"NaiveMuon got unexpected arguments {sorted(hyperparameters)}")
        self._init_groups(
            model,
            [
                dict(self._group_defaults["muon"], params=muon, algorithm="muon"),
                dict(self._group_defaults["adamw"], params=others, algorithm="adamw"),
            ],
        )

    def _dedicated_by_id(self) -> dict[int, DedicatedParam]:
        return {}

    def _begin_updates(self, dedicated: dict[int, DedicatedParam]) -> Callable[..., None]:
        return lambda dp: None  # nothing is dedicated, nothing goes between replicas

    def _step_finished(self) -> None:
        self.audit.close_step()

    def _clear_dedicated_gradients(self, set_to_none: bool) -> None:
        return  # nothing is dedicated

    def _finite_gradients(self, dedicated: dict[int, DedicatedParam]) -> dict[int, list[Any]]:
        return {}  # nothing is owned: every rank steps its shards of every matrix below

    def _muon_step(self, group: dict[str, Any], kept: list[Any] | None) -> None:
        triples = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        momentum = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            full_update = _full(update)
            self.audit.record("all_gather", full_update)
            ns_dtype = group["ns_dtype"] or default_ns_dtype(full_update.device)
            ortho = _newton_schulz_unchecked(full_update, triples, ns_dtype, group["eps"])
            rows, cols = full_update.shape
            local = p.to_local() if hasattr(p, "to_local") else p
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(
                _local_slice(ortho, p),
                alpha=-group["lr"] * adjust_lr_ratio(group["adjust_lr_fn"], rows, cols),
            )


def naive_muon(model: nn.Module, **kwargs: Any) -> NaiveMuon:
    """Build the naive FSDP2 + Muon baseline optimizer; see `NaiveMuon` for the arguments."""
    return NaiveMuon(model, **kwargs)
