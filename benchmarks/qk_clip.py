"""QK-clip (``--qk-clip``): a run made to blow up, with and without the clip, and its cost.

Two measurements, one process each:

* **Blow-up.** The recipe's ``tiny`` preset at a Muon rate high enough (``--lr 0.1``,
  constant after no warm-up) that the largest attention logit passes 100 within a few dozen
  steps. The same run (same seed, batches and validation windows) goes once without the clip
  (``--qk-clip`` set far above any logit, so the maxima are logged and nothing is scaled:
  the arithmetic is that of no clip at all) and once with ``--qk-clip 100``. Reported: each
  step's training loss, largest logit and clipped heads; the step the unclipped logit
  passes tau; the first clipped step; the largest logit recorded after it, over tau; the
  final validation losses.
* **Cost.** The ``small`` preset at the recipe's defaults, ``--steps`` steps, alternately
  without and with ``--qk-clip 100`` for ``--rounds`` rounds: the median step time of each
  (steps after the first three), and their ratio per round and overall. The clip's work is
  the second computation of every logit (float32, no gradient) in forward, one small MAX
  all-reduce per step (none in one process) and the scaling of the clipped rows.

    python benchmarks/qk_clip.py

Writes ``results/qk_clip.json`` and the figure ``results/qk_clip.png`` (and its Chinese
twin ``qk_clip.zh.png``; drawn by ``benchmarks/plots.py``, which needs matplotlib, part of
the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from cli_types import positive_int

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results"
#: A threshold no logit of these runs reaches: the maxima are logged, nothing is scaled.
NEVER = 1e30


def _run(config: Any, folder: Path, name: str) -> list[dict[str, Any]]:
    from dmuon.train import run

    path = folder / f"{name}.jsonl"
    run(replace(config, metrics_file=str(path)))
    return [json.loads(line) for line in path.read_text().splitlines()]


def blow_up(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The same high-rate run without and with the clip."""
    from dmuon.train import TrainConfig

    config = TrainConfig(
        model="tiny", steps=args.blow_up_steps, seq_len=64, micro_batch_size=8,
        lr=args.lr, adamw_lr=0.01, warmup_steps=0, lr_schedule="constant",
        eval_every=args.blow_up_steps, eval_sequences=32, progress="plain",
        log_every=100_000, threads=args.threads, cache_dir=str(folder / "cache"),
    )  # fmt: skip
    runs: dict[str, Any] = {}
    for name, tau in (("no clip", NEVER), (f"qk-clip {args.tau:g}", args.tau)):
        records = _run(replace(config, qk_clip=tau), folder, name.replace(" ", "_"))
        steps = [r for r in records if r["step"] >= 1]
        runs[name] = {
            "tau": None if tau == NEVER else tau,
            "loss": [r["loss"] for r in steps],
            "max_logit": [r["max_logit"] for r in steps],
            "clipped_heads": [r["qk_clipped_heads"] for r in steps],
            "final_val_loss": records[-1]["val_loss"],
        }
    plain, clipped = runs.values()
    first_past = next((i + 1 for i, v in enumerate(plain["max_logit"]) if v > args.tau), None)
    first_clip = next((i + 1 for i, c in enumerate(clipped["clipped_heads"]) if c), None)
    after = clipped["max_logit"][first_clip:] if first_clip is not None else []
    return {
        "settings": {"model": "tiny", "lr": args.lr, "steps": args.blow_up_steps, "tau": args.tau},
        "runs": runs,
        "summary": {
            "unclipped_passes_tau_at_step": first_past,
            "unclipped_largest_logit": max(plain["max_logit"]),
            "first_clipped_step": first_clip,
            "largest_logit_after_first_clip": max(after) if after else None,
            "largest_after_over_tau": max(after) / args.tau if after else None,
            "mean_after_over_tau": statistics.fmean(after) / args.tau if after else None,
        },
    }


def cost(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Median step time without and with the clip, alternating runs."""
    from dmuon.train import TrainConfig

    config = TrainConfig(
        model=args.cost_model, steps=args.cost_steps, eval_every=0, progress="plain",
        log_every=100_000, threads=args.threads, cache_dir=str(folder / "cache"),
    )  # fmt: skip
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    for round_ in range(args.rounds):
        medians = {}
        for arm, tau in (("off", None), ("on", args.tau)):
            records = _run(replace(config, qk_clip=tau), folder, f"cost_{arm}_{round_}")
            per_step = [
                config.micro_batch_size * config.accum_steps * config.seq_len / r["tokens_per_s"]
                for r in records[3:]
            ]
            medians[arm] = statistics.median(per_step)
            seconds[arm].append(medians[arm])
        ratios.append(medians["on"] / medians["off"])
    return {
        "settings": {
            "model": args.cost_model,
            "steps": args.cost_steps,
            "rounds": args.rounds,
            "seq_len": config.seq_len,
            "micro_batch_size": config.micro_batch_size,
            "threads": args.threads,
            "tau": args.tau,
        },
        "median_step_seconds": seconds,
        "ratio_per_round": ratios,
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau", type=float, default=100.0)
    parser.add_argument("--lr", type=float, default=0.1, help="Muon rate of the blow-up runs")
    parser.add_argument("--blow-up-steps", type=positive_int, default=80)
    parser.add_argument("--cost-model", default="small")
    parser.add_argument("--cost-steps", type=positive_int, default=15)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "qk_clip.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "qk_clip.png")
    args = parser.parse_args()
    from machine import machine_info

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result = {
            "machine": machine_info(),
            "blow_up": blow_up(args, folder),
            "cost": cost(args, folder),
        }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = result["blow_up"]["summary"]
    print(json.dumps(summary, indent=1))
    print(f"step time with / without the clip: {result['cost']['ratio']:.3f} "
          f"(rounds {[round(r, 3) for r in result['cost']['ratio_per_round']]})")  # fmt: skip
    import plots

    for lang, path in plots.language_paths(args.png).items():
        plots.qk_clip(result, path, lang)


if __name__ == "__main__":
    main()
