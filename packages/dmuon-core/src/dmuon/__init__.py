"""DMuon: distributed Muon for PyTorch FSDP2 with dedicated parameter ownership.

Three lines turn an FSDP2 script into a Muon one:

```python
dmuon.dedicate_params(model, mesh)      # before fully_shard
optimizer = dmuon.Muon(model, lr=0.02)  # Muon for dedicated, AdamW for the rest
with dmuon.no_sync(model): ...          # around accumulating micro-batches
```
"""

from typing import TYPE_CHECKING

from dmuon._lazy import lazy_attributes

if TYPE_CHECKING:
    from dmuon._accumulation import no_sync
    from dmuon._clip import clip_grad_norm_
    from dmuon._comm_audit import CollectiveTally, CommAudit, StepComm
    from dmuon._comm_pending import CollectiveError
    from dmuon._manual_weight_access import parameters_updated, wait_for_updates
    from dmuon._ownership.dedicate import dedicate_params
    from dmuon._ownership.gradients import DedicatedGradientError
    from dmuon._ownership.introspection import comm_audit, dedicated_parameters, owner_plan
    from dmuon._ownership.planner import ExpertRange, OwnerPlan, default_predicate, plan_owners
    from dmuon.checkpoint import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )
    from dmuon.optim import Muon, NonFiniteGradientError, newton_schulz
    from dmuon.optim._groups import weight_decay_groups

#: Each exported name and the module that defines it, imported when first read.
_EXPORTS = {
    "no_sync": "dmuon._accumulation",
    "clip_grad_norm_": "dmuon._clip",
    "CollectiveTally": "dmuon._comm_audit",
    "CommAudit": "dmuon._comm_audit",
    "StepComm": "dmuon._comm_audit",
    "CollectiveError": "dmuon._comm_pending",
    "dedicate_params": "dmuon._ownership.dedicate",
    "DedicatedGradientError": "dmuon._ownership.gradients",
    "comm_audit": "dmuon._ownership.introspection",
    "dedicated_parameters": "dmuon._ownership.introspection",
    "owner_plan": "dmuon._ownership.introspection",
    "ExpertRange": "dmuon._ownership.planner",
    "OwnerPlan": "dmuon._ownership.planner",
    "default_predicate": "dmuon._ownership.planner",
    "plan_owners": "dmuon._ownership.planner",
    "parameters_updated": "dmuon._manual_weight_access",
    "wait_for_updates": "dmuon._manual_weight_access",
    "get_model_state_dict": "dmuon.checkpoint",
    "get_optimizer_state_dict": "dmuon.checkpoint",
    "get_state_dict": "dmuon.checkpoint",
    "set_model_state_dict": "dmuon.checkpoint",
    "set_optimizer_state_dict": "dmuon.checkpoint",
    "set_state_dict": "dmuon.checkpoint",
    "Muon": "dmuon.optim",
    "NonFiniteGradientError": "dmuon.optim",
    "newton_schulz": "dmuon.optim",
    "weight_decay_groups": "dmuon.optim._groups",
}

__all__ = [
    "CollectiveError",
    "CollectiveTally",
    "CommAudit",
    "DedicatedGradientError",
    "ExpertRange",
    "Muon",
    "NonFiniteGradientError",
    "OwnerPlan",
    "StepComm",
    "clip_grad_norm_",
    "comm_audit",
    "dedicate_params",
    "dedicated_parameters",
    "default_predicate",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "newton_schulz",
    "no_sync",
    "owner_plan",
    "parameters_updated",
    "plan_owners",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "wait_for_updates",
    "weight_decay_groups",
]

__getattr__, __dir__ = lazy_attributes("dmuon", _EXPORTS, globals())
