"""The recipe on Hugging Face models at 2 gloo ranks equals one process, in every format.

Oracle: the same flags in one process (no process group) on the same global batch: 2
ranks x accumulation 2 x micro-batch 2 against 1 process x accumulation 4 x micro-batch 2,
float32, final weights within 1e-5 per parameter (read back from each run's final
checkpoint with torch's ``dcp_to_torch_save``). Every data format (text folder, JSON
lines, parquet, ``.bin`` tokens) runs in Z2 and in Z3, on the four architectures in turn.
The 2-rank runs start with an empty cache, so rank 0 tokenizes while rank 1 waits for it.

``--ns-split 2``: on a one-layer Llama whose three MLP matrices outweigh the rest, the 2
ranks share the iterations of the matrices the plan splits, and still end within 1e-5 of
the same one-process run.

Resume: 2 ranks trained 2 steps and resumed to 4 end bit for bit where 4 uninterrupted
steps end (model and optimizer state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_models as h
import pytest
import torch
from dist_harness import spawn_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dmuon.train import run

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

STEPS = 3
CASES = [  # (data format, architecture, mode): each format in Z2 and Z3
    ("text", "llama", "z3"),
    ("jsonl", "qwen2", "z2"),
    ("parquet", "mixtral", "z3"),
    ("bin", "gpt2", "z2"),
    ("text", "gpt2", "z2"),
    ("jsonl", "mixtral", "z3"),
    ("parquet", "llama", "z2"),
    ("bin", "qwen2", "z3"),
]


def _common(cache: Path) -> list[str]:
    return [
        "--seq-len", "24", "--micro-batch-size", "2", "--warmup-steps", "1",
        "--min-lr-ratio", "1", "--eval-every", "0", "--progress", "plain",
        "--ns-dtype", "float32", "--threads", "1", "--seed", "7", "--cache-dir", str(cache),
    ]  # fmt: skip


def _weights(checkpoint: Path, out: Path) -> dict[str, Any]:
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf-dist")
    docs = h.documents(120, seed=1)
    tokenizer = h.train_tokenizer(docs)
    models = {a: h.model_dir(root / a, a, tokenizer=tokenizer) for a in h.ARCHS}
    data = {
        "text": h.write_text_folder(root / "text", docs),
        "jsonl": h.write_jsonl(root / "d.jsonl", docs),
        "parquet": h.write_parquet(root / "d.parquet", docs),
        "bin": h.write_bin(root / "d.bin", h.expected_tokens(tokenizer, docs), len(tokenizer)),
    }
    common = _common(root / "cache")

    def argv(fmt: str, arch: str, mode: str, accum: int, where: Path, steps: int) -> list[str]:
        return [*common, "--model", str(models[arch]), "--data", str(data[fmt]), "--mode", mode,
                "--accum-steps", str(accum), "--steps", str(steps),
                "--checkpoint-dir", str(where)]  # fmt: skip

    two = [
        (f"{f}-{a}-{m}", argv(f, a, m, 2, root / "two" / f"{f}-{a}-{m}", STEPS))
        for f, a, m in CASES
    ]
    resumed = root / "resumed"
    llama = ("jsonl", "llama", "z3", 2)
    wide = h.model_dir(
        root / "llama-wide", "llama", tokenizer=tokenizer, num_hidden_layers=1,
        intermediate_size=256,
    )  # fmt: skip

    def split_argv(accum: int, where: Path) -> list[str]:
        return [*common, "--model", str(wide), "--data", str(data["text"]),
                "--accum-steps", str(accum), "--steps", str(STEPS),
                "--checkpoint-dir", str(where)]  # fmt: skip

    two += [
        ("ns-split", [*split_argv(2, root / "ns-split"), "--ns-split", "2"]),
        ("uninterrupted", argv(*llama, root / "uninterrupted", 4)),
        ("first half", argv(*llama, resumed, 2)),
        ("resumed", argv(*llama, resumed, 4)),
    ]
    results = spawn_ranks(2, h.rank_runs, two)
    for f, a, m in CASES:  # the oracle: one process, accumulation 4
        run(argv(f, a, m, 4, root / "one" / f"{f}-{a}-{m}", STEPS))
    run(split_argv(4, root / "one" / "ns-split"))
    return {"root": root, "results": results, "wide": wide}


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_two_ranks_equal_one_process(runs: dict[str, Any], case: tuple[str, str, str]) -> None:
    name = "-".join(case)
    for rank, result in enumerate(runs["results"]):
        assert "error" not in result[name], result[name]["error"]
        assert result[name]["world_size"] == 2, rank
    root = runs["root"]
    step = f"step_{STEPS:08d}"
    two = _weights(root / "two" / name / step, root / f"{name}-two.pt")["model"]
    one = _weights(root / "one" / name / step, root / f"{name}-one.pt")["model"]
    assert two.keys() == one.keys()
    for key, want in one.items():
        assert two[key].shape == want.shape and want.numel() > 0, key
        torch.testing.assert_close(two[key], want, rtol=0, atol=1e-5, msg=key)


def test_ns_split_shares_iterations_and_equals_one_process(runs: dict[str, Any]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from dmuon.plan import plan_cluster

    for result in runs["results"]:
        assert "error" not in result["ns-split"], result["ns-split"]["error"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs["wide"]))
    plan = plan_cluster(model, 2, 2, ns_split=2, device_type="cpu")
    assert any(r.split_collectives for r in plan.ranks)  # some matrices were split
    root = runs["root"]
    step = f"step_{STEPS:08d}"
    split = _weights(root / "ns-split" / step, root / "ns-split.pt")["model"]
    one = _weights(root / "one" / "ns-split" / step, root / "ns-split-one.pt")["model"]
    assert split.keys() == one.keys()
    for key, want in one.items():
        torch.testing.assert_close(split[key], want, rtol=0, atol=1e-5, msg=key)


def test_resume_at_the_same_world_size_is_bit_identical(runs: dict[str, Any]) -> None:
    for result in runs["results"]:
        for name in ("uninterrupted", "first half", "resumed"):
            assert "error" not in result[name], result[name]["error"]
    root = runs["root"]
    a = _weights(root / "uninterrupted" / "step_00000004", root / "a.pt")
    b = _weights(root / "resumed" / "step_00000004", root / "b.pt")
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    state_a, state_b = a["optim"]["state"], b["optim"]["state"]
    assert state_a.keys() == state_b.keys()
    for key, entry in state_a.items():
        for slot, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, state_b[key][slot]), (key, slot)
