"""Whole or split ``gate_up_proj``: what orthogonalizing the fused experts together does.

A tiny transformers Mixtral (fused 3-D expert stacks) is trained in one process on the
byte-level standard-library corpus of the training recipe, with ``dmuon.Muon`` twice per
learning rate: ``split=None`` (each expert's ``gate_up_proj`` orthogonalized as one
``2I x H`` matrix) and ``split="auto"`` (gate and up halves on their own, as a model with
separate ``gate_proj`` / ``up_proj`` matrices gets them). Same initialization, same
batches. Printed:

* for the whole run, the update RMS of the gate half over the up half of every expert's
  orthogonalized ``gate_up_proj`` update (1.0 when the halves move alike; split makes
  every half's RMS that of an orthogonalized ``I x H`` matrix, so its ratio is 1 up to
  the iteration's accuracy);
* for both, the mean training loss of the last 10 steps and the validation loss after
  training, at the best of three Muon learning rates, and their difference.

Writes ``benchmarks/results/moe_split.json`` (settings, every run, the best learning rate
of each, the machine), which the compatibility page renders::

    python benchmarks/moe_split.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch import nn

import dmuon
from dmuon.train.data import GlobalBatchSampler, load_corpus, validation_windows

sys.path.insert(0, str(Path(__file__).parent))
from cli_types import positive_int
from machine import machine_info

RESULTS = Path(__file__).parent / "results"
SEQ, BATCH, MOMENTUM = 64, 8, 0.95
MIXTRAL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def half_ratios(model: nn.Module, optimizer: dmuon.Muon) -> list[float]:
    """RMS(gate half) / RMS(up half) of each expert's fused orthogonalized update."""
    ratios = []
    for dp in dmuon.dedicated_parameters(model):
        if not dp.fqn.endswith("gate_up_proj"):
            continue
        grad = dp.param._reduced_grad
        buf = optimizer.state[dp.param].get("momentum_buffer", torch.zeros_like(grad))
        update = grad.lerp(buf.lerp(grad, 1 - MOMENTUM), MOMENTUM)
        ortho = dmuon.newton_schulz(update, dtype=torch.float32)
        half = ortho.shape[1] // 2
        gate, up = ortho[:, :half], ortho[:, half:]
        rms = (gate.square().mean(dim=(1, 2)) / up.square().mean(dim=(1, 2))).sqrt()
        ratios.extend(rms.tolist())
    return ratios


def train(split: str | None, lr: float, steps: int, corpus, measure: bool) -> dict[str, float]:
    model = make_model()
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=lr, ns_dtype=torch.float32, adamw_lr=3e-3, split=split)
    sampler = GlobalBatchSampler(corpus.train, seq_len=SEQ, micro_batch_size=BATCH, accum_steps=1)
    losses, ratios = [], []
    for step in range(1, steps + 1):
        loss = loss_of(model, sampler.global_batch(step))
        loss.backward()
        if measure:
            ratios.extend(half_ratios(model, optimizer))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    val = validation_windows(corpus.val, seq_len=SEQ, num_sequences=64)
    with torch.no_grad():
        val_loss = loss_of(model, val).item()
    result = {"train": statistics.fmean(losses[-10:]), "val": val_loss}
    if ratios:
        ratios.sort()
        result["ratio_median"] = statistics.median(ratios)
        result["ratio_p5"] = ratios[len(ratios) // 20]
        result["ratio_p95"] = ratios[len(ratios) * 19 // 20]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=100)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS / "moe_split.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_corpus()
    start = time.perf_counter()
    best: dict[str, tuple[float, float, dict[str, float]]] = {}
    runs: list[dict[str, object]] = []
    for lr in args.lrs:
        for split in (None, "auto"):
            label = "split" if split else "whole"
            result = train(split, lr, args.steps, corpus, measure=split is None)
            print(f"{label:5s} lr={lr:<5g} " + " ".join(f"{k}={v:.4f}" for k, v in result.items()))
            runs.append({"split": label, "lr": lr, **result})
            if label not in best or result["val"] < best[label][1]:
                best[label] = (lr, result["val"], result)
    print(f"best of {len(args.lrs)} learning rates, {args.steps} steps:")
    for label, (lr, val, result) in best.items():
        print(f"  {label}: lr={lr:g} train={result['train']:.4f} val={val:.4f}")
    print(f"  val(split) - val(whole) = {best['split'][1] - best['whole'][1]:+.4f}")
    seconds = time.perf_counter() - start
    print(f"({seconds:.0f} s)")
    record = {
        "benchmark": "moe_split",
        "model": {"transformers": transformers.__version__, "mixtral": MIXTRAL},
        "settings": {
            "steps": args.steps,
            "lrs": args.lrs,
            "seq_len": SEQ,
            "batch": BATCH,
            "momentum": MOMENTUM,
            "adamw_lr": 3e-3,
            "seed": 0,
            "threads": args.threads,
        },
        "runs": runs,
        "best": {label: {"lr": lr, "val": val} for label, (lr, val, _) in best.items()},
        "seconds": seconds,
        "machine": machine_info(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
