"""The recipe in the demo's lean install (torch and the two packages, no Hugging Face
libraries): a preset trains and checkpoints; the checkpoints' HF snapshot holds the config
but not the byte tokenizer's files, which need ``tokenizers``, and the run says so once.

Oracle: the same run with the libraries present, whose losses it must equal, and the
files on disk.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dmuon.train import TrainConfig, run


def test_a_preset_checkpoints_without_the_hf_libraries(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    base = TrainConfig(
        model="tiny", seq_len=32, micro_batch_size=2, steps=3, eval_every=0,
        progress="plain", cache_dir=cache_dir, threads=1, checkpoint_every=1,
    )  # fmt: skip
    full = run(
        replace(base, checkpoint_dir=str(tmp_path / "full"), metrics_file=str(tmp_path / "a"))
    )
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "transformers", None)
    lean = run(
        replace(base, checkpoint_dir=str(tmp_path / "lean"), metrics_file=str(tmp_path / "b"))
    )
    assert lean["steps"] == full["steps"] == 3
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]
        for name in ("a", "b")
    ]
    assert losses[0] == losses[1]
    for step in (1, 2, 3):
        with_libs = tmp_path / "full" / f"step_{step:08d}" / "hf"
        without = tmp_path / "lean" / f"step_{step:08d}" / "hf"
        assert (with_libs / "tokenizer.json").is_file()
        assert (without / "config.json").is_file() and not (without / "tokenizer.json").exists()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "tokenizer files" in line]
    assert len(warnings) == 1 and "packages/dmuon-core[hf]" in warnings[0]
