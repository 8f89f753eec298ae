"""Data of the recipe: sources, tokenizers, the token cache and the global-batch sampler.

* `dmuon.train.data.sources`: what ``--data`` names (formats, links, split by file);
* `dmuon.train.data.tokenizer`: raw bytes or a Hugging Face tokenizer;
* `dmuon.train.data.corpus`: tokenizing once, streamed, into a private cache;
* `dmuon.train.data.sampler`: token streams, and batches defined on the global batch
  (the equivalence rule).
"""

from dmuon.train.data.corpus import (
    CACHE_FORMAT,
    Corpus,
    CorpusPlan,
    default_cache_dir,
    load_corpus,
    plan_corpus,
)
from dmuon.train.data.sampler import GlobalBatchSampler, TokenStream, validation_windows
from dmuon.train.data.sources import SourceFile, list_source_files, split_files, stdlib_root
from dmuon.train.data.tokenizer import ByteTokenizer, HFTokenizer, check_fits, load_tokenizer

__all__ = [
    "CACHE_FORMAT",
    "ByteTokenizer",
    "Corpus",
    "CorpusPlan",
    "GlobalBatchSampler",
    "HFTokenizer",
    "SourceFile",
    "TokenStream",
    "check_fits",
    "default_cache_dir",
    "list_source_files",
    "load_corpus",
    "load_tokenizer",
    "plan_corpus",
    "split_files",
    "stdlib_root",
    "validation_windows",
]
