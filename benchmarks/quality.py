"""Quality: validation loss of DMuon and AdamW after the same tokens, from learning-rate sweeps.

Each optimizer trains the recipe's model (``python -m dmuon.train``) on the default corpus
at three learning rates, with the same seed, so every run sees the same batches in the same
order and is evaluated on the same validation windows. One process: the distributed runs
compute the same global-batch mean gradients, so they follow the same curve (the recipe's
tests check that N ranks match one process). Reported:

* the final validation loss per learning rate, and each optimizer's best;
* the validation-loss curves (``--plot``);
* the steps DMuon's best run needs to reach AdamW's best final validation loss, over the
  steps of the run (linear interpolation between evaluations).

    python benchmarks/quality.py             # tiny, 3 + 3 runs of 240 steps, about a minute
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from cli_types import non_negative_int, positive_int

RESULTS = Path(__file__).parent / "results"


TINY_SWEEPS: dict[str, tuple[str, list[float]]] = {
    "dmuon": ("--lr", [0.01, 0.02, 0.04]),
    "adamw": ("--adamw-lr", [0.00075, 0.0015, 0.003]),
}
"""optimizer -> (flag of its rate, the rates): centred on 0.02 and 0.0015, the rates that
suit ``tiny``'s 240 steps (the recipe's defaults when this sweep was measured; they now come
from the ``small`` sweep of ``quality_scale.py``). Under DMuon the AdamW group (embedding,
norms, head) runs at the swept rate too (``--adamw-lr`` equal to ``--lr``), so the sweep
moves both groups together."""


def sweeps() -> dict[str, tuple[str, list[float]]]:
    """optimizer -> (flag of its rate, the rates swept): `TINY_SWEEPS`."""
    return TINY_SWEEPS


def _curve(metrics_file: Path) -> list[tuple[int, float]]:
    points = []
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            points.append((int(record["step"]), float(record["val_loss"])))
    return points


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which ``curve`` reaches ``target``, interpolated between points."""
    for (s0, v0), (s1, v1) in itertools.pairwise(curve):
        if v1 <= target:
            if v0 <= target:
                return float(s0)
            return s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train every (optimizer, rate) pair; return the record with curves and the ratio."""
    from dmuon.train import run as train

    sys.path.insert(0, str(Path(__file__).parent))
    from machine import machine_info

    plan = sweeps()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, (_, rates) in plan.items():
            for rate in rates:
                metrics = Path(tmp) / f"{optimizer}-{rate}.jsonl"
                summary = train(
                    [
                        "--model", args.model, "--steps", str(args.steps),
                        "--optimizer", optimizer, "--adamw-lr", str(rate),
                        *(["--lr", str(rate)] if optimizer == "dmuon" else []),
                        "--seq-len", str(args.seq_len), "--micro-batch-size", "4",
                        "--eval-every", str(args.eval_every),
                        "--eval-sequences", str(args.eval_sequences),
                        "--warmup-steps", str(args.warmup_steps),
                        "--threads", str(args.threads), "--device", "cpu",
                        "--progress", "plain", "--log-every", "1000", "--seed", "0",
                        "--metrics-file", str(metrics),
                    ]
                )  # fmt: skip
                runs.append(
                    {
                        "optimizer": optimizer,
                        "lr": rate,
                        "final_val_loss": summary["end_val_loss"],
                        "tokens": summary["tokens"],
                        "train_time_s": summary["train_time_s"],
                        "stopped_by": summary["stopped_by"],
                        "curve": _curve(metrics),
                    }
                )
    best = {
        o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["final_val_loss"])
        for o in ("dmuon", "adamw")
    }
    target = best["adamw"]["final_val_loss"]
    reached = steps_to_reach(best["dmuon"]["curve"], target)
    return {
        "model": args.model,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "eval_every": args.eval_every,
        "eval_sequences": args.eval_sequences,
        "threads": args.threads,
        "defaults": {optimizer: rates[1] for optimizer, (_, rates) in plan.items()},
        "machine": machine_info(),
        "runs": runs,
        "best_lr": {o: best[o]["lr"] for o in best},
        "best_final_val_loss": {o: best[o]["final_val_loss"] for o in best},
        "dmuon_steps_to_adamw_best": reached,
        "dmuon_steps_ratio": None if reached is None else reached / args.steps,
    }


def main() -> None:
    """Parse flags, run the sweeps, print a summary, write ``results/quality.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=positive_int, default=240)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--eval-every", type=positive_int, default=10)
    parser.add_argument("--eval-sequences", type=positive_int, default=32)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS / "quality.json")
    args = parser.parse_args()
    result = run(args)
    for r in result["runs"]:
        print(f"{r['optimizer']:>6} lr {r['lr']:<8g} final val loss {r['final_val_loss']:.4f}")
    print(
        f"best: {result['best_lr']}; DMuon reaches AdamW's best final val loss at step "
        f"{result['dmuon_steps_to_adamw_best']} of {args.steps} "
        f"(ratio {result['dmuon_steps_ratio']})"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
