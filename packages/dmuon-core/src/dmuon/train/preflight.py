"""What a run checks before its model exists: every input a user can get wrong.

`preflight` checks the model directory, the tokenizer, the data and the export folder
before the process group exists and before any file is written, and returns them as
`Inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmuon.train.cli import TrainConfig
from dmuon.train.data import CorpusPlan, check_fits, load_tokenizer, plan_corpus
from dmuon.train.data.sources import list_source_files
from dmuon.train.data.tokenizer import TextTokenizer
from dmuon.train.models import ModelSource, resolve_model

__all__ = ["Inputs", "preflight"]


@dataclass
class Inputs:
    """The checked inputs of a run (see `preflight`)."""

    model: ModelSource
    tokenizer: TextTokenizer | None
    corpus: CorpusPlan


def preflight(config: TrainConfig) -> Inputs:
    """Check every input a user can get wrong, before any process group or file exists.

    The model (a preset, or a model directory transformers builds, with enough positions
    for ``--seq-len``), the tokenizer (loads, has an EOS token, fits the model's
    embedding), the data (exists, readable formats, links inside its folder, token files
    with their sidecars and a vocabulary that fits) and the export folder.

    Raises:
        FileNotFoundError, ValueError: with a message naming the flag, the file and what
            to do.
    """
    source = resolve_model(config.model, config.seq_len)
    if config.export_hf is not None:
        from dmuon.checkpoint._hf_export import check_export_target

        check_export_target(config.export_hf)
    model_dir = None if source.hf is None else source.hf.path
    # Token files need no tokenizer; a model directory without one still trains on them.
    listing = list_source_files(config.data)
    files = listing[1]
    needs_tokenizer = files[0].kind != "tokens"
    tokenizer: TextTokenizer | None
    try:
        tokenizer = load_tokenizer(config.tokenizer, model_dir)
    except ValueError:
        if needs_tokenizer or config.tokenizer is not None:
            raise
        if config.sample_every > 0:
            raise ValueError(
                "--sample-every writes text, and these token files come without a tokenizer: "
                "pass --tokenizer (the one the files were made with)"
            ) from None
        tokenizer = None
    plan = plan_corpus(
        config.data,
        val_fraction=config.val_fraction,
        cache_dir=config.cache_dir,
        tokenizer=tokenizer,
        text_field=config.text_field,
        listing=listing,
    )
    if plan.cache_bin is not None:
        if not plan.is_cached:
            plan.check_records()  # a missing text field, before any process group
        if tokenizer is None:
            tokenizer = load_tokenizer(config.tokenizer, model_dir)  # raises its error
        what = (
            f"--tokenizer {tokenizer.name}"
            if config.tokenizer
            else f"the tokenizer {tokenizer.name}"
        )
        check_fits(tokenizer.vocab_size, source.vocab_size, what, config.model)
    else:
        from dmuon.train.data.sources import read_sidecar

        for f in (*plan.train, *plan.val):
            info = read_sidecar(f.path, f.relative)
            check_fits(info.vocab_size, source.vocab_size, f"token file {f.relative}", config.model)
    return Inputs(source, tokenizer, plan)
