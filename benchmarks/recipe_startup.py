"""What a recipe process costs with and without its start-up imports kept from the garbage
collector (``dmuon._startup``).

Each round launches the same short recipe run twice as a process of its own: once as
``dmuon-train`` runs it (`program`: imports made with the collector paused, then frozen)
and once through ``main`` as an in-process caller would (the collector left alone), in
alternating order. The CPU time (user + system) of each process is read from
``getrusage`` of its children, and the ratio with / without is taken per round; the
median over the rounds is the result (ratios measured side by side: other processes on a
shared machine stretch both alike). Both runs must write the same losses, gradient norms
and learning rates.

    python benchmarks/recipe_startup.py --rounds 5
    python benchmarks/recipe_startup.py --rounds 5 --steps 20 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cli_types import non_negative_int, positive_int
from machine import machine_info

#: The two ways of starting the recipe; the flags follow as ``sys.argv[1:]``.
LAUNCHES = {
    "kept": "import sys; from dmuon.train.__main__ import program; sys.exit(program())",
    "plain": "import sys; from dmuon.train.__main__ import main; sys.exit(main(sys.argv[1:]))",
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(
    variant: str, flags: list[str], env: dict[str, str], folder: Path
) -> tuple[float, float, list[tuple[object, ...]]]:
    """Run the recipe once as ``variant``; return (CPU seconds, wall seconds, and each
    step's loss, gradient norm and learning rate from its metrics file)."""
    metrics = folder / f"{variant}.jsonl"
    metrics.unlink(missing_ok=True)
    cpu, wall = _children_cpu_s(), time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHES[variant], *flags, "--metrics-file", str(metrics)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    cpu, wall = _children_cpu_s() - cpu, time.perf_counter() - wall
    if proc.returncode != 0:
        raise SystemExit(f"the {variant} run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    steps = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records if "loss" in r]
    return cpu, wall, steps


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Launch both variants ``args.rounds`` times, alternating which goes first."""
    with tempfile.TemporaryDirectory(prefix="dmuon-startup-") as folder:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.setdefault("DMUON_CACHE_DIR", folder)  # the corpus cache
        here = Path(folder)
        flags = ["--model", args.model, "--steps", str(args.steps), "--eval-every", "0",
                 "--progress", "plain", "--device", "cpu"]  # fmt: skip
        for _ in range(args.warmup):  # fills the corpus cache and the byte-code caches
            launch("plain", flags, env, here)
        rounds = []
        for i in range(args.rounds):
            order = ("kept", "plain") if i % 2 == 0 else ("plain", "kept")
            runs = {variant: launch(variant, flags, env, here) for variant in order}
            if runs["kept"][2] != runs["plain"][2]:
                raise SystemExit(f"the runs differ:\n{runs['kept'][2]}\n---\n{runs['plain'][2]}")
            rounds.append({v: {"cpu_s": r[0], "wall_s": r[1]} for v, r in runs.items()})
    ratios = [r["kept"]["cpu_s"] / r["plain"]["cpu_s"] for r in rounds]
    return {
        "benchmark": "recipe_startup",
        "model": args.model,
        "steps": args.steps,
        "rounds": rounds,
        "median_cpu_s": {
            v: statistics.median(r[v]["cpu_s"] for r in rounds) for v in ("kept", "plain")
        },
        "median_cpu_ratio_kept_over_plain": statistics.median(ratios),
        "machine": machine_info(),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and print the figures (and write them as JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed runs first")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = measure(args)
    cpu = result["median_cpu_s"]
    print(
        f"recipe process ({args.model}, {args.steps} steps), median CPU time over "
        f"{args.rounds} rounds: kept {cpu['kept']:.2f} s, plain {cpu['plain']:.2f} s; "
        f"kept / plain {result['median_cpu_ratio_kept_over_plain']:.2f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
