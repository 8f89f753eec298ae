"""Keep ``DistributedDataParallel`` away from dedicated parameters, and run beside it.

DDP reads the names in ``module._ddp_params_and_buffers_to_ignore`` when it is built and
leaves those parameters out of its buckets, its shape check and its initial broadcast.
`dedicate_params` adds the dedicated parameters' names there, so the user's
``DistributedDataParallel(model)`` call needs no argument: DDP all-reduces everything else,
DMuon reduces each dedicated gradient to its owner and broadcasts the updated matrix in
the next forward (2 units per step for the dedicated matrices in Z2, what DDP's all-reduce
would cost, with Newton-Schulz run once per matrix instead of on every rank).

DDP issues its all-reduces from its own autograd hooks, in an order that depends on which
gradients are ready when; DMuon issues its broadcasts and reduces from its boundary hooks.
On one process group the two sequences could interleave differently on different ranks
(a model whose graph depends on the data), which gloo and NCCL cannot match. So, the first
time a forward runs inside DDP, the ownership runtime moves DMuon's collectives to a
process group of its own over the same ranks (`dmuon._comm.separate_group`).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def keep_out_of_ddp(model: nn.Module, names: list[str]) -> None:
    """Add ``names`` (parameters of ``model``) to what a later DDP wrapper leaves alone."""
    existing = list(getattr(model, _IGNORE_ATTR, []))
    merged = existing + [n for n in names if n not in existing]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, merged)


def active_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper whose forward is running ``model`` right now, if any."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    return ddp if ddp is not None and ddp.module is model else None
