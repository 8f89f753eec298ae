"""Scaling: step time and counted traffic as the model grows and as the ranks grow.

Runs `bench.run` (accumulation 1) for each preset (``tiny``, ``small``, ``base``) and rank
count (1, 2, 4) in order of cost, with FSDP2 + AdamW and DMuon at Z2 and Z3. Configurations
not started before ``--budget-s`` are recorded as skipped, so the results say what ran.

    python benchmarks/scaling.py --budget-s 900
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench
from cli_types import positive_int
from machine import machine_info

CONTENDERS = ("adamw-z2", "adamw-z3", "dmuon-z2", "dmuon-z3")
GRID = [
    ("tiny", 1),
    ("tiny", 2),
    ("small", 1),
    ("small", 2),
    ("tiny", 4),
    ("small", 4),
    ("base", 1),
    ("base", 2),
    ("base", 4),
]
"""(preset, ranks), cheapest first."""


def _write(
    args: argparse.Namespace, runs: list[dict[str, Any]], skipped: list[dict[str, Any]]
) -> None:
    record = {
        "machine": machine_info(),
        "steps": args.steps,
        "budget_s": args.budget_s,
        "runs": runs,
        "skipped": skipped,
    }
    args.json.write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    """Run the grid within the budget; write ``results/scaling.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=1800.0)
    parser.add_argument("--steps", type=positive_int, default=2)
    parser.add_argument("--json", type=Path, default=bench.RESULTS / "scaling.json")
    args = parser.parse_args()
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for preset, nproc in GRID:
        if time.perf_counter() - start > args.budget_s:
            skipped.append({"model": preset, "nproc": nproc})
            continue
        flags = ["--model", preset, "--nproc", str(nproc), "--accum", "1"]
        flags += ["--steps", str(args.steps), "--contenders", *CONTENDERS]
        began = time.perf_counter()
        result = bench.run(bench.parse_args(flags))
        runs.append(
            {
                "model": preset,
                "nproc": nproc,
                "wall_s": time.perf_counter() - began,
                "rows": result["rows"],
            }
        )
        print(f"{preset} N={nproc}: {runs[-1]['wall_s']:.0f} s", flush=True)
        _write(args, runs, skipped)  # after each run, so a stopped grid keeps its results
    _write(args, runs, skipped)


if __name__ == "__main__":
    main()
