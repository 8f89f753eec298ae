"""Whether the parameters DMuon leaves alone are kept in step across ranks.

DMuon synchronises the dedicated matrices itself; every other trainable parameter needs
FSDP2 (``fully_shard``, its parameters become DTensors) or ``DistributedDataParallel``
(its gradients are averaged). Without either, each rank's AdamW steps its own gradients
and the ranks drift apart with no error, so the first ``optimizer.step()`` checks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.fsdp_integration import is_dedicated


def unsynchronised_parameters(model: nn.Module, state: DedicationState) -> list[str]:
    """The trainable parameters neither dedicated, nor FSDP2's, nor under a
    ``DistributedDataParallel`` the model ran in, when more than one rank trains (the
    same list on every rank: it depends on how the model was wrapped, not on data)."""
    if state.runtime.comm.total_ranks <= 1 or state.runtime.ddp() is not None:
        return []
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and not is_dedicated(p) and not isinstance(p, DTensor)
    ]


def check_wrapped(model: nn.Module, state: DedicationState) -> None:
    """Raise on every rank when parameters other than the dedicated ones would train apart
    on each rank (see the module docstring)."""
    loose = unsynchronised_parameters(model, state)
    if loose:
        raise ValueError(
            f"{len(loose)} trainable parameters that dmuon.dedicate_params left to AdamW "
            f"({loose[:3]}) are neither sharded by FSDP2 nor in a DistributedDataParallel, "
            f"so each of the {state.runtime.comm.total_ranks} ranks would train its own "
            "copy and they would drift apart. Wrap the model after dedicate_params: "
            "fully_shard(block) for each block and fully_shard(model), or "
            "DistributedDataParallel(model) (and pass the wrapper to forward and no_sync)."
        )
