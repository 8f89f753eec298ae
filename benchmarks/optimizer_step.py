"""The optimizer step alone, single process: ``dmuon.Muon`` against ``torch.optim.Muon``.

Both optimizers step the same matrices with the same (fixed) gradients; the rest of the
model goes to AdamW (``dmuon.Muon``'s own AdamW group, ``torch.optim.AdamW`` next to
``torch.optim.Muon``). Contenders are timed interleaved, round after round, and the medians
are compared within this run. Reported per shape bucket and for the whole model, for:

* both at their defaults (torch: bfloat16 Keller iteration; dmuon: `default_ns_dtype`,
  Polar Express, standard iteration);
* both in bfloat16 (the only dtype ``torch.optim.Muon`` iterates in; dmuon never takes
  the Gram iteration in bfloat16);
* dmuon in float32 with and without the Gram iteration (what the Gram iteration gains);
* dmuon at its defaults with the block-symmetric products off (``dmuon-unblocked``: what
  computing ``X Xᵀ`` and ``A·A`` by blocks gains on a CPU);
* dmuon at its defaults with a workspace cap of a quarter of what the defaults hold
  (``dmuon-chunked``: what running the buckets in chunks costs).

``--runs N`` repeats the whole measurement N times (each one interleaved) and records every
run's whole-model speedup with its minimum, median and maximum: the spread, not only a
median. ``--profile`` then runs steps of torch and of ``dmuon-default`` under torch.profiler
(``--profile-rounds`` of each, interleaved with the kernel-rate measurement; the median one
is kept) and splits each into matrix products, copies, other operators and the rest (Python
and dispatch), with the rate the products ran at and the self time of each operator outside
the products; next to it, the rate of the same products alone (torch's own ``mm``/``addmm``
calls at the iteration's shapes, timed in a loop): the kernel's rate on this machine. Under
it, the ceiling: torch's step over the products' time, at that rate and as DMuon ran them.

    python benchmarks/optimizer_step.py --model small --threads 1
    python benchmarks/optimizer_step.py --model small,base --runs 5 --profile
    python benchmarks/optimizer_step.py --model small,base --device cuda --rounds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dmuon
from dmuon.optim import _orthogonalize as orthogonalize
from dmuon.optim import default_ns_dtype
from dmuon.train import build_model, lm_loss

sys.path.insert(0, str(Path(__file__).parent))
from cli_types import non_negative_int, positive_int
from machine import machine_info

CONTENDERS: dict[str, dict[str, Any]] = {
    "dmuon-default": {},
    "dmuon-bf16": {"ns_dtype": torch.bfloat16},
    "dmuon-fp32": {"ns_dtype": torch.float32, "ns_gram": True},
    "dmuon-fp32-nogram": {"ns_dtype": torch.float32, "ns_gram": False},
    "dmuon-unblocked": {},
    "dmuon-chunked": {},
}
"""dmuon.Muon settings timed against torch.optim.Muon + AdamW at their defaults."""

CHUNKED = {"dmuon-chunked"}
"""Contenders whose ``max_workspace_bytes`` is a quarter of the defaults' workspace on the
same model, so every bucket of more than a few matrices runs in chunks."""

UNBLOCKED = {"dmuon-unblocked"}
"""Contenders run with the block-symmetric products off (`CPU_SYMMETRIC_BLOCKS`): the
default settings otherwise, so the two columns show what the blocks gain in this run."""


class _Bucket(nn.Module):
    """``count`` bias-free linear layers of one shape, under ``layers`` (a hook boundary)."""

    def __init__(self, rows: int, cols: int, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(cols, rows, bias=False) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).square().mean() for layer in self.layers)  # type: ignore[return-value]


def _model_and_loss(
    spec: dict[str, Any], device: torch.device
) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if spec["kind"] == "preset":
        torch.manual_seed(0)
        model = build_model(spec["preset"], seed=0, max_seq_len=64, device=device)
        tokens = torch.randint(0, 256, (2, 65), generator=gen).to(device)
        return model, lambda m: lm_loss(m(tokens[:, :-1]), tokens[:, 1:])
    torch.manual_seed(0)
    rows, cols, count = spec["rows"], spec["cols"], spec["count"]
    model = _Bucket(rows, cols, count).to(device)
    x = torch.randn(8, cols, generator=gen).to(device)
    return model, lambda m: m(x)


def _make_step(name: str, spec: dict[str, Any], device: torch.device) -> Callable[[], None]:
    """Build a model on ``device``, one backward, and an optimizer; return its ``step``."""
    model, loss_fn = _model_and_loss(spec, device)
    if name == "torch":
        dedicated = {n for n, _ in _muon_targets(spec, device)}
        params = dict(model.named_parameters())
        muon = torch.optim.Muon([params[n] for n in sorted(dedicated)])
        rest = [p for n, p in params.items() if n not in dedicated]
        adamw = torch.optim.AdamW(rest) if rest else None
        loss_fn(model).backward()

        def step() -> None:
            muon.step()
            if adamw is not None:
                adamw.step()

        return step
    settings = dict(CONTENDERS[name])
    if name in CHUNKED:
        settings["max_workspace_bytes"] = max(1, _default_workspace(spec, device) // 4)
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, **settings)
    loss_fn(model).backward()
    if name not in UNBLOCKED:
        return optimizer.step

    def unblocked_step() -> None:
        # Workspaces read the switch when they are built, in the first step.
        orthogonalize.CPU_SYMMETRIC_BLOCKS = False
        try:
            optimizer.step()
        finally:
            orthogonalize.CPU_SYMMETRIC_BLOCKS = True

    return unblocked_step


def _default_workspace(spec: dict[str, Any], device: torch.device) -> int:
    """Bytes of the Newton-Schulz workspace ``dmuon.Muon`` holds at its defaults here."""
    model, loss_fn = _model_and_loss(spec, device)
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model)
    loss_fn(model).backward()
    optimizer.step()
    return optimizer.workspace_bytes()


def _muon_targets(spec: dict[str, Any], device: torch.device) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the matrices ``dmuon.dedicate_params`` selects for this model."""
    model, _ = _model_and_loss(spec, device)
    return [(fqn, tuple(model.get_parameter(fqn).shape)) for fqn in dmuon.dedicate_params(model)]


def _shape_counts(spec: dict[str, Any], device: torch.device) -> dict[tuple[int, ...], int]:
    """How many of the matrices ``dmuon.dedicate_params`` selects have each shape."""
    return dict(Counter(shape for _, shape in _muon_targets(spec, device)))


def _time(
    steps: dict[str, Callable[[], None]], rounds: int, warmup: int, device: torch.device
) -> dict[str, float]:
    def sync() -> None:
        if device.type == "cuda":  # GPU work is asynchronous: time it to completion
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(warmup + rounds):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
    return {n: statistics.median(t) for n, t in times.items()}


PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")
OPERATOR_MIN_S = 1e-4
"""Operators outside the products whose self time is recorded one by one, from this on."""


def profile_step(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """One ``step()`` under torch.profiler: seconds in products, copies, other operators and
    the rest (self times of the ``aten::`` operators), the products' rate, and the self time
    of each operator outside the products (from `OPERATOR_MIN_S` on), largest first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - start
    seconds = {"products": 0.0, "copies": 0.0, "other_ops": 0.0}
    outside: dict[str, float] = {}
    flops = 0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        self_s = event.self_cpu_time_total / 1e6
        if event.key in PRODUCTS:
            seconds["products"] += self_s
            flops += event.flops
            continue
        seconds["copies" if event.key in COPIES else "other_ops"] += self_s
        if self_s >= OPERATOR_MIN_S:
            outside[event.key] = self_s
    seconds["rest"] = max(0.0, total - sum(seconds.values()))
    return {
        "total_s": total,
        "seconds": seconds,
        "operators_outside_products": dict(sorted(outside.items(), key=lambda kv: -kv[1])),
        "product_flops": flops,
        "product_gflops_per_s": flops / seconds["products"] / 1e9 if seconds["products"] else None,
    }


def kernel_rate(shapes: dict[tuple[int, ...], int], device: torch.device, rounds: int = 3) -> float:
    """GFLOP/s of bfloat16 ``mm``/``addmm`` at one Newton-Schulz step's products for every
    matrix of ``shapes`` (torch.optim.Muon's calls), alone in a loop: the kernel's rate."""
    gen = torch.Generator().manual_seed(0)
    work = []
    for (rows, cols), count in shapes.items():
        short, long = min(rows, cols), max(rows, cols)
        x = torch.randn(short, long, generator=gen).to(device, torch.bfloat16) / long**0.5
        work += [x] * count
    flops = sum(2 * (2 * x.shape[0] ** 2 * x.shape[1] + x.shape[0] ** 3) for x in work)

    def one_step() -> None:
        for x in work:
            a = x @ x.T
            b = torch.addmm(a, a, a, beta=-4.775, alpha=2.0315)
            torch.addmm(x, b, x, beta=3.4445)

    one_step()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times) / 1e9


def run(preset: str, rounds: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Time every contender on ``preset``'s matrices: whole model, then each shape bucket."""
    whole = {"kind": "preset", "preset": preset}
    shapes = _shape_counts(whole, device)
    specs = {"all": whole} | {
        f"{r}x{c} (x{n})": {"kind": "bucket", "rows": r, "cols": c, "count": n}
        for (r, c), n in shapes.items()
    }
    rows = {}
    for label, spec in specs.items():
        names = ["torch", *CONTENDERS]
        medians = _time({n: _make_step(n, spec, device) for n in names}, rounds, warmup, device)
        rows[label] = {
            "median_s": medians,
            "speedup_vs_torch": {n: medians["torch"] / medians[n] for n in CONTENDERS},
        }
    return {
        "machine": machine_info(),
        "preset": preset,
        "device": device.type,
        "threads": torch.get_num_threads(),
        "default_ns_dtype": str(default_ns_dtype(device)),
        "rounds": rounds,
        "rows": rows,
    }


def repeated_runs(preset: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``args.runs`` runs of `run` on ``preset``: the first run's table, every run's
    whole-model speedups and their spread, and (``args.profile``) the profile."""
    runs = [run(preset, args.rounds, args.warmup, device) for _ in range(args.runs)]
    result = runs[0]
    every = [r["rows"]["all"]["speedup_vs_torch"] for r in runs]
    result["runs"] = args.runs
    result["speedups_per_run"] = every
    result["speedup_spread"] = {
        name: {
            "min": min(s[name] for s in every),
            "median": statistics.median(s[name] for s in every),
            "max": max(s[name] for s in every),
        }
        for name in CONTENDERS
    }
    if args.profile:
        result["profile"] = profile_rounds(preset, args.profile_rounds, device)
    return result


def profile_rounds(preset: str, rounds: int, device: torch.device) -> dict[str, Any]:
    """``rounds`` rounds of one profiled step of torch and of ``dmuon-default`` and one
    measurement of the kernel's rate, interleaved; per contender the round with the median
    total (its parts kept together), and the median kernel rate."""
    whole = {"kind": "preset", "preset": preset}
    names = ("torch", "dmuon-default")
    steps = {name: _make_step(name, whole, device) for name in names}
    shapes = _shape_counts(whole, device)
    profiles: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    rates = []
    for _ in range(rounds):
        for name in names:
            profiles[name].append(profile_step(steps[name], device))
        rates.append(kernel_rate(shapes, device))
    return {
        "rounds": rounds,
        "steps": {
            name: sorted(runs, key=lambda r: r["total_s"])[(rounds - 1) // 2]
            for name, runs in profiles.items()
        },
        "total_s_per_round": {
            name: [r["total_s"] for r in runs] for name, runs in profiles.items()
        },
        "kernel_gflops_per_s": statistics.median(rates),
        "kernel_gflops_per_s_per_round": rates,
    }


def ceiling_line(result: dict[str, Any]) -> str:
    """How far ahead of torch's (unprofiled) step a step doing nothing but its matrix
    products could be: at the kernel's rate, and at the time DMuon's products took."""
    profile = result["profile"]
    ours = profile["steps"]["dmuon-default"]
    torch_s = result["rows"]["all"]["median_s"]["torch"]
    at_rate = ours["product_flops"] / (profile["kernel_gflops_per_s"] * 1e9)
    ran = ours["seconds"]["products"]
    return (
        f"products alone would be {torch_s / at_rate:.2f}x torch's step at the kernel's rate, "
        f"{torch_s / ran:.2f}x as dmuon ran them ({at_rate * 1e3:.0f} / {ran * 1e3:.0f} ms "
        f"against torch's {torch_s * 1e3:.0f} ms)"
    )


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table: median step time of torch and the speedup of each dmuon setting."""
    head = "| matrices | torch Muon+AdamW (ms) | " + " | ".join(CONTENDERS) + " |"
    lines = [head, "|" + "---|" * (2 + len(CONTENDERS))]
    for label, row in result["rows"].items():
        cells = [f"{row['median_s']['torch'] * 1e3:.1f}"] + [
            f"{row['median_s'][n] * 1e3:.1f} ({row['speedup_vs_torch'][n]:.2f}x)"
            for n in CONTENDERS
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """Parse flags, time the contenders, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="preset(s), comma-separated")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--runs", type=positive_int, default=1, help="whole measurements")
    parser.add_argument("--profile", action="store_true", help="add the profile of one step")
    parser.add_argument(
        "--profile-rounds",
        type=positive_int,
        default=3,
        help="profiled steps per contender, interleaved; the median one is kept",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the current GPU")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for preset in args.model.split(","):
        results.append(repeated_runs(preset, args, device))
        result = results[-1]
        print(
            f"preset={result['preset']} device={result['device']} threads={result['threads']} "
            f"default_ns_dtype={result['default_ns_dtype']} rounds={result['rounds']}"
        )
        print("speedup = torch.optim.Muon + AdamW (defaults) time / dmuon.Muon time\n")
        print(format_table(result) + "\n")
        spread = result["speedup_spread"]["dmuon-default"]
        print(f"dmuon-default over {args.runs} runs: min {spread['min']:.2f}x, median "
              f"{spread['median']:.2f}x, max {spread['max']:.2f}x")  # fmt: skip
        if "profile" in result:
            for name, prof in result["profile"]["steps"].items():
                parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in prof["seconds"].items())
                print(f"profile {name}: {prof['total_s'] * 1e3:.1f} ms = {parts}; products at "
                      f"{prof['product_gflops_per_s']:.0f} GFLOP/s")  # fmt: skip
                top = list(prof["operators_outside_products"].items())[:6]
                print("  outside the products: "
                      + ", ".join(f"{op} {t * 1e3:.1f} ms" for op, t in top))  # fmt: skip
            print(f"the same products alone: {result['profile']['kernel_gflops_per_s']:.0f} "
                  "GFLOP/s")  # fmt: skip
            print(ceiling_line(result) + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
