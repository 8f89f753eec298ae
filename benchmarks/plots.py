"""Plots of the committed results, drawn from their JSON (matplotlib, the ``bench`` extra).

* ``step-ratios.png``: step time over FSDP2 + AdamW at the same FSDP2 mode, per contender
  and accumulation (``results/<name>.json``, default ``small-n2``);
* ``loss-curves.png``: validation loss over steps of every run of the learning-rate sweeps
  (``results/quality.json``);
* ``scaling.png``: step time and counted traffic per rank as the model and the ranks grow
  (``results/scaling.json``).

Written to ``docs/assets/benchmarks/`` for the results page, with a copy in
``docs/zh/assets/benchmarks/`` for its Chinese mirror. A missing result is skipped.

    python benchmarks/plots.py
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
OUT = Path(__file__).resolve().parents[1] / "docs" / "assets" / "benchmarks"
OUT_ZH = Path(__file__).resolve().parents[1] / "docs" / "zh" / "assets" / "benchmarks"
"""The Chinese pages resolve images under their own folder, so they get a copy."""


def _pyplot() -> Any:
    """matplotlib's pyplot on the file backend (imported when a plot is drawn, so that
    ``--help`` works without the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(name: str) -> Any | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def step_ratios(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: each contender's step time over AdamW's (same mode), per accumulation."""
    plt = _pyplot()
    accums = sorted({r["accum"] for r in result["rows"]})
    names = [c for c in result["contenders"] if any(r["contender"] == c for r in result["rows"])]
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(names):
        by_accum = {r["accum"]: r for r in result["rows"] if r["contender"] == name}
        missing = {"vs_adamw_same_mode": float("nan")}
        ratios = [by_accum.get(a, missing)["vs_adamw_same_mode"] for a in accums]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(accums))]
        ax.bar(xs, ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # the slowest peer is tens of times AdamW's step
    ax.set_xticks(range(len(accums)), [f"accumulation {a}" for a in accums])
    ax.set_ylabel("step time / FSDP2 + AdamW (same mode)")
    ax.set_title(f"{result['model']}, N={result['nproc']}, {result['device']} (medians, one run)")
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def loss_curves(result: dict[str, Any], path: Path) -> None:
    """Validation loss against step for every (optimizer, rate); the best runs drawn bold."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"dmuon": "tab:blue", "adamw": "tab:orange"}
    for run in result["runs"]:
        best = result["best_lr"][run["optimizer"]] == run["lr"]
        steps, losses = zip(*run["curve"], strict=True)
        ax.plot(
            steps,
            losses,
            color=colors[run["optimizer"]],
            linewidth=2.2 if best else 0.9,
            alpha=1.0 if best else 0.5,
            label=f"{run['optimizer']} lr {run['lr']:g}" + (" (best)" if best else ""),
        )
    target = result["best_final_val_loss"]["adamw"]
    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
    ax.set_ylim(top=min(max(r["curve"][1][1] for r in result["runs"]), 10))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{result['model']}, same seed and tokens; dashed: AdamW's best final loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scaling(result: dict[str, Any], path: Path) -> None:
    """Two panels: step time per preset and rank count; elements moved per rank."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"{r['model']}\nN={r['nproc']}" for r in result["runs"]]
    contenders = sorted({row["contender"] for r in result["runs"] for row in r["rows"]})
    for name in contenders:
        times, moved = [], []
        for r in result["runs"]:
            row = next((x for x in r["rows"] if x["contender"] == name), None)
            times.append(row["median_step_s"] if row else float("nan"))
            moved.append(sum(row["elements_per_rank"].values()) / 1e6 if row else float("nan"))
        left.plot(labels, times, marker="o", label=name)
        right.plot(labels, moved, marker="o", label=name)
    left.set_ylabel("median step time (s)")
    left.set_yscale("log")
    right.set_ylabel("elements moved per rank per step (M, over (N-1)/N)")
    left.legend(fontsize=8)
    fig.suptitle("scaling, accumulation 1 (configurations that ran)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    """Draw every plot whose results exist."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distributed", default="small-n2", help="results/<name>.json")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    OUT_ZH.mkdir(parents=True, exist_ok=True)
    for name, draw, filename in (
        (args.distributed, step_ratios, "step-ratios.png"),
        ("quality", loss_curves, "loss-curves.png"),
        ("scaling", scaling, "scaling.png"),
    ):
        result = _load(name)
        if result is None:
            print(f"skipped {filename}: no results/{name}.json")
            continue
        draw(result, OUT / filename)
        shutil.copyfile(OUT / filename, OUT_ZH / filename)
        print(f"wrote {OUT / filename} and its copy in {OUT_ZH}")


if __name__ == "__main__":
    main()
