"""Mixture-of-experts layouts: fused expert stacks and the routing gates beside them.

transformers stores the experts of a mixture-of-experts layer (Mixtral, Qwen2-MoE,
Qwen3-MoE and others) as fused 3-D parameters on one module that is not an ``nn.Linear``:
``gate_up_proj`` of shape ``(experts, 2 * intermediate, hidden)`` and ``down_proj`` of
shape ``(experts, hidden, intermediate)``, each expert's matrix stored ``(out, in)``. The
module is recognised by that layout, not by its class name, so any module exposing the
same parameters is treated alike. Modules decorated by transformers'
``use_experts_implementation`` also say whether their matrices are stored ``(in, out)``
(``is_transposed``) and whether gate and up are concatenated (``is_concatenated``) or
interleaved.

The router (``mlp.gate``, ``experts x hidden``) and other gates held by a sibling of the
experts module (Qwen2-MoE's ``shared_expert_gate``) are not selected by default: see
`routing_gate_ids`.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "EXPERT_STACK_MARKERS",
    "EXPERT_STACK_NAMES",
    "expert_stacks",
    "fused_gate_up_parts",
    "routing_gate_ids",
    "stores_in_out",
]

#: A module holding a 3-D parameter with one of these names is a fused experts module.
EXPERT_STACK_MARKERS: tuple[str, ...] = ("gate_up_proj", "down_proj")

#: The 3-D parameters of such a module that are expert stacks (one matrix per expert).
EXPERT_STACK_NAMES: tuple[str, ...] = ("gate_up_proj", "down_proj", "up_proj", "gate_proj")


def expert_stacks(module: nn.Module) -> tuple[str, ...]:
    """Attribute names of the fused expert stacks that ``module`` holds directly.

    A module qualifies when it holds a 3-D parameter named like `EXPERT_STACK_MARKERS`;
    its 3-D parameters named like `EXPERT_STACK_NAMES` are then returned, provided they
    agree on the number of experts (their leading dimension). Anything else gives ``()``.
    """
    stacks = {
        name: param
        for name, param in module._parameters.items()
        if param is not None and param.ndim == 3 and name in EXPERT_STACK_NAMES
    }
    if not any(name in stacks for name in EXPERT_STACK_MARKERS):
        return ()
    if len({int(param.shape[0]) for param in stacks.values()}) != 1:
        return ()
    return tuple(stacks)


def stores_in_out(module: nn.Module) -> bool:
    """Whether the expert matrices of ``module`` are stored ``(in, out)``.

    transformers marks such layouts (GPT-OSS, Aria) with ``is_transposed = True``; without
    the attribute the layout is ``(out, in)``, as ``nn.Linear`` stores its weight.
    """
    return bool(getattr(module, "is_transposed", False))


def fused_gate_up_parts(fqn: str, module: nn.Module, attr: str) -> int:
    """How many contiguous parts the parameter ``fqn`` (``module.<attr>``) fuses by rows.

    2 for a fused gate and up projection whose halves are concatenated along the output
    dimension (``gate, up = out.chunk(2, dim=-1)``): a ``gate_up_proj`` expert stack (the
    transformers default; ``is_concatenated = False`` marks interleaved halves and
    ``has_gate = False`` a plain up projection, both 1) or the weight of an ``nn.Linear``
    named ``gate_up_proj`` (Phi-3). 1 for everything else.
    """
    if attr == "gate_up_proj" and attr in expert_stacks(module):
        concatenated = getattr(module, "is_concatenated", True)
        has_gate = getattr(module, "has_gate", True)
        return 2 if concatenated and has_gate else 1
    parts = fqn.split(".")
    linear = isinstance(module, nn.Linear) and attr == "weight"
    return 2 if linear and len(parts) >= 2 and parts[-2] == "gate_up_proj" else 1


def routing_gate_ids(model: nn.Module) -> set[int]:
    """``id`` of every 2-D parameter held by a sibling module of a fused experts module.

    In a mixture-of-experts block the experts module's siblings that hold a matrix directly
    are the router (``gate``: one logit per expert) and gates such as Qwen2-MoE's
    ``shared_expert_gate`` (``1 x hidden``). They stay with AdamW by default: a router row
    is an expert's routing direction, and the top-k choice depends on the rows' relative
    scale, which Muon's orthogonalized update (the same size for every row, whatever the
    gradient) would override. Deeper modules (a shared expert's own ``nn.Linear`` layers)
    are not gates.
    """
    gates: set[int] = set()
    for parent in model.modules():
        children = list(parent.children())
        if not any(expert_stacks(child) for child in children):
            continue
        for child in children:
            if expert_stacks(child):
                continue
            for param in child._parameters.values():
                if param is not None and param.ndim == 2:
                    gates.add(id(param))
    return gates
