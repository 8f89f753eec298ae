"""The reference training recipe: the canonical example of the public ``dmuon`` API.

Launch it as ``python -m dmuon.train`` (console script ``dmuon-train``) for one process, or
``torchrun --standalone --nproc_per_node N -m dmuon.train`` for N. The same pieces are
importable:

* :func:`build_model` / :data:`PRESETS` - a byte-level Llama-style transformer
  (:mod:`dmuon.train.model`).
* :func:`load_corpus` / :class:`GlobalBatchSampler` - offline text (the standard library
  source by default), split by file, cached; batches defined on the global batch
  (:mod:`dmuon.train.data`, which documents the equivalence rule).
* :func:`run` / :class:`Trainer` - the loop (:mod:`dmuon.train.loop`).
* :func:`parse_args` / :class:`TrainConfig` / :data:`DEMO_ARGS` (and the other ``DEMO_*``
  constants) - flags and the demo settings
  (:mod:`dmuon.train.cli`).
* :class:`MetricsWriter` - the metrics file format (:mod:`dmuon.train.metrics`).
"""

from .cli import (
    DEMO_ARGS,
    DEMO_MAX_SECONDS,
    DEMO_MEASURED,
    DEMO_MIN_VAL_DROP,
    DEMO_NPROC,
    TrainConfig,
    build_parser,
    parse_args,
)
from .data import Corpus, GlobalBatchSampler, load_corpus, validation_windows
from .loop import Trainer, run
from .metrics import REQUIRED_KEYS, MetricsWriter
from .model import PRESETS, ModelConfig, Transformer, build_model, lm_loss

__all__ = [
    "DEMO_ARGS",
    "DEMO_MAX_SECONDS",
    "DEMO_MEASURED",
    "DEMO_MIN_VAL_DROP",
    "DEMO_NPROC",
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
    "parse_args",
    "run",
    "validation_windows",
]
