"""Muon on the expert stacks, or AdamW: validation loss of the recipe's ``moe`` preset.

The recipe's mixture-of-experts model (``python -m dmuon.train --model moe``: 2 layers,
width 64, 4 experts of width 128 as fused 3-D ``gate_up_proj`` / ``down_proj`` stacks,
top 2, a router) is trained three ways on the recipe's default corpus (the Python
standard library's source, as bytes):

``dmuon``
    ``dmuon.Muon`` with the default predicate: the expert stacks (each expert's matrix
    orthogonalized on its own) and the attention matrices on Muon; the router,
    embedding, norms and output head on AdamW. Swept: the Muon learning rate.
``dmuon-experts-adamw``
    ``dmuon.Muon`` with a user predicate that selects the attention matrices only, so
    the expert stacks go to AdamW with the router, embedding, norms and head. Swept: the
    AdamW learning rate (it now drives most of the parameters); Muon's stays at the
    recipe default.
``adamw``
    ``torch.optim.AdamW`` on every parameter, as the recipe's ``--optimizer adamw``.
    Swept: its learning rate.

Every run starts from the same initialization (seed 0) and sees the same batches in the
same order (the recipe's global-batch sampler), with the recipe's warm-up and cosine
schedule, gradient clipping at 1.0 and AdamW hyperparameters. Each contender is taken at
the best of its three learning rates by the final validation loss (fixed windows of the
held-out files).

One process is enough for quality: the recipe on several ranks computes the same losses
as one process on the same global batch (``tests/core/test_recipe_torchrun.py`` checks
it for this preset at 2 ranks, within 1e-4 per step), so the distribution does not change
the comparison.

Writes ``benchmarks/results/moe_quality.json`` (settings, the sweep, the best learning
rate of each contender, its training and validation curves, the machine) and
``benchmarks/results/moe_quality.png`` with its Chinese twin ``moe_quality.zh.png`` (the
curves, drawn by ``benchmarks/plots.py``; needs matplotlib, part of the ``bench`` extra).
About 10 minutes on 2 CPU cores with the defaults::

    python benchmarks/moe_quality.py
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dmuon
from dmuon.train.data import Corpus, GlobalBatchSampler, load_corpus, validation_windows
from dmuon.train.loop import lr_lambda
from dmuon.train.models.preset import PRESETS, build_model, lm_loss

sys.path.insert(0, str(Path(__file__).parent))
import plots  # the figures: benchmarks/plots.py
from cli_types import positive_int
from machine import machine_info

RESULTS = Path(__file__).parent / "results"

#: The recipe's defaults (``dmuon.train.TrainConfig``) for what is not swept.
MUON_LR, ADAMW_LR = 0.02, 3e-3
ADAMW_KW: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclass(frozen=True)
class Settings:
    """What every run shares."""

    steps: int = 150
    batch: int = 16
    seq_len: int = 128
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    eval_every: int = 25
    eval_sequences: int = 64
    seed: int = 0
    threads: int = 1


#: contender -> (what is swept, the three learning rates).
SWEEPS: dict[str, tuple[str, tuple[float, float, float]]] = {
    "dmuon": ("muon_lr", (0.01, 0.03, 0.1)),
    "dmuon-experts-adamw": ("adamw_lr", (3e-3, 1e-2, 3e-2)),
    "adamw": ("adamw_lr", (1e-3, 3e-3, 1e-2)),
}


def attention_only(name: str, param: nn.Parameter) -> bool:
    """The user predicate of ``dmuon-experts-adamw``: the attention matrices only."""
    return param.ndim == 2 and ".attn." in name


def make_optimizer(
    contender: str, model: nn.Module, muon_lr: float, adamw_lr: float
) -> torch.optim.Optimizer:
    """Dedicate (one process) and build the contender's optimizer."""
    if contender == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=adamw_lr, **ADAMW_KW)
    predicate = attention_only if contender == "dmuon-experts-adamw" else None
    dmuon.dedicate_params(model, None, predicate)
    return dmuon.Muon(
        model,
        lr=muon_lr,
        adamw_lr=adamw_lr,
        adamw_betas=ADAMW_KW["betas"],
        adamw_eps=ADAMW_KW["eps"],
        adamw_weight_decay=ADAMW_KW["weight_decay"],
    )


def muon_share(model: nn.Module) -> float:
    """Fraction of the model's parameters trained by Muon (0 without dedication)."""
    total = sum(p.numel() for p in model.parameters())
    dedicated = sum(dp.numel for dp in dmuon.dedicated_parameters(model))
    return dedicated / total


def train(
    contender: str,
    lr: float,
    settings: Settings,
    corpus: Corpus,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One run: the per-step training loss and the validation loss every ``eval_every``."""
    swept, _ = SWEEPS[contender]
    muon_lr = lr if swept == "muon_lr" else MUON_LR
    adamw_lr = lr if swept == "adamw_lr" else ADAMW_LR
    model = build_model("moe", seed=settings.seed, max_seq_len=settings.seq_len)
    optimizer = make_optimizer(contender, model, muon_lr, adamw_lr)
    share = muon_share(model) if contender != "adamw" else 0.0
    factor = lr_lambda(settings.warmup_steps, settings.steps, settings.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    sampler = GlobalBatchSampler(
        corpus.train,
        seq_len=settings.seq_len,
        micro_batch_size=settings.batch,
        accum_steps=1,
        seed=settings.seed,
    )
    windows = validation_windows(
        corpus.val, seq_len=settings.seq_len, num_sequences=settings.eval_sequences
    )

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total = sum(
            lm_loss(model(w[:, :-1]), w[:, 1:], reduction="sum").item()
            for w in windows.split(settings.batch)
        )
        model.train()
        return total / windows[:, 1:].numel()

    train_loss: list[float] = []
    val_loss: list[tuple[int, float]] = [(0, evaluate())]
    start = time.perf_counter()
    for step in range(1, settings.steps + 1):
        tokens = sampler.global_batch(step)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        dmuon.clip_grad_norm_(model, settings.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        train_loss.append(loss.item())
        if not math.isfinite(train_loss[-1]):
            break  # diverged: the final validation loss below is not finite either
        if step % settings.eval_every == 0 or step == settings.steps:
            val_loss.append((step, evaluate()))
    seconds = time.perf_counter() - start
    final = val_loss[-1][1] if val_loss[-1][0] == settings.steps else math.inf
    log(
        f"{contender:20s} {swept}={lr:<6g} val={final:.4f} "
        f"train(last 10)={statistics.fmean(train_loss[-10:]):.4f} ({seconds:.0f} s)"
    )
    return {
        "muon_lr": muon_lr if contender != "adamw" else None,
        "adamw_lr": adamw_lr,
        "muon_share": share,
        "final_val_loss": final,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=Settings.steps)
    parser.add_argument("--threads", type=positive_int, default=Settings.threads)
    parser.add_argument("--json", type=Path, default=RESULTS / "moe_quality.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "moe_quality.png")
    args = parser.parse_args()
    settings = Settings(steps=args.steps, threads=args.threads)
    torch.set_num_threads(settings.threads)
    corpus = load_corpus()
    config = PRESETS["moe"]
    start = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    best: dict[str, dict[str, Any]] = {}
    for contender, (swept, lrs) in SWEEPS.items():
        runs[contender] = {}
        for lr in lrs:
            run = train(contender, lr, settings, corpus, print)
            runs[contender][str(lr)] = run
            if contender not in best or run["final_val_loss"] < best[contender]["final_val_loss"]:
                best[contender] = {
                    "lr": lr,
                    "swept": swept,
                    "final_val_loss": run["final_val_loss"],
                    "train_loss_last10": statistics.fmean(run["train_loss"][-10:]),
                    "muon_share": run["muon_share"],
                }
    baseline = best["adamw"]["final_val_loss"]
    for entry in best.values():
        entry["val_minus_adamw"] = entry["final_val_loss"] - baseline
    result = {
        "benchmark": "moe_quality",
        "model": {"preset": "moe", **asdict(config), "params": config.num_params},
        "settings": asdict(settings),
        "corpus": corpus.source,
        "defaults": {"muon_lr": MUON_LR, "adamw_lr": ADAMW_LR, "adamw": ADAMW_KW},
        "sweeps": {c: {"swept": s, "lrs": list(lrs)} for c, (s, lrs) in SWEEPS.items()},
        "sweep": {c: {lr: r["final_val_loss"] for lr, r in rs.items()} for c, rs in runs.items()},
        "best": best,
        "runs": {
            c: {lr: r for lr, r in rs.items() if lr == str(best[c]["lr"])} for c, rs in runs.items()
        },
        "seconds": time.perf_counter() - start,
        "machine": machine_info(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for lang, path in plots.language_paths(args.png).items():
        plots.moe_quality(result, path, lang)  # one figure per language of the docs
    for contender, entry in best.items():
        print(
            f"best {contender:20s} {entry['swept']}={entry['lr']:g} "
            f"val={entry['final_val_loss']:.4f} ({entry['val_minus_adamw']:+.4f} vs adamw)"
        )
    print(f"wrote {args.json} and the figures {args.png} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
