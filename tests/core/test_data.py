"""The recipe's corpus (split by file, cache, --data) and the global-batch sampler."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dmuon.train import GlobalBatchSampler, load_corpus, validation_windows
from dmuon.train.data import list_source_files, split_files, stdlib_root


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared by the recipe test modules of this session: the stdlib corpus is built once.
    path = tmp_path_factory.getbasetemp() / "dmuon-train-corpus-cache"
    path.mkdir(exist_ok=True)
    return path


def _write_tree(root: Path) -> dict[str, bytes]:
    files = {f"doc{i:02d}.txt": f"text number {i}\n".encode() * (i + 3) for i in range(20)}
    files["sub/nested.md"] = b"# nested heading\nbody\n"
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / ".hidden").write_bytes(b"secret")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (root / "blob.dat").write_bytes(b"\x00\x01\x02binary")
    (root / "empty.txt").write_bytes(b"")
    return files


def test_default_corpus_is_the_stdlib_split_by_file(stdlib_cache: Path) -> None:
    root, files = list_source_files(None)
    assert root == stdlib_root()
    rel = [f.relative for f in files]
    assert "os.py" in rel and "json/__init__.py" in rel
    assert not any("site-packages" in r for r in rel)
    # The documented definition, walked the slow way (every folder, filtered after).
    every = [
        f.relative_to(root).as_posix()
        for f in root.rglob("*.py")
        if f.is_file()
        and f.stat().st_size > 0
        and not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)
    ]
    assert rel == sorted(every)
    train, val = split_files(rel, 0.05)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(rel)
    assert len(val) == -(-len(rel) * 5 // 100)  # ceil(5%)
    # Deterministic: listing order does not matter.
    shuffled = rel[:]
    random.Random(0).shuffle(shuffled)
    assert split_files(shuffled, 0.05) == (train, val)

    corpus = load_corpus(cache_dir=stdlib_cache)
    assert (corpus.train_files, corpus.val_files) == (len(train), len(val))
    # Validation bytes are exactly the validation files joined by newlines.
    expected_val = b"\n".join((root / r).read_bytes() for r in val)
    assert bytes(corpus.val.tolist()) == expected_val
    assert corpus.train.dtype == np.uint8 and corpus.train.numel() > 1_000_000


def test_cache_hit_on_second_load(tmp_path: Path) -> None:
    _write_tree(tmp_path / "data")
    first = load_corpus(tmp_path / "data", cache_dir=tmp_path / "cache")
    second = load_corpus(tmp_path / "data", cache_dir=tmp_path / "cache")
    assert not first.from_cache and second.from_cache
    assert first.cache_path == second.cache_path and first.cache_path.is_file()
    assert first.train.tolist() == second.train.tolist()
    assert first.val.tolist() == second.val.tolist()
    # Editing a source file invalidates the cache.
    target = tmp_path / "data" / "doc00.txt"
    target.write_bytes(b"changed\n")
    os.utime(target, ns=(1, 1))
    third = load_corpus(tmp_path / "data", cache_dir=tmp_path / "cache")
    assert not third.from_cache and third.cache_path != first.cache_path


def test_data_folder_reads_text_files_only(tmp_path: Path) -> None:
    files = _write_tree(tmp_path / "data")
    corpus = load_corpus(tmp_path / "data", cache_dir=tmp_path / "cache", val_fraction=0.2)
    train_rel, val_rel = split_files(files, 0.2)
    assert (corpus.train_files, corpus.val_files) == (len(train_rel), len(val_rel)) == (16, 5)
    joined = b"\n".join
    assert bytes(corpus.train.tolist()) == joined(files[r] for r in train_rel)
    assert bytes(corpus.val.tolist()) == joined(files[r] for r in val_rel)


def test_a_run_lists_its_data_once_and_plans_as_a_fresh_listing_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`preflight` hands its listing to `plan_corpus`: one walk of the data per run, and
    the same plan (splits, cache file) as planning from scratch."""
    import dmuon.train.data.corpus as corpus_module
    import dmuon.train.preflight as preflight_module
    from dmuon.train.cli import parse_args
    from dmuon.train.data import plan_corpus

    files = _write_tree(tmp_path / "data")
    config = parse_args(["--data", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "c")])
    walks: list[object] = []

    def counted(path: object = None) -> tuple[Path, list]:
        walks.append(path)
        return list_source_files(path)

    monkeypatch.setattr(preflight_module, "list_source_files", counted)
    monkeypatch.setattr(corpus_module, "list_source_files", counted)
    planned = preflight_module.preflight(config).corpus
    assert walks == [config.data]
    monkeypatch.undo()
    fresh = plan_corpus(config.data, cache_dir=tmp_path / "c", tokenizer=planned.tokenizer)
    assert (planned.train, planned.val, planned.cache_bin) == (
        fresh.train,
        fresh.val,
        fresh.cache_bin,
    )
    assert len(planned.train) + len(planned.val) == len(files) and planned.val


def test_data_single_file_is_split_by_tokens(tmp_path: Path) -> None:
    text = bytes(range(32, 127)) * 40  # 3800 bytes
    (tmp_path / "book.txt").write_bytes(text)
    corpus = load_corpus(tmp_path / "book.txt", cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert (corpus.train_files, corpus.val_files) == (1, 0)
    assert bytes(corpus.train.tolist()) == text[:3420]
    assert bytes(corpus.val.tolist()) == text[3420:]


def test_missing_or_empty_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--data .*nope.* does not exist"):
        load_corpus(tmp_path / "nope", cache_dir=tmp_path / "cache")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        load_corpus(tmp_path / "empty.txt", cache_dir=tmp_path / "cache")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.dat").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="without any non-empty file to read"):
        load_corpus(tmp_path / "folder", cache_dir=tmp_path / "cache")


def test_links_may_lead_into_the_job_services_data_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dmuon_recipe_contract as contract

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    outside.mkdir()
    (root / "a" / "own.txt").write_text("own text\n")
    (root / "b" / "shared.txt").write_text("shared text\n")
    (outside / "secret.txt").write_text("secret\n")
    (root / "a" / "shared.txt").symlink_to(root / "b" / "shared.txt")
    # Alone, the recipe reads only the folder itself.
    with pytest.raises(ValueError, match=r"shared\.txt is a symbolic link to .*outside the data"):
        list_source_files(root / "a")
    monkeypatch.setenv(contract.DATA_ROOTS_ENV, os.pathsep.join([str(root), str(tmp_path / "x")]))
    _, files = list_source_files(root / "a")
    assert sorted(f.relative for f in files) == ["own.txt", "shared.txt"]
    # A root is not a way out: a link beyond every root is refused as before.
    (root / "a" / "leak.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(ValueError, match=r"leak\.txt is a symbolic link to"):
        list_source_files(root / "a")


def _tokens(n: int = 5000) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )


def test_sampler_windows_are_contiguous_text() -> None:
    tokens = _tokens()
    sampler = GlobalBatchSampler(tokens, seq_len=16, micro_batch_size=3, accum_steps=2, seed=1)
    starts = sampler.global_starts(4)
    batch = sampler.global_batch(4)
    assert batch.shape == (6, 17) and batch.dtype == torch.long
    for start, row in zip(starts.tolist(), batch, strict=True):
        assert torch.equal(row, tokens[start : start + 17].long())


def test_sampler_depends_on_seed_and_step_only() -> None:
    tokens = _tokens()
    a = GlobalBatchSampler(tokens, seq_len=16, micro_batch_size=4, accum_steps=2, seed=7)
    b = GlobalBatchSampler(tokens, seq_len=16, micro_batch_size=4, accum_steps=2, seed=7)
    assert torch.equal(a.global_batch(3), b.global_batch(3))
    assert not torch.equal(a.global_batch(3), a.global_batch(4))
    c = GlobalBatchSampler(tokens, seq_len=16, micro_batch_size=4, accum_steps=2, seed=8)
    assert not torch.equal(a.global_batch(3), c.global_batch(3))


@pytest.mark.parametrize(
    ("split_a", "split_b"),
    [
        ((2, 3, 2), (1, 6, 2)),  # 2 ranks x micro-batch 3 == 1 rank x micro-batch 6
        ((2, 3, 2), (1, 3, 4)),  # 2 ranks x accumulation 2 == 1 rank x accumulation 4
        ((1, 2, 4), (1, 8, 1)),  # accumulation 4 x micro-batch 2 == accumulation 1 x 8
    ],
)
def test_same_global_batch_same_sequences(split_a: tuple, split_b: tuple) -> None:
    """(world, micro-batch, accum) splits of one global batch see the same sequences."""
    tokens = _tokens()

    def all_sequences(world: int, micro: int, accum: int) -> torch.Tensor:
        sampler = GlobalBatchSampler(
            tokens, seq_len=8, micro_batch_size=micro, accum_steps=accum, world_size=world
        )
        parts = [sampler.rank_batch(5, r) for r in range(world)]
        assert all(p.shape == (accum, micro, 9) for p in parts)
        return torch.cat([p.reshape(-1, 9) for p in parts])

    torch.testing.assert_close(all_sequences(*split_a), all_sequences(*split_b), rtol=0, atol=0)


def test_validation_windows_split_across_ranks() -> None:
    tokens = _tokens(1000)
    whole = validation_windows(tokens, seq_len=10, num_sequences=6)
    parts = [
        validation_windows(tokens, seq_len=10, num_sequences=6, world_size=2, rank=r)
        for r in range(2)
    ]
    assert torch.equal(torch.cat(parts), whole)
    assert whole[0, 0] == tokens[0] and whole[-1, -1] == tokens[-1]
    with pytest.raises(ValueError, match="--seq-len"):
        validation_windows(tokens[:5], seq_len=10, num_sequences=2)
