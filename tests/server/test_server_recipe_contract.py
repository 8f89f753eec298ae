"""The server against the real recipe (``dmuon.train``): both built from the one contract
module (flags, presets, defaults, metric keys, checkpoint naming), non-finite metrics, and
failure causes reported through torchrun's error files.

The server never imports ``dmuon``; these tests do, to hold the two sides to one contract.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmuon_server.recipe.admission import RECIPE_MODELS
from dmuon_server.schemas import MetricPoint
from dmuon_server.storage.jobfiles import describe_failure, read_exit_report
from dmuon_server.streams.metrics import parse_lines

train = pytest.importorskip("dmuon.train", reason="dmuon.train (the real recipe) is not installed")


def test_the_contract_module_imports_no_torch() -> None:
    code = (
        "import sys, dmuon_recipe_contract, dmuon_server.launching.command, "
        "dmuon_server.recipe.admission; "
        "bad = [m for m in ('torch', 'dmuon', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_recipes_parser_and_config_are_built_from_the_contract() -> None:
    import argparse
    from dataclasses import fields

    import dmuon_recipe_contract as contract

    parser = train.build_parser()
    options = {
        a.dest: a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }
    # --config is where flags come from, not a setting of the run: the parser's alone.
    assert options.pop("config").option_strings == ["--config"]
    assert list(options) == [f.dest for f in contract.FLAGS]  # same flags, same order
    for spec in contract.FLAGS:
        action = options[spec.dest]
        assert action.option_strings == [spec.option], spec.dest
        assert action.default == spec.default and action.help == spec.help, spec.dest
        if spec.kind == "choice":
            assert tuple(action.choices) == spec.choices, spec.dest
    assert [f.name for f in fields(train.TrainConfig)] == [f.dest for f in contract.FLAGS]
    assert train.TrainConfig() == train.parse_args([])
    assert train.REQUIRED_KEYS == contract.METRIC_KEYS


def test_the_servers_spec_and_command_are_built_from_the_contract(tmp_path: Path) -> None:
    import typing

    import dmuon_recipe_contract as contract

    from dmuon.train.checkpoints.folder import checkpoint_name as recipe_checkpoint_name
    from dmuon_server.config import Settings
    from dmuon_server.launching.command import build_command
    from dmuon_server.recipe.review import review
    from dmuon_server.schemas import JobCreate, TrainSpec
    from dmuon_server.storage.jobfiles import checkpoint_name

    dests = {f.dest for f in contract.FLAGS}
    assert set(TrainSpec.model_fields) <= dests, set(TrainSpec.model_fields) - dests
    for name, info in TrainSpec.model_fields.items():
        spec = contract.flag(name)
        if spec.kind == "choice":
            literal = next(a for a in typing.get_args(info.annotation) if a is not type(None))
            assert typing.get_args(literal) == spec.choices, name
    spec = JobCreate.model_validate(
        {"nproc_per_node": 1, "train": {"model": "tiny", "steps": 3, "micro_batch_size": 1,
                                        "accum_steps": 1, "seq_len": 8, "compile": True}}
    )  # fmt: skip
    settings = Settings(data_dir=tmp_path)
    argv = build_command(settings, tmp_path / "job", review(settings, spec)).torchrun_argv
    recipe = argv[argv.index("dmuon.train") + 1 :]
    parsed = train.parse_args(recipe)  # the recipe accepts the server's command line
    assert parsed.compile and parsed.lr == contract.flag("lr").default and parsed.steps == 3
    assert set(a for a in recipe if a.startswith("--")) <= {f.option for f in contract.FLAGS}
    assert checkpoint_name(7) == recipe_checkpoint_name(7) == contract.checkpoint_name(7)


def test_the_servers_preset_table_is_the_recipes() -> None:
    assert set(RECIPE_MODELS) == set(train.PRESETS)
    for name, shape in RECIPE_MODELS.items():
        preset = train.PRESETS[name]
        fields = ("n_layers", "dim", "n_heads", "ffn_dim", "vocab_size", "max_seq_len")
        for field in (*fields, "n_experts", "top_k"):
            assert getattr(shape, field) == getattr(preset, field), (name, field)
        assert shape.num_params == preset.num_params


def test_non_finite_metrics_of_the_recipe_reach_the_api_as_strings(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = train.MetricsWriter(path)
    try:
        writer.write({"step": 1, "loss": 2.5, "lr": 0.02, "grad_norm": 1.0, "time": 0.1})
        writer.write({"step": 2, "loss": math.nan, "lr": 0.02, "grad_norm": math.inf, "time": 0.2})
        writer.write({"step": 3, "loss": -math.inf, "lr": 0.02, "grad_norm": 1.0, "time": 0.3})
    finally:
        writer.close()
    raw = path.read_bytes()
    for line in raw.splitlines():  # strict JSON: no NaN/Infinity tokens
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict token {c}"))
    chunk = parse_lines(raw, final=True)
    assert not chunk.rejected
    points = {step: MetricPoint.model_validate(data) for step, data in chunk.points}
    assert points[1].loss == 2.5
    assert points[2].loss == "NaN" and points[2].grad_norm == "Infinity"
    assert points[3].loss == "-Infinity"


def _run_job(job_dir: Path, *recipe: str) -> subprocess.Popen[bytes]:
    job_dir.mkdir(parents=True)
    argv = [
        sys.executable, "-m", "dmuon_server.runner", "--job-dir", str(job_dir), "--",
        "--standalone", "--nproc_per_node", "1", "--log-dir", str(job_dir / "torchrun-logs"),
        "-m", "dmuon.train", "--model", "tiny", "--steps", "1", "--eval-every", "0",
        "--metrics-file", str(job_dir / "metrics.jsonl"), *recipe,
    ]  # fmt: skip
    env = {**os.environ, "DMUON_CACHE_DIR": str(job_dir / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("DMUON_SERVER_TRAIN_MODULE", None)
    log = (job_dir / "job.log").open("wb")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_the_recipes_own_error_arrives_as_the_failure(tmp_path: Path) -> None:
    """A recipe that fails names its exception, not torchrun's boilerplate: a data error
    (a 5-byte corpus), an argument error (``--seq-len 0``) and a diverging run (learning
    rates of 1e4: "training diverged at step N", exit code 3), launched as the server
    launches jobs (the runner around torchrun), side by side."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello")
    data_job = _run_job(tmp_path / "data", "--data", str(tiny), "--seq-len", "32")
    flag_job = _run_job(tmp_path / "flags", "--seq-len", "0")
    diverging = ["--steps", "30", "--lr", "1e4", "--adamw-lr", "1e4", "--warmup-steps", "0"]
    diverging += ["--seq-len", "32", "--micro-batch-size", "2", "--clip-grad", "0"]
    diverged_job = _run_job(tmp_path / "diverged", *diverging)
    for job in (data_job, flag_job, diverged_job):
        assert job.wait(timeout=240) != 0
    for job_dir, error_type, words, code in [
        (tmp_path / "data", "ValueError", "fewer than --seq-len + 1", 2),
        (tmp_path / "flags", "UsageError", "argument --seq-len", 2),
        (tmp_path / "diverged", "TrainingDiverged", "training diverged at step ", 3),
    ]:
        report = read_exit_report(job_dir)
        assert report is not None, (job_dir / "job.log").read_text()[-3000:]
        failure = describe_failure(job_dir, report, None, 20)
        assert failure["rank"] == 0 and failure["exit_code"] == code
        assert failure["error_type"] == error_type, failure
        assert words in failure["message"], failure
        assert failure["reason"].startswith(f"rank 0 failed (exit code {code}): {error_type}: ")
        assert "To enable traceback" not in failure["reason"]


def test_every_recipe_flag_is_a_spec_field_but_the_ones_the_server_sets(tmp_path: Path) -> None:
    """The spec is the contract: each flag a field (hand-written or generated), each
    generated field reaching the recipe's command line as the recipe parses it."""
    import dmuon_recipe_contract as contract

    from dmuon_server.config import Settings
    from dmuon_server.launching.command import build_command
    from dmuon_server.recipe.review import review
    from dmuon_server.schemas import GENERATED_FLAGS, SERVER_SET_FLAGS, JobCreate, TrainSpec

    dests = {f.dest for f in contract.FLAGS}
    assert set(TrainSpec.model_fields) | SERVER_SET_FLAGS == dests
    assert not set(TrainSpec.model_fields) & SERVER_SET_FLAGS
    chosen = {
        "qk_clip": 42.5, "split": "per_head", "lr_schedule": "wsd", "decay_fraction": 0.3,
        "weight_decay": 0.1, "adamw_weight_decay": 0.05, "momentum": 0.9, "adamw_beta1": 0.8,
        "adamw_beta2": 0.95, "clip_grad": 0.5, "min_lr_ratio": 0.2, "val_fraction": 0.1,
        "eval_sequences": 16, "hsdp": 1, "ns_split": 2, "dtype": "float64", "peak_tflops": 12.5,
        "report_to": "tensorboard", "run_name": "r1", "device": "cpu", "threads": 2,
        "log_every": 5, "progress": "plain", "sample_every": 3, "sample_prompt": "Hi",
        "sample_tokens": 4, "profile_steps": "2:3", "memory_snapshot": True,
    }  # fmt: skip
    assert set(chosen) == set(GENERATED_FLAGS)
    spec = JobCreate.model_validate({"nproc_per_node": 1, "train": {"model": "tiny", **chosen}})
    settings = Settings(data_dir=tmp_path)
    argv = build_command(settings, tmp_path / "job", review(settings, spec)).torchrun_argv
    parsed = train.parse_args(argv[argv.index("dmuon.train") + 1 :])
    assert {dest: getattr(parsed, dest) for dest in chosen} == chosen
    # The OpenAPI schema says what --help says: each field's choices and lower bound.
    schema = JobCreate.model_json_schema()["$defs"]["TrainSpec"]["properties"]
    for spec_flag in contract.FLAGS:
        if spec_flag.dest in SERVER_SET_FLAGS:
            continue
        field = schema[spec_flag.dest]
        kinds = field.get("anyOf", [field])
        if spec_flag.kind == "choice":
            assert [k["enum"] for k in kinds if "enum" in k] == [list(spec_flag.choices)]
        if spec_flag.kind == "int" and spec_flag.minimum is not None:
            assert [k["minimum"] for k in kinds if "minimum" in k] == [spec_flag.minimum]
        assert spec_flag.option in field["description"], spec_flag.dest
    marked = {name for name, field in schema.items() if field.get("x-muon-only")}
    assert marked == set(contract.MUON_ONLY_FLAGS)  # what the dashboard's pair drops
    left_out = JobCreate.model_validate({"nproc_per_node": 1, "train": {"model": "tiny"}})
    argv = build_command(settings, tmp_path / "job", review(settings, left_out)).torchrun_argv
    assert not {f"--{d.replace('_', '-')}" for d in GENERATED_FLAGS} & set(argv)


@pytest.mark.parametrize(
    ("train_fields", "message"),
    [
        ({"qk_clip": 0}, "greater than 0"),
        ({"adamw_beta2": 1.5}, "less than or equal to 1"),
        ({"split": "rows"}, "'none', 'auto' or 'per_head'"),
        ({"optimizer": "adamw", "qk_clip": 5.0}, "qk_clip: only for the dmuon optimizer"),
        ({"report_to": "tensorboard;rm"}, "should match pattern"),
        ({"report_to": "comet"}, "should match pattern"),
    ],
)
def test_generated_fields_keep_the_recipes_bounds(train_fields: dict, message: str) -> None:
    from pydantic import ValidationError

    from dmuon_server.schemas import JobCreate

    with pytest.raises(ValidationError, match=message):
        JobCreate.model_validate({"nproc_per_node": 1, "train": {"model": "tiny", **train_fields}})
