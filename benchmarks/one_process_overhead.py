"""What dedication costs forward+backward in one process: a dedicated model against the
same model plain.

In one process there is no one to gather from or reduce with, so a dedicated model's
forward+backward should cost what the plain model's does (the hook boundaries' masters
are views of their buffers; each gradient is its own average). Both models start from the
same weights and see the same micro-batches; each round times the plain model's
forward+backward of ``--accum`` micro-batches and then the dedicated model's (every
micro-batch but the last under ``dmuon.no_sync``), gradients cleared between rounds,
outside the timers. The ratio dedicated / plain is taken per round, and its median over
the rounds is the result (a median of ratios measured side by side: other processes on a
shared machine stretch both alike).

    python benchmarks/one_process_overhead.py --model base --rounds 15
    python benchmarks/one_process_overhead.py --model base --accum 4 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

import dmuon
from dmuon.train import build_model, lm_loss

sys.path.insert(0, str(Path(__file__).parent))
from cli_types import positive_int
from machine import machine_info


def _forward_backward(
    model: nn.Module, batches: list[torch.Tensor], dedicated: bool, device: torch.device
) -> float:
    """Seconds of forward+backward over ``batches`` (one micro-batch each)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for index, tokens in enumerate(batches):
        quiet = dedicated and index < len(batches) - 1
        with dmuon.no_sync(model) if quiet else nullcontext():
            logits = model(tokens[:, :-1])
            (lm_loss(logits, tokens[:, 1:]) / len(batches)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Time both models, interleaved, and return the per-round figures and the median."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    plain = build_model(args.model, max_seq_len=args.seq_len).to(device)
    dedicated = build_model(args.model, max_seq_len=args.seq_len).to(device)
    dedicated.load_state_dict(plain.state_dict())
    dmuon.dedicate_params(dedicated)
    vocab = plain.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator).to(device)
        for _ in range(args.accum)
    ]
    rounds = []
    for round_index in range(args.warmup + args.rounds):
        seconds = {}
        for name, model in (("plain", plain), ("dedicated", dedicated)):
            model.zero_grad(set_to_none=True)
            seconds[name] = _forward_backward(model, batches, name == "dedicated", device)
        if round_index >= args.warmup:
            rounds.append(seconds)
    ratios = [r["dedicated"] / r["plain"] for r in rounds]
    return {
        "benchmark": "one_process_overhead",
        "machine": machine_info(),
        "model": args.model,
        "device": str(device),
        "tokens_per_micro_batch": args.batch * args.seq_len,
        "accum": args.accum,
        "rounds": rounds,
        "median_plain_s": statistics.median(r["plain"] for r in rounds),
        "median_dedicated_s": statistics.median(r["dedicated"] for r in rounds),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the ratio and write ``--out`` if given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base", help="a preset of the recipe")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--accum", type=positive_int, default=1, help="micro-batches per round")
    parser.add_argument("--rounds", type=positive_int, default=15)
    parser.add_argument("--warmup", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = measure(args)
    print(
        f"{args.model} on {result['device']}, {result['tokens_per_micro_batch']} tokens x "
        f"{args.accum} micro-batch(es), {args.rounds} rounds: forward+backward plain "
        f"{result['median_plain_s'] * 1e3:.1f} ms, dedicated "
        f"{result['median_dedicated_s'] * 1e3:.1f} ms; dedicated / plain median "
        f"{result['median_ratio']:.3f} (min {result['min_ratio']:.3f}, "
        f"max {result['max_ratio']:.3f})"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
