"""Checkpoints of dedicated models: DCP-ready state dicts, export and verification.

The six state-dict functions have the signatures of `torch.distributed.checkpoint.state_dict`;
``python -m dmuon.checkpoint export CKPT_DIR --output FILE`` writes one file of full
weights from a sharded checkpoint (`export_weights`, `load_full_weights`),
``python -m dmuon.checkpoint export-hf CKPT_DIR DIR`` a Hugging Face model directory
(`export_hf`), and ``python -m dmuon.checkpoint verify DIR`` checks a folder against its
manifest (`write_manifest`, `verify_checkpoint`). The modules inside are private, and each
is imported when one of its names is first read: a training run that never writes a
checkpoint does not load DCP.
"""

from typing import TYPE_CHECKING

from dmuon._lazy import lazy_attributes

if TYPE_CHECKING:
    from dmuon.checkpoint._export import export_weights, load_full_weights
    from dmuon.checkpoint._hf_export import export_hf
    from dmuon.checkpoint._manifest import (
        CheckpointDamagedError,
        verify_checkpoint,
        write_manifest,
    )
    from dmuon.checkpoint._state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

#: Each exported name and the module that defines it, imported when first read.
_EXPORTS = {
    "export_weights": "dmuon.checkpoint._export",
    "load_full_weights": "dmuon.checkpoint._export",
    "export_hf": "dmuon.checkpoint._hf_export",
    "CheckpointDamagedError": "dmuon.checkpoint._manifest",
    "verify_checkpoint": "dmuon.checkpoint._manifest",
    "write_manifest": "dmuon.checkpoint._manifest",
    "get_model_state_dict": "dmuon.checkpoint._state_dict",
    "get_optimizer_state_dict": "dmuon.checkpoint._state_dict",
    "get_state_dict": "dmuon.checkpoint._state_dict",
    "set_model_state_dict": "dmuon.checkpoint._state_dict",
    "set_optimizer_state_dict": "dmuon.checkpoint._state_dict",
    "set_state_dict": "dmuon.checkpoint._state_dict",
}

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

__getattr__, __dir__ = lazy_attributes("dmuon.checkpoint", _EXPORTS, globals())
