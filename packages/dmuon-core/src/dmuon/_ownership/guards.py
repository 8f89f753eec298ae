"""What the runtime's hooks refuse at once, on every rank alike: torch's DCP state-dict
functions on a dedicated model, pipeline schedules that split backward, and a step whose
dedicated gradients never reached DMuon's reduction."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from dmuon._ownership import gradients
from dmuon._ownership.param import DedicatedParam

#: The module of torch's DCP state-dict functions, which see dedicated matrices as the 0-element
#: placeholders non-owners hold.
_TORCH_STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"


def torch_state_dict_function() -> str | None:
    """The public function of torch's DCP state-dict module that the current
    ``state_dict()`` runs under, unless DMuon's own functions called it; else None."""
    frame = sys._getframe(2)
    found = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "dmuon" or module.startswith("dmuon."):
            return None
        if module == _TORCH_STATE_DICT_MODULE and not frame.f_code.co_name.startswith("_"):
            found = frame.f_code.co_name
        frame = frame.f_back
    return found


def refuse_torchs_state_dict_functions(
    _module: nn.Module, _state_dict: dict[str, Any], _prefix: str, _metadata: Any
) -> None:
    """A model's ``state_dict()`` raises under torch's DCP state-dict functions: they
    would return the placeholders of the matrices other ranks own (empty tensors), or
    fail inside ``dcp.save``. Every rank raises alike, before any collective."""
    function = torch_state_dict_function()
    if function is not None:
        raise RuntimeError(
            f"torch.distributed.checkpoint.state_dict.{function} cannot read a model prepared "
            "by dmuon.dedicate_params: each dedicated matrix lives on its owner rank alone, so "
            "torch would return empty tensors for those owned by other ranks. Call "
            f"dmuon.{function} instead (the same arguments and StateDictOptions; its state "
            "dicts go to dcp.save and torch.save as torch's do)."
        )


#: The pipeline schedules' steps that split backward into inputs, then weights.
_SPLIT_BACKWARD = {"BACKWARD_INPUT", "BACKWARD_WEIGHT"}


_SCHEDULES = "torch.distributed.pipelining.schedules"


def refuse_split_backward_schedule() -> None:
    """Raise when this forward runs under a `torch.distributed.pipelining` schedule that
    splits backward into inputs, then weights (the zero-bubble schedules): their weight
    pass computes gradients with ``torch.autograd.grad`` and writes ``.grad`` itself, so
    the dedicated gradients would never reach their owners."""
    if _SCHEDULES not in sys.modules:  # no schedule can be running
        return
    frame = sys._getframe(2)
    while frame is not None:
        schedule = frame.f_locals.get("self")
        if type(schedule).__module__ == _SCHEDULES:
            order = getattr(schedule, "pipeline_order", None) or {}
            kinds = {
                str(getattr(getattr(action, "computation_type", None), "name", ""))
                for actions in order.values()
                for action in actions
                if action is not None
            }
            if kinds & _SPLIT_BACKWARD:
                raise RuntimeError(
                    f"{type(schedule).__name__} splits backward into inputs, then weights, and "
                    "computes the weights' gradients with torch.autograd.grad, so DMuon could "
                    "not reduce the dedicated ones to their owners. Use a schedule whose "
                    "backward is whole: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B "
                    "or ScheduleLoopedBFS."
                )
            return
        frame = frame.f_back


def refuse_unsynchronised_step(unsynced_backwards: int, params: list[DedicatedParam]) -> None:
    """Raise before a step whose dedicated gradients never reached their owners: every
    backward since the last step ran under ``no_sync`` (the same on every rank), or a
    matrix got its gradient from a forward that bypassed its hook boundary."""
    if unsynced_backwards:
        raise RuntimeError(
            f"optimizer.step() after {unsynced_backwards} backward(s) that all ran "
            "under dmuon.no_sync: their dedicated gradients were only accumulated on "
            "the ranks that computed them and never reduced to their owners, so this "
            "step would change no dedicated weight and the next zero_grad() would discard "
            "them. Run the last micro-batch's backward outside no_sync (wrap only the "
            "others: `with dmuon.no_sync(model) if i < accum - 1 else nullcontext():`). "
            "No weight was changed."
        )
    stray = next((dp for dp in params if gradients.is_plain_grad(dp.module_param)), None)
    if stray is not None:
        where = stray.boundary or "<root>"
        raise RuntimeError(
            f"{stray.fqn!r} has a gradient that did not come through its hook boundary "
            f"{where!r}: a module inside that boundary was called directly (for example "
            f"model.{where}.mlp(x) instead of model.{where}(x)), so DMuon neither gathered "
            "its weights for that forward nor reduced its gradient to its owner, and this "
            "step would not change it. Run the loss through the boundary module itself, or "
            "make the module you call a boundary: dedicate_params(..., "
            "hook_boundary_predicate=lambda name, module: ...). No weight was changed."
        )
