"""The recipe under torchrun: 2 gloo ranks give the loss curve of one process.

Oracle: `python -m dmuon.train` in one process on the same global batch (micro-batch 2m
instead of m on each of 2 ranks). Tolerance 1e-4 per step on the logged loss, validation
loss and gradient norm. Only rank 0 prints its summary and writes metrics.

The run is Z3 on the mixture-of-experts preset (fused 3-D expert stacks dedicated whole,
the router with FSDP2 and AdamW; its attention matrices are dense 2-D Linear weights
dedicated like those of `tiny`), which also writes a final checkpoint in both runs: the
2-rank checkpoint holds every stack at its full shape with its Muon momentum, equal to the
one-process run's. Z2 under torchrun is checked by ``test_recipe_multinode.py`` (two
agents as HSDP 2x1, against one process).

The corpus is the test's own text, not the recipe's default (the interpreter's standard
library, which differs between Python builds): the two runs sum in different orders, and
where a token's router scores nearly tie, that can send it to another expert in one run
from some step on, which moves the loss by more than the tolerance. On fixed text the
outcome is the same on every interpreter.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from recipe_launch import recipe_env
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

STEPS = 20
COMMON = [
    "--steps", str(STEPS), "--seq-len", "32", "--accum-steps", "2",
    "--lr", "0.02", "--adamw-lr", "0.003", "--warmup-steps", "2", "--seed", "3",
    "--ns-dtype", "float32",
    "--progress", "plain", "--device", "cpu",
]  # fmt: skip


def _corpus(folder: Path) -> Path:
    """About 200 KB of sentences drawn from a small vocabulary, the same on every run."""
    rng = random.Random(0)
    words = [
        "the", "a", "model", "learns", "to", "predict", "next", "token", "of", "every",
        "document", "it", "reads", "while", "experts", "share", "work", "and", "each",
        "router", "picks", "two", "for", "one", "word", "in", "this", "small", "text",
    ]  # fmt: skip
    sentences = [" ".join(rng.choices(words, k=rng.randint(6, 18))) + "." for _ in range(3000)]
    path = folder / "corpus.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return path


def _run(tmp_path: Path, cache: str, name: str, nproc: int, extra: list[str]) -> list[dict]:
    metrics = tmp_path / f"{name}.jsonl"
    env = recipe_env(cache, tmp_path)
    if nproc == 1:
        launcher = [sys.executable, "-m", "dmuon.train"]
    else:
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), "-m", "dmuon.train",
        ]  # fmt: skip
    done = subprocess.run(
        [*launcher, *COMMON, *extra, "--metrics-file", str(metrics)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("done:") == 1  # one summary: rank 0 alone reports
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [line for line in lines if line["step"] >= 1]


def _checkpoint(run_dir: Path, tmp_path: Path) -> dict[str, Any]:
    """The final DCP checkpoint of a run as one plain dict, read without a process group."""
    out = tmp_path / f"{run_dir.name}.pt"
    dcp_to_torch_save(run_dir / f"step_{STEPS:08d}", out)
    return torch.load(out, weights_only=False)


def test_two_ranks_match_one_process_on_the_global_batch(tmp_path: Path, cache_dir: str) -> None:
    args = ["--model", "moe", "--optimizer", "dmuon", "--mode", "z3", "--eval-every", "10",
            "--data", str(_corpus(tmp_path))]  # fmt: skip
    single_args = ["--checkpoint-dir", str(tmp_path / "single-ckpt")]
    double_args = ["--checkpoint-dir", str(tmp_path / "double-ckpt")]
    single = _run(
        tmp_path, cache_dir, "single", 1, [*args, *single_args, "--micro-batch-size", "4"]
    )
    double = _run(
        tmp_path, cache_dir, "double", 2, [*args, *double_args, "--micro-batch-size", "2"]
    )
    assert [m["step"] for m in double] == list(range(1, STEPS + 1))
    assert [m["step"] for m in single] == list(range(1, STEPS + 1))
    for one, two in zip(single, double, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if one.get(key) is not None or two.get(key) is not None:
                assert abs(one[key] - two[key]) <= 1e-4, (key, one, two)
    assert double[-1]["loss"] < double[0]["loss"] - 0.3  # it trained
    one = _checkpoint(tmp_path / "single-ckpt", tmp_path)
    two = _checkpoint(tmp_path / "double-ckpt", tmp_path)
    assert one["model"].keys() == two["model"].keys()
    for name, want in one["model"].items():
        torch.testing.assert_close(two["model"][name], want, rtol=0, atol=1e-5, msg=name)
    stack = "layers.1.mlp.experts.gate_up_proj"
    assert two["model"][stack].shape == (4, 256, 64)
    momentum = two["optim"]["state"][stack]["momentum_buffer"]
    assert momentum.shape == (4, 256, 64) and momentum.abs().sum() > 0
    torch.testing.assert_close(
        momentum, one["optim"]["state"][stack]["momentum_buffer"], rtol=0, atol=1e-5
    )
    router = two["optim"]["state"]["layers.1.mlp.gate.weight"]
    assert "exp_avg" in router and "momentum_buffer" not in router  # AdamW
