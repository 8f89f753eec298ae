"""Checkpoints of dedicated models: DCP-ready state dicts, export and verification.

The six state-dict functions have the signatures of `torch.distributed.checkpoint.state_dict`;
``python -m dmuon.checkpoint export CKPT_DIR --output FILE`` writes one file of full
weights from a sharded checkpoint (`export_weights`, `load_full_weights`),
``python -m dmuon.checkpoint export-hf CKPT_DIR DIR`` a Hugging Face model directory
(`export_hf`), and ``python -m dmuon.checkpoint verify DIR`` checks a folder against its
manifest (`write_manifest`, `verify_checkpoint`). The modules inside are private.
"""

from dmuon.checkpoint._export import export_weights, load_full_weights
from dmuon.checkpoint._hf_export import export_hf
from dmuon.checkpoint._manifest import (
    CheckpointDamagedError,
    write_manifest,
)
from dmuon.checkpoint._manifest import verify as verify_checkpoint
from dmuon.checkpoint._state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "CheckpointDamagedError",
    "export_hf",
    "export_weights",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load_full_weights",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "verify_checkpoint",
    "write_manifest",
]
