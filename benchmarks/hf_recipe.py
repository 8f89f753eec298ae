"""The recipe on Hugging Face inputs: tokenization throughput, and DMuon against FSDP2 + AdamW.

1. Tokenization: a JSON-lines corpus of at least ``--corpus-mb`` MB (generated documents
   of English words), tokenized once by the recipe's streamed tokenizer (`load_corpus`)
   with a byte-level BPE tokenizer trained here, and with raw bytes; MB/s of input text.
2. Training: an HF ``LlamaForCausalLM`` of about 100 M parameters built from a config
   (width 768, 12 layers, MLP 2048, 12 heads, vocabulary 8192), trained by
   ``torchrun --nproc_per_node N -m dmuon.train`` on that corpus with ``--optimizer dmuon``
   and with ``--optimizer adamw`` (FSDP2 + AdamW on everything), one after the other in
   this run, the same flags otherwise. Step time is the median over the steps after
   ``--warmup`` (each step's wall time is the global batch's tokens over its
   ``tokens_per_s``); the ratio DMuon / AdamW is printed.

``python benchmarks/hf_recipe.py`` writes ``benchmarks/results/hf_recipe.json``;
``--accum-steps 4 --json benchmarks/results/hf_recipe_accum4.json`` the same with four
times the tokens per optimizer step (Newton-Schulz then weighs less per token).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cli_types import non_negative_int, positive_int
from machine import machine_info

RESULTS = Path(__file__).resolve().parent / "results" / "hf_recipe.json"
WORDS = (  # noqa: SIM905 - a sentence reads better than a list of 70 strings
    "the of and to in is was for on that with as by at from his her an which this be are "
    "were had have not but they their one all been has more its who new would other time "
    "after first also two into over only may years such about most many some these then "
    "model train token layer matrix rank owner shard gradient update learning rate"
).split()


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A JSON-lines file of documents of random words, at least ``megabytes`` MB."""
    rng = random.Random(seed)
    target = megabytes * 1_000_000
    written = 0
    with path.open("w", encoding="utf-8") as out:
        while written < target:
            words = rng.choices(WORDS, k=rng.randint(150, 600))
            line = json.dumps({"text": " ".join(words) + "."}) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
    return written


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer trained on the first 20 MB of the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts() -> Any:
        seen = 0
        with corpus.open(encoding="utf-8") as f:
            for line in f:
                seen += len(line)
                if seen > 20_000_000:
                    return
                yield json.loads(line)["text"]

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        out
    )


def tokenization(corpus: Path, tokenizer_dir: Path, cache: Path) -> dict[str, Any]:
    """MB/s of the recipe's tokenization, with the BPE tokenizer and with raw bytes."""
    from dmuon.train.data import load_corpus, load_tokenizer

    size = corpus.stat().st_size
    out: dict[str, Any] = {"corpus_bytes": size}
    for name, tokenizer in (("bpe", load_tokenizer(tokenizer_dir, None)), ("bytes", None)):
        start = time.perf_counter()
        loaded = load_corpus(corpus, tokenizer=tokenizer, cache_dir=cache / name, progress=False)
        seconds = time.perf_counter() - start
        assert not loaded.from_cache
        out[name] = {
            "seconds": seconds,
            "mb_per_s": size / 1e6 / seconds,
            "tokens": loaded.train.numel() + loaded.val.numel(),
        }
    return out


def model_dir(path: Path, tokenizer_dir: Path, vocab: int) -> int:
    """The ~100 M parameter Llama config (no weights) with the tokenizer; its parameter count."""
    import shutil

    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config.save_pretrained(path)
    for item in tokenizer_dir.iterdir():
        shutil.copy2(item, path / item.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def train_run(
    args: argparse.Namespace, optimizer: str, root: Path, corpus: Path, round_: int
) -> dict[str, Any]:
    """One torchrun of the recipe; the step times after warm-up and the peak memory."""
    metrics = root / f"{optimizer}-{round_}.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(args.nproc), "-m", "dmuon.train",
        "--model", str(root / "model"), "--data", str(corpus), "--optimizer", optimizer,
        "--mode", args.mode, "--steps", str(args.steps + args.warmup),
        "--micro-batch-size", str(args.micro_batch_size), "--seq-len", str(args.seq_len),
        "--accum-steps", str(args.accum_steps),
        "--eval-every", "0", "--progress", "plain", "--cache-dir", str(root / "cache" / "bpe"),
        "--metrics-file", str(metrics), "--seed", "0",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{optimizer} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [x for x in lines if isinstance(x.get("step"), int) and x["step"] > args.warmup]
    tokens = args.nproc * args.accum_steps * args.micro_batch_size * args.seq_len
    seconds = [tokens / x["tokens_per_s"] for x in steps]
    return {
        "step_seconds": seconds,
        "median_step_s": statistics.median(seconds),
        "tokens_per_s": tokens / statistics.median(seconds),
        "peak_memory_bytes": steps[-1]["peak_memory_bytes"],
        "final_loss": steps[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    """Run both parts and print the figures and ratios."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-mb", type=positive_int, default=100)
    p.add_argument("--vocab", type=positive_int, default=8192)
    p.add_argument("--nproc", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=4, help="timed steps per optimizer")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed first steps")
    p.add_argument("--micro-batch-size", type=positive_int, default=2)
    p.add_argument("--accum-steps", type=positive_int, default=1)
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--mode", choices=("z2", "z3"), default="z2")
    p.add_argument("--rounds", type=positive_int, default=3, help="runs of each optimizer")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dmuon-hf-bench-") as scratch:
        root = Path(scratch)
        corpus = root / "corpus.jsonl"
        size = write_corpus(corpus, args.corpus_mb)
        print(f"corpus: {size / 1e6:.1f} MB of JSON lines", flush=True)
        train_tokenizer(corpus, root / "tokenizer", args.vocab)
        tok = tokenization(corpus, root / "tokenizer", root / "cache")
        for name in ("bpe", "bytes"):
            r = tok[name]
            print(f"tokenization ({name}): {r['mb_per_s']:.1f} MB/s "
                  f"({r['seconds']:.1f} s, {r['tokens']:,} tokens)", flush=True)  # fmt: skip
        params = model_dir(root / "model", root / "tokenizer", args.vocab)
        print(f"model: LlamaForCausalLM, {params / 1e6:.1f} M parameters", flush=True)
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = ("adamw", "dmuon") if r % 2 == 0 else ("dmuon", "adamw")
            rounds.append({opt: train_run(args, opt, root, corpus, r) for opt in order})
            ratio_r = rounds[-1]["dmuon"]["median_step_s"] / rounds[-1]["adamw"]["median_step_s"]
            print(f"round {r + 1}: DMuon / AdamW {ratio_r:.2f}x", flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for opt in ("adamw", "dmuon"):
        seconds = [s for one in rounds for s in one[opt]["step_seconds"]]
        tokens = args.nproc * args.accum_steps * args.micro_batch_size * args.seq_len
        runs[opt] = {
            "step_seconds": seconds,
            "median_step_s": statistics.median(seconds),
            "tokens_per_s": tokens / statistics.median(seconds),
            "peak_memory_bytes": [
                max(b) for b in zip(*(one[opt]["peak_memory_bytes"] for one in rounds), strict=True)
            ],
            "final_loss": [one[opt]["final_loss"] for one in rounds],
        }
    for opt, r in runs.items():
        print(f"{opt}: median step {r['median_step_s']:.2f} s, {r['tokens_per_s']:,.0f} tokens/s, "
              f"peak memory per rank {[round(b / 2**30, 2) for b in r['peak_memory_bytes']]} GiB",
              flush=True)  # fmt: skip
    ratio = runs["dmuon"]["median_step_s"] / runs["adamw"]["median_step_s"]
    print(f"step time DMuon / FSDP2 + AdamW: {ratio:.2f}x "
          f"(tokens/s {1 / ratio:.2f}x)")  # fmt: skip
    result = {
        "machine": machine_info(),
        "settings": vars(args) | {"json": str(args.json)},
        "tokenization": tok,
        "model_params": params,
        "runs": runs,
        "step_ratio_dmuon_over_adamw": ratio,
        "round_ratios": [
            one["dmuon"]["median_step_s"] / one["adamw"]["median_step_s"] for one in rounds
        ],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
