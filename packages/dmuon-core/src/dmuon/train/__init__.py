"""The reference training recipe: the canonical example of the public ``dmuon`` API.

Launch it as ``python -m dmuon.train`` (console script ``dmuon-train``) for one process, or
``torchrun --standalone --nproc_per_node N -m dmuon.train`` for N. It is laid out as
torchtitan lays out its trainer, and every piece is importable:

* `dmuon.train.models` - the model builders: byte-level presets (`build_model`,
  `PRESETS`, in `dmuon.train.models.preset`) and Hugging Face model directories
  (`dmuon.train.models.hf`).
* `dmuon.train.data` - sources (text, JSON lines, parquet, token files), tokenizers, the
  token cache (`load_corpus`) and `GlobalBatchSampler` (the equivalence rule).
* `dmuon.train.parallelize` - process group, mesh, dedication, ``fully_shard``, the
  optimizer.
* `dmuon.train.checkpoints` - the trainer's state as ``Stateful`` objects
  (`stateful`), the checkpoint folders (`folder`) and when to resume and save
  (`manager`).
* `dmuon.train.preflight` - every input checked before the process group exists.
* `run` / `Trainer` - the loop (`dmuon.train.loop`).
* `parse_args` / `TrainConfig` - flags (`dmuon.train.cli`), defined in the torch-free
  contract module `dmuon_recipe_contract`; the demo's settings are in `dmuon.train.demo`.
* `dmuon.train.reporting` - the metrics file (`MetricsWriter`, in `metrics_file`), the
  console, the experiment trackers, and `log_metrics`, which writes the metrics file from
  your own script run by the job service (`user_metrics`).
"""

from typing import TYPE_CHECKING

from dmuon._lazy import lazy_attributes

if TYPE_CHECKING:
    from dmuon.train.cli import TrainConfig, build_parser, parse_args
    from dmuon.train.data import Corpus, GlobalBatchSampler, load_corpus, validation_windows
    from dmuon.train.loop import Trainer, run
    from dmuon.train.models import PRESETS, ModelConfig, Transformer, build_model, lm_loss
    from dmuon.train.reporting.metrics_file import REQUIRED_KEYS, MetricsWriter
    from dmuon.train.reporting.user_metrics import log_metrics

#: Each exported name and the module that defines it, imported when first read.
_EXPORTS = {
    "TrainConfig": "dmuon.train.cli",
    "build_parser": "dmuon.train.cli",
    "parse_args": "dmuon.train.cli",
    "Corpus": "dmuon.train.data",
    "GlobalBatchSampler": "dmuon.train.data",
    "load_corpus": "dmuon.train.data",
    "validation_windows": "dmuon.train.data",
    "Trainer": "dmuon.train.loop",
    "run": "dmuon.train.loop",
    "REQUIRED_KEYS": "dmuon.train.reporting.metrics_file",
    "MetricsWriter": "dmuon.train.reporting.metrics_file",
    "PRESETS": "dmuon.train.models",
    "ModelConfig": "dmuon.train.models",
    "Transformer": "dmuon.train.models",
    "build_model": "dmuon.train.models",
    "lm_loss": "dmuon.train.models",
    "log_metrics": "dmuon.train.reporting.user_metrics",
}

__all__ = [
    "PRESETS",
    "REQUIRED_KEYS",
    "Corpus",
    "GlobalBatchSampler",
    "MetricsWriter",
    "ModelConfig",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "build_model",
    "build_parser",
    "lm_loss",
    "load_corpus",
    "log_metrics",
    "parse_args",
    "run",
    "validation_windows",
]

__getattr__, __dir__ = lazy_attributes("dmuon.train", _EXPORTS, globals())
