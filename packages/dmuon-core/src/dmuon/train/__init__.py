"""The reference training recipe: the canonical example of the public ``dmuon`` API.

Launch it as ``python -m dmuon.train`` (console script ``dmuon-train``) for one process, or
``torchrun --standalone --nproc_per_node N -m dmuon.train`` for N. The same pieces are
importable:

* `build_model` / `PRESETS` - a byte-level Llama-style transformer
  (`dmuon.train.model`).
* `load_corpus` / `GlobalBatchSampler` - offline text (the standard library
  source by default), split by file, cached; batches defined on the global batch
  (`dmuon.train.data`, which documents the equivalence rule).
* `run` / `Trainer` - the loop (`dmuon.train.loop`).
* `parse_args` / `TrainConfig` - flags (`dmuon.train.cli`); the demo's settings are in
  `dmuon.train.demo`.
* `MetricsWriter` - the metrics file format (`dmuon.train.metrics`); `log_metrics` writes
  it from your own script run by the job service (`dmuon.train.user_metrics`).
"""

from dmuon.train.cli import TrainConfig, build_parser, parse_args
from dmuon.train.data import Corpus, GlobalBatchSampler, load_corpus, validation_windows
from dmuon.train.loop import Trainer, run
from dmuon.train.metrics import REQUIRED_KEYS, MetricsWriter
from dmuon.train.model import PRESETS, ModelConfig, Transformer, build_model, lm_loss
from dmuon.train.user_metrics import log_metrics

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
