"""``python -m dmuon.train --config run.toml``: the recipe's flags from a TOML file.

Oracles: the `TrainConfig` the same flags give on the command line (a run is a function
of its config); the run's own resolved copies (beside the metrics, in the checkpoint),
read back with ``--config``; and the messages of the refused files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmuon.train import parse_args, run

RUN_TOML = """
model = "tiny"
seq-len = 32
micro_batch_size = 2
accum_steps = 2
lr = 0.02
mode = "z2"
activation-checkpointing = true
compile = false

[schedule]
steps = 3
warmup_steps = 1
lr_schedule = "wsd"
"""

SAME_FLAGS = [
    "--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "2",
    "--lr", "0.02", "--mode", "z2", "--activation-checkpointing", "--steps", "3",
    "--warmup-steps", "1", "--lr-schedule", "wsd",
]  # fmt: skip


def test_a_toml_file_gives_the_config_its_flags_give(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    assert parse_args(["--config", str(path)]) == parse_args(SAME_FLAGS)
    # The command line comes after the file: its flags win.
    overridden = parse_args([f"--config={path}", "--steps", "7", "--mode", "z3"])
    assert overridden == parse_args([*SAME_FLAGS, "--steps", "7", "--mode", "z3"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", "stepz (did you mean steps?) are no flags of the recipe"),
        ("micro_batch = 4\n", "micro_batch (did you mean micro_batch_size?) are no flags"),
        ("zzzz = 4\n", "--config {path}: zzzz are no flags of the recipe"),
        ("steps = [1, 2]\n", "steps takes one int value"),
        ("compile = 1\n", "compile is a switch: true or false"),
        ("steps = \n", "is not TOML"),
        ("steps = 0\n", "argument --steps"),  # the command line's own check
    ],
)
def test_a_file_the_recipe_cannot_use_is_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", str(path)])
    assert exit_info.value.code == 2
    assert message.format(path=path) in capsys.readouterr().err


def test_a_run_writes_its_resolved_settings_beside_the_metrics_and_in_checkpoints(
    tmp_path: Path, cache_dir: str
) -> None:
    path = tmp_path / "run.toml"
    metrics = tmp_path / "out" / "metrics.jsonl"
    path.write_text(
        RUN_TOML
        + f'\n[output]\nmetrics_file = "{metrics}"\ncache_dir = "{cache_dir}"\n'
        + f'checkpoint_dir = "{tmp_path / "ckpt"}"\ncheckpoint_every = 3\nthreads = 1\n'
    )
    config = parse_args(["--config", str(path)])
    run(config)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 3
    resolved = metrics.with_name("metrics.config.toml")
    assert parse_args(["--config", str(resolved)]) == config
    saved = tmp_path / "ckpt" / "step_00000003" / "config.toml"
    assert saved.read_text() == resolved.read_text()
