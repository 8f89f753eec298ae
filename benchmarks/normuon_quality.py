"""NorMuon against Muon: validation loss after the same steps, same learning rate, several seeds.

Each variant trains the recipe's model (``python -m dmuon.train --muon-variant ...``) on the
default corpus at the recipe's default learning rate, once per seed; a seed fixes the
initialization and the batch order, so the two variants of one seed see the same data and
are evaluated on the same validation windows. Muon is the baseline measured in the same run:
printed are each run's final validation loss, the per-seed difference NorMuon - Muon, and
the mean of each variant.

    python benchmarks/normuon_quality.py                      # tiny, 2 seeds x 240 steps
    python benchmarks/normuon_quality.py --model small --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from cli_types import positive_int
from quality import _curve

VARIANTS = ("muon", "normuon")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train every (variant, seed) pair; return the final losses, curves and differences."""
    from dmuon.train import run as train

    sys.path.insert(0, str(Path(__file__).parent))
    from machine import machine_info

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for variant in VARIANTS:
                metrics = Path(tmp) / f"{variant}-{seed}.jsonl"
                summary = train(
                    [
                        "--model", args.model, "--steps", str(args.steps),
                        "--muon-variant", variant, "--seed", str(seed),
                        "--eval-every", str(args.eval_every),
                        "--threads", str(args.threads), "--device", "cpu",
                        "--progress", "plain", "--log-every", "1000",
                        "--metrics-file", str(metrics),
                    ]
                )  # fmt: skip
                runs.append(
                    {
                        "variant": variant,
                        "seed": seed,
                        "final_val_loss": summary["end_val_loss"],
                        "curve": _curve(metrics),
                    }
                )
    final = {(r["variant"], r["seed"]): r["final_val_loss"] for r in runs}
    return {
        "model": args.model,
        "steps": args.steps,
        "seeds": list(args.seeds),
        "machine": machine_info(),
        "runs": runs,
        "mean_final_val_loss": {
            v: statistics.fmean(final[(v, s)] for s in args.seeds) for v in VARIANTS
        },
        "normuon_minus_muon": {
            str(s): final[("normuon", s)] - final[("muon", s)] for s in args.seeds
        },
    }


def main() -> None:
    """Parse the flags, run, print the table (and write ``--json`` when given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=positive_int, default=240)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-every", type=positive_int, default=60)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    record = run(args)
    print(f"\n{args.model}, {args.steps} steps: final validation loss")
    print(f"{'seed':>6} {'muon':>8} {'normuon':>8} {'diff':>8}")
    losses = {(r["variant"], r["seed"]): r["final_val_loss"] for r in record["runs"]}
    for seed in args.seeds:
        muon, nor = losses[("muon", seed)], losses[("normuon", seed)]
        print(f"{seed:>6} {muon:>8.4f} {nor:>8.4f} {nor - muon:>+8.4f}")
    means = record["mean_final_val_loss"]
    print(f"{'mean':>6} {means['muon']:>8.4f} {means['normuon']:>8.4f} "
          f"{means['normuon'] - means['muon']:>+8.4f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
