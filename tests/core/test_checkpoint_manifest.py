"""Checkpoint manifests: a folder is whole only when every file its manifest names is there,
with the size and SHA-256 it was written with.

Oracle: the files themselves, damaged on purpose (truncated, one byte flipped, removed,
the manifest missing), and the exit codes of ``python -m dmuon.checkpoint verify``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dmuon.checkpoint import _manifest as manifest


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "step_00000002"
    state = {"model": {"w": torch.arange(1000.0), "b": torch.ones(10)}}
    writer = dcp.FileSystemWriter(str(path))
    dcp.save(state, storage_writer=writer)
    manifest.write_manifest(path)
    return path


def _cli(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``python -m dmuon.checkpoint verify PATH``, in this process."""
    from dmuon.checkpoint.__main__ import main

    code = main(["verify", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_whole_checkpoint_verifies(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert manifest.verify_checkpoint(folder) == []
    names = set(manifest._read(folder)["files"])  # type: ignore[index]
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    code, out, _ = _cli(folder, capsys)
    assert code == 0 and "whole" in out


def _shard(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


def test_truncated_altered_and_missing_files_are_named(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = _shard(folder)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert manifest.verify_checkpoint(folder) == [
        f"{shard.name} has {len(data) // 2} bytes, {len(data)} were written"
    ]
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert manifest.verify_checkpoint(folder) == [
        f"{shard.name} has changed since it was written (its checksum differs)"
    ]
    assert manifest.verify_checkpoint(folder, checksums=False) == []  # the size alone cannot tell
    (folder / ".metadata").unlink()
    problems = manifest.verify_checkpoint(folder)
    assert ".metadata is missing" in problems
    code, _, err = _cli(folder, capsys)
    assert code == 1 and ".metadata is missing" in err
    with pytest.raises(manifest.CheckpointDamagedError, match=str(folder)):
        manifest.check(folder)


def test_a_folder_without_its_manifest_is_incomplete(folder: Path) -> None:
    (folder / manifest.MANIFEST).unlink()
    (problem,) = manifest.verify_checkpoint(folder)
    assert "has no dmuon-manifest.json: the save did not finish" in problem
    assert manifest.verify_checkpoint(folder / "nothing") == [
        f"{folder / 'nothing'} is not a folder"
    ]
