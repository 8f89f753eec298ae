"""Checkpoints of dedicated models: DCP-ready state dicts and a consolidation command.

The six functions have the signatures of `torch.distributed.checkpoint.state_dict`;
``python -m dmuon.checkpoint export CKPT_DIR --output FILE`` writes one file of full
weights from a sharded checkpoint, and ``python -m dmuon.checkpoint export-hf CKPT_DIR DIR``
a Hugging Face model directory (`dmuon.checkpoint.hf_export`).
"""

from dmuon.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
