"""`dmuon.plan`: a model on a cluster before renting it.

``python -m dmuon.plan --model DIR --world 1024 --shard-size 8`` builds a Hugging Face
model on the meta device from its config (no weights, no process group; a Llama, Mistral,
Qwen2 or Qwen3 decoder without importing transformers, `planning_model`), makes the owner
plan `dmuon.dedicate_params` would make on that mesh (the same code), and prints per rank
what DMuon adds: owned bytes, Newton-Schulz FLOPs and workspace, buffers, collectives and
bytes per step on each mesh dimension, and the optimizer step's overhead against
forward+backward under a stated time model. `plan_cluster` is the function behind it.
"""

from typing import TYPE_CHECKING

from dmuon._lazy import lazy_attributes

if TYPE_CHECKING:
    from dmuon.plan._collectives import Tally
    from dmuon.plan._estimate import ClusterPlan, RankPlan, plan_cluster
    from dmuon.plan._hardware import HARDWARE, Hardware, parse_hardware, parse_tokens
    from dmuon.plan._model import active_parameters, load_config, meta_model, planning_model

#: Each exported name and the module that defines it, imported when first read.
_EXPORTS = {
    "Tally": "dmuon.plan._collectives",
    "ClusterPlan": "dmuon.plan._estimate",
    "RankPlan": "dmuon.plan._estimate",
    "plan_cluster": "dmuon.plan._estimate",
    "HARDWARE": "dmuon.plan._hardware",
    "Hardware": "dmuon.plan._hardware",
    "parse_hardware": "dmuon.plan._hardware",
    "parse_tokens": "dmuon.plan._hardware",
    "active_parameters": "dmuon.plan._model",
    "load_config": "dmuon.plan._model",
    "meta_model": "dmuon.plan._model",
    "planning_model": "dmuon.plan._model",
}

__all__ = [
    "HARDWARE",
    "ClusterPlan",
    "Hardware",
    "RankPlan",
    "Tally",
    "active_parameters",
    "load_config",
    "meta_model",
    "parse_hardware",
    "parse_tokens",
    "plan_cluster",
    "planning_model",
]

__getattr__, __dir__ = lazy_attributes("dmuon.plan", _EXPORTS, globals())
