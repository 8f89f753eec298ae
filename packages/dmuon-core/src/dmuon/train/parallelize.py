"""Process group, mesh, dedication, activation checkpointing, compile, FSDP2, the optimizer.

The order is the drop-in order of the library (and torchtitan's): per-layer
transformations first (activation checkpointing, ``torch.compile``), then
`dmuon.dedicate_params`, then ``fully_shard`` on every decoder layer and on the root, then
the optimizer:

```python
z3 = mode == "z3"
dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, param_dtype=...)  # dmuon only
for layer in layers:                                    # when world_size > 1
    fully_shard(layer, mesh=mesh, reshard_after_forward=z3, mp_policy=policy)
fully_shard(model, mesh=mesh, reshard_after_forward=z3, mp_policy=policy)
optimizer = dmuon.Muon(model, lr=..., adamw_lr=...)
```

Activation checkpointing and compile replace a layer's ``forward`` in place (the module
and its parameter names stay as they are, so checkpoints and the HF export do not see
them); FSDP2's and DMuon's hooks stay outside both.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dmuon

__all__ = [
    "DistEnv",
    "apply_activation_checkpointing",
    "apply_compile",
    "build_mesh",
    "build_optimizer",
    "check_hsdp_degree",
    "init_distributed",
    "parallelize",
]


@dataclass
class DistEnv:
    """Where this process runs: rank, world size, device, and whether it owns the group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    owns_process_group: bool

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1


def want_cuda(device: str) -> bool:
    """Whether ``--device`` selects CUDA (``auto``: when available).

    Raises:
        RuntimeError: ``--device cuda`` without a CUDA device.
    """
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but no CUDA device is available")
        return True
    return device == "auto" and torch.cuda.is_available()


def init_distributed(device: str, timeout_s: float | None = None) -> DistEnv:
    """Join torchrun's process group (when ``WORLD_SIZE`` > 1) and pick the device.

    ``timeout_s`` is how long a collective waits for every process before it fails (a
    dead or stalled process); None keeps torch's default.
    """
    cuda = want_cuda(device)
    owns = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        owns = True
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda:
        where = torch.device("cuda", local_rank)
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    return DistEnv(rank, world, local_rank, local_world, where, owns)


def check_hsdp_degree(replicas: int, world_size: int) -> int:
    """Validate ``--hsdp R`` against the number of processes; return ``R``.

    Raises:
        ValueError: ``R`` does not divide the world size.
    """
    if world_size % replicas != 0:
        raise ValueError(
            f"--hsdp {replicas} needs a number of processes divisible by {replicas}, but "
            f"this run has {world_size} (torchrun's --nnodes x --nproc-per-node). Pass "
            "--hsdp R with R dividing the process count, usually R = the number of nodes, "
            "or --hsdp 1 for a 1-D mesh."
        )
    return replicas


def check_ns_split(ns_split: int, world_size: int, replicas: int) -> None:
    """Validate ``--ns-split G`` against the shard size (``world_size / replicas``).

    Raises:
        ValueError: ``G`` does not divide the shard size.
    """
    shard = world_size // replicas
    if shard % ns_split != 0:
        raise ValueError(
            f"--ns-split {ns_split} needs a shard size divisible by {ns_split}, but this run "
            f"has {shard} process(es) per replica ({world_size} processes, --hsdp "
            f"{replicas}). Pass --ns-split G with G dividing {shard} (the GPUs of one node, "
            "usually), or --ns-split 1."
        )


def build_mesh(env: DistEnv, replicas: int) -> Any:
    """The data-parallel mesh: 1-D, or HSDP's 2-D ``(replicate, shard)``; None for one process."""
    if not env.distributed:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if replicas > 1:
        return init_device_mesh(
            env.device.type,
            (replicas, env.world_size // replicas),
            mesh_dim_names=("replicate", "shard"),
        )
    return init_device_mesh(env.device.type, (env.world_size,))


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(layers: list[nn.Module]) -> None:
    """Recompute every layer's activations in backward (non-reentrant checkpointing)."""
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)  # type: ignore[method-assign]


def apply_compile(layers: list[nn.Module]) -> None:
    """``torch.compile`` every layer's forward (the layers share one compiled graph)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]


def parallelize(
    model: nn.Module,
    layers: list[nn.Module],
    mesh: Any,
    *,
    optimizer: str,
    mode: str,
    param_dtype: torch.dtype | None,
    activation_checkpointing: bool,
    compile: bool,
    reduce_dtype: torch.dtype | None = None,
    broadcast_dtype: torch.dtype | None = None,
    ns_split: int = 1,
) -> dict[str, int]:
    """Apply compile, activation checkpointing, dedication and FSDP2 to ``model`` in place.

    ``param_dtype`` (bfloat16 or None) and ``reduce_dtype`` (None: float32) make one
    ``MixedPrecisionPolicy`` for FSDP2 (`mixed_precision`), and dedication is given the
    same values (its first forward checks that they agree); ``param_dtype`` needs a mesh
    (one process uses ``torch.autocast`` instead, see `dmuon.train.loop`).
    ``broadcast_dtype`` is dedication's alone (None: the compute dtype); ``ns_split`` is
    `dedicate_params`'s. Returns `dedicate_params`'s owners (empty for the AdamW
    baseline).
    """
    if compile:
        apply_compile(layers)
    if activation_checkpointing:
        apply_activation_checkpointing(layers)
    z3 = mode == "z3"
    distributed_dtype = param_dtype if mesh is not None else None
    owners: dict[str, int] = {}
    if optimizer == "dmuon":
        boundaries = {id(layer) for layer in layers}
        owners = dmuon.dedicate_params(
            model,
            mesh,
            reshard_after_forward=z3,
            hook_boundary_predicate=lambda module: id(module) in boundaries,
            param_dtype=distributed_dtype,
            reduce_dtype=reduce_dtype,
            broadcast_dtype=broadcast_dtype,
            ns_split=ns_split,
        )
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        # One policy holds the forward and reduce dtypes of every parameter; dedication
        # was given the same values, and its first forward checks that they agree.
        policy = mixed_precision(distributed_dtype, reduce_dtype)
        # The same mode for FSDP2's parameters, or Z2 would still all-gather them before
        # every backward.
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=z3, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=z3, mp_policy=policy)
    return owners


def mixed_precision(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the recipe's ``--param-dtype`` and
    ``--reduce-dtype``: gradients are summed in ``reduce_dtype`` (float32 by default) for
    every parameter, dedicated or not."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None and reduce_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or torch.float32)


def build_optimizer(
    model: nn.Module,
    *,
    optimizer: str,
    lr: float,
    adamw_lr: float,
    ns_dtype: str,
    variant: str = "muon",
    weight_decay: float = 0.0,
    adamw_weight_decay: float = 0.01,
    momentum: float = 0.95,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    split: str = "none",
    qk_clip: float | None = None,
) -> torch.optim.Optimizer:
    """``dmuon.Muon`` (Muon, or NorMuon with ``variant="normuon"``, on the dedicated
    matrices, AdamW on the rest; ``split`` and ``qk_clip`` as ``dmuon.Muon`` takes them,
    ``"none"`` for no split) or the baseline ``torch.optim.AdamW`` on everything, with the
    hyperparameters DMuon's AdamW uses."""
    if optimizer == "dmuon":
        dtype = None if ns_dtype == "auto" else getattr(torch, ns_dtype)
        return dmuon.Muon(
            model,
            lr=lr,
            adamw_lr=adamw_lr,
            ns_dtype=dtype,
            variant=variant,
            weight_decay=weight_decay,
            momentum=momentum,
            adamw_weight_decay=adamw_weight_decay,
            adamw_betas=adamw_betas,
            split=None if split == "none" else split,
            qk_clip=qk_clip,
        )
    return torch.optim.AdamW(
        model.parameters(),
        lr=adamw_lr,
        betas=adamw_betas,
        eps=1e-8,
        weight_decay=adamw_weight_decay,
    )
