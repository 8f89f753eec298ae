"""The recipe on Hugging Face models, tokenizers and data formats, in one process.

Oracles: ``tokenizers`` encoding each document alone (the token stream of every format),
``transformers`` itself (the exported directory loads, its logits equal the trained
weights' in a model built independently from the config; a model directory's weights
give the step-0 validation loss the HF model computes), an eager float32 run (activation
checkpointing bit-identical; bfloat16 and compile within stated tolerances), the
``6 N + 12 L d T`` formula (mfu), ``os.stat`` (cache modes) and the documented messages of
every bad input, with nothing written into the checkpoint or export folders.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import hf_models as h
import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dmuon.checkpoint.__main__ import main as checkpoint_main
from dmuon.train import run
from dmuon.train.__main__ import main
from dmuon.train.data import load_corpus, load_tokenizer, validation_windows

transformers = pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

COMMON = [
    "--steps", "3", "--seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1",
    "--eval-every", "0", "--progress", "plain", "--ns-dtype", "float32", "--threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tokenizer, a model directory per architecture and one corpus per format."""
    root = tmp_path_factory.mktemp("hf")
    docs = h.documents(160)
    tokenizer = h.train_tokenizer(docs)
    tokenizer.save_pretrained(root / "tokenizer")
    models = {arch: h.model_dir(root / arch, arch, tokenizer=tokenizer) for arch in h.ARCHS}
    stream = h.expected_tokens(tokenizer, docs)
    data = {
        "text": h.write_text_folder(root / "text", docs),
        "jsonl": h.write_jsonl(root / "data.jsonl", docs),
        "parquet": h.write_parquet(root / "data.parquet", docs),
        "bin": h.write_bin(root / "tokens.bin", stream, len(tokenizer)),
    }
    return {"root": root, "docs": docs, "tokenizer": tokenizer, "models": models,
            "data": data, "cache": root / "cache"}  # fmt: skip


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----- data formats ----------------------------------------------------------------------
def test_every_format_is_the_tokenizers_stream_cached_privately(world: dict[str, Any]) -> None:
    tok, docs, cache = world["tokenizer"], world["docs"], world["cache"] / "formats"
    hf = load_tokenizer(world["root"] / "tokenizer", None)
    assert hf.vocab_size == len(tok) and hf.separator == tok.eos_token_id
    whole = h.expected_tokens(tok, docs)
    for name in ("jsonl", "parquet", "bin"):
        corpus = load_corpus(world["data"][name], tokenizer=hf, cache_dir=cache, val_fraction=0.1)
        n_val = round(len(whole) * 0.1)
        assert corpus.train.tolist() == whole[: len(whole) - n_val], name
        assert corpus.val.tolist() == whole[len(whole) - n_val :], name
        assert (corpus.train_files, corpus.val_files) == (1, 0)
    # A folder is split by file: each split is its own documents joined with EOS.
    from dmuon.train.data import split_files

    folder = load_corpus(world["data"]["text"], tokenizer=hf, cache_dir=cache, val_fraction=0.1)
    by_name = {f"doc{i:03d}.txt": d for i, d in enumerate(docs)}
    train_rel, val_rel = split_files(by_name, 0.1)
    assert folder.train.tolist() == h.expected_tokens(tok, [by_name[r] for r in train_rel])
    assert folder.val.tolist() == h.expected_tokens(tok, [by_name[r] for r in val_rel])
    # A .json array reads like JSON lines; a second load is a cache hit.
    array = world["root"] / "array.json"
    array.write_text(json.dumps([{"text": d} for d in docs[:50]]))
    first = load_corpus(array, tokenizer=hf, cache_dir=cache)
    again = load_corpus(array, tokenizer=hf, cache_dir=cache)
    assert not first.from_cache and again.from_cache
    assert first.train.tolist() + first.val.tolist() == h.expected_tokens(tok, docs[:50])
    # The cache is private: the folder 0700, every file 0600, whatever the umask.
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    files = list(cache.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [
        (f.name, oct(f.stat().st_mode)) for f in files
    ]
    # Another tokenizer is another cache; a loose existing cache folder is tightened.
    loose = world["root"] / "loose-cache"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    raw = load_corpus(world["data"]["jsonl"], cache_dir=loose)
    assert raw.cache_path != first.cache_path and raw.vocab_size == 256
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_token_files_are_memory_mapped_in_place(world: dict[str, Any], tmp_path: Path) -> None:
    tokens = list(range(300)) * 5
    folder = tmp_path / "shards"
    for i in range(4):
        h.write_bin(folder / f"shard{i}.bin", tokens[i * 375 : (i + 1) * 375], 320)
    corpus = load_corpus(folder, cache_dir=tmp_path / "cache")
    assert corpus.cache_path is None and not (tmp_path / "cache").exists()
    assert isinstance(corpus.train.parts[0], np.memmap)
    assert (corpus.train_files, corpus.val_files) == (3, 1)
    assert sorted(corpus.train.tolist() + corpus.val.tolist()) == sorted(tokens)
    # A window that crosses from one shard into the next reads both.
    assert corpus.train.read(370, 380).tolist() == corpus.train.tolist()[370:380]


# ----- bad inputs ------------------------------------------------------------------------
def _bad_inputs(world: dict[str, Any], tmp: Path) -> list[tuple[str, list[str], str]]:
    root, models, data = world["root"], world["models"], world["data"]
    (tmp / "plain").mkdir()
    vit = tmp / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    remote = tmp / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps({"model_type": "my-model", "auto_map": {"AutoModelForCausalLM": "x.Y"}})
    )
    short = h.model_dir(tmp / "short", "llama", positions=16, tokenizer=world["tokenizer"])
    small = h.model_dir(tmp / "small-vocab", "llama", vocab=256, tokenizer=world["tokenizer"])
    bare = h.model_dir(tmp / "bare", "llama")
    (tmp / "empty.jsonl").write_text("")
    h.write_jsonl(tmp / "few.jsonl", ["one short line."])
    folder = tmp / "linked"
    h.write_text_folder(folder, world["docs"][:5])
    outside = tmp / "secret.txt"
    outside.write_text("not for training")
    (folder / "escape.txt").symlink_to(outside)
    (tmp / "nosidecar.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    h.write_bin(tmp / "big-vocab.bin", list(range(100)), vocab_size=50_000)
    full = tmp / "full-export"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    llama, jsonl = str(models["llama"]), str(data["jsonl"])
    return [
        ("not a model directory", ["--model", str(tmp / "plain"), "--data", jsonl],
         "is not a Hugging Face model directory: it has no config.json"),
        ("not a causal LM", ["--model", str(vit), "--data", jsonl],
         "model_type 'vit' in its config.json is not a causal language model"),
        ("remote code", ["--model", str(remote), "--data", jsonl],
         "It asks for code of its own (auto_map), which the recipe never runs"),
        ("seq-len above the positions", ["--model", str(short), "--data", jsonl],
         "--seq-len 32 is longer than the 16 positions of --model"),
        ("tokenizer too large", ["--model", str(small), "--data", jsonl],
         "has a vocabulary of 320 tokens, but --model"),
        ("no tokenizer", ["--model", str(bare), "--data", jsonl],
         "has no tokenizer (no tokenizer.json nor tokenizer_config.json); pass --tokenizer"),
        ("jsonl without the field", ["--model", llama, "--data", jsonl, "--text-field", "body"],
         "line 1 of " + jsonl + " has no string field 'body' (its fields: id, text)"),
        ("parquet without the column",
         ["--model", llama, "--data", str(data["parquet"]), "--text-field", "body"],
         "has no column 'body' (its columns: id, text)"),
        ("empty corpus", ["--model", llama, "--data", str(tmp / "empty.jsonl")],
         "is an empty file"),
        ("too small a corpus", ["--model", llama, "--data", str(tmp / "few.jsonl")],
         "the training split has 10 tokens, fewer than --seq-len + 1 = 33"),
        ("link out of the folder", ["--model", llama, "--data", str(folder)],
         "escape.txt is a symbolic link to " + str(outside) + ", outside the data folder"),
        ("bin without sidecar", ["--model", llama, "--data", str(tmp / "nosidecar.bin")],
         "token file " + str(tmp / "nosidecar.bin") + " has no sidecar nosidecar.bin.json"),
        ("bin vocabulary too large", ["--model", llama, "--data", str(tmp / "big-vocab.bin")],
         "has a vocabulary of 50000 tokens, but --model"),
        ("export folder in use", ["--model", llama, "--data", jsonl, "--export-hf", str(full)],
         "is not empty and holds no earlier export"),
        ("tokenizer path missing", ["--model", llama, "--data", jsonl, "--tokenizer",
                                    str(root / "nope")], "does not exist"),
    ]  # fmt: skip


def test_every_bad_input_is_refused_before_anything_is_written(
    world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failures = []
    for i, (case, argv, message) in enumerate(_bad_inputs(world, tmp_path)):
        ckpt, export = tmp_path / f"ckpt{i}", tmp_path / f"export{i}"
        extra = ["--checkpoint-dir", str(ckpt), "--cache-dir", str(tmp_path / f"cache{i}")]
        if "--export-hf" not in argv:
            extra += ["--export-hf", str(export)]
        code = main([*COMMON, *argv, *extra])
        err = capsys.readouterr().err
        if code != 2 or message not in err:
            failures.append(f"{case}: exit {code}, stderr {err[-600:]!r}")
        if ckpt.exists() or export.exists():
            failures.append(f"{case}: wrote {ckpt if ckpt.exists() else export}")
    assert (tmp_path / "full-export" / "notes.txt").read_text() == "keep me"
    assert not failures, "\n".join(failures)


# ----- precision, memory and compile -----------------------------------------------------
def _losses(world: dict[str, Any], tmp: Path, name: str, *extra: str) -> list[dict[str, Any]]:
    metrics = tmp / f"{name}.jsonl"
    run([*COMMON, "--model", str(world["models"]["llama"]), "--data", str(world["data"]["jsonl"]),
         "--cache-dir", str(world["cache"]), "--metrics-file", str(metrics), "--steps", "4",
         *extra])  # fmt: skip
    return [m for m in _metrics(metrics) if m["step"] >= 1]


def test_checkpointing_bfloat16_compile_against_float32_eager(
    world: dict[str, Any], tmp_path: Path
) -> None:
    eager = _losses(world, tmp_path, "eager", "--peak-tflops", "1")
    checkpointed = _losses(world, tmp_path, "ac", "--activation-checkpointing")
    bf16 = _losses(world, tmp_path, "bf16", "--param-dtype", "bfloat16")
    compiled = _losses(world, tmp_path, "compiled", "--compile")
    base = [m["loss"] for m in eager]
    # Recomputation repeats the same float32 operations: bit-identical.
    assert [m["loss"] for m in checkpointed] == base
    assert [m["grad_norm"] for m in checkpointed] == [m["grad_norm"] for m in eager]
    # bfloat16 compute (autocast in one process): within 2e-2 of the float32 loss.
    assert max(abs(a - b) for a, b in zip(base, [m["loss"] for m in bf16], strict=True)) < 2e-2
    # Inductor reorders float32 reductions: within 1e-4.
    assert max(abs(a - b) for a, b in zip(base, [m["loss"] for m in compiled], strict=True)) < 1e-4
    for m in eager:
        assert len(m["peak_memory_bytes"]) == 1 and m["peak_memory_bytes"][0] > 50 << 20
        # mfu = (6 N + 12 L d T) x tokens/s / peak, N counted here from the config:
        # q, o (32x32), k, v (16x32: 2 KV heads of 8), MLP 3 x 32x64, per layer; the head.
        n = 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64) + h.MODEL_VOCAB * 32
        flops = 6 * n + 12 * 2 * 32 * 32
        assert m["mfu"] == pytest.approx(flops * m["tokens_per_s"] / 1e12, rel=1e-9)
    assert all("mfu" not in m for m in checkpointed)  # no peak known on a CPU


# ----- export ----------------------------------------------------------------------------
def _oracle_logits(model: str, checkpoint: Path, tmp: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint's weights in a model built from scratch: the preset class,
    or the architecture transformers builds from the model directory's config."""
    dcp_to_torch_save(checkpoint, tmp / "consolidated.pt")
    weights = torch.load(tmp / "consolidated.pt", weights_only=False)["model"]
    if model in ("tiny", "moe"):
        from dmuon.train import build_model

        net = build_model(model, max_seq_len=tokens.shape[1])
        net.load_state_dict(weights)
        with torch.no_grad():
            return net(tokens)
    config = transformers.AutoConfig.from_pretrained(model)
    net = transformers.AutoModelForCausalLM.from_config(config)
    missing, unexpected = net.load_state_dict(weights, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    net.tie_weights()
    with torch.no_grad():
        return net(input_ids=tokens).logits


@pytest.mark.parametrize("model", ["tiny", "moe", *h.ARCHS])
def test_export_loads_with_transformers_and_its_logits_match(
    world: dict[str, Any], tmp_path: Path, model: str
) -> None:
    name = world["models"].get(model, model)
    data = world["data"]["jsonl"] if model in world["models"] else world["data"]["text"]
    export, ckpt = tmp_path / "export", tmp_path / "ckpt"
    run([*COMMON, "--model", str(name), "--data", str(data), "--cache-dir", str(world["cache"]),
         "--checkpoint-dir", str(ckpt), "--export-hf", str(export), "--steps", "2"])  # fmt: skip
    again = tmp_path / "again"  # python -m dmuon.checkpoint export-hf, in this process
    assert checkpoint_main(["export-hf", str(ckpt / "step_00000002"), str(again)]) == 0
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _oracle_logits(str(name), ckpt / "step_00000002", tmp_path, tokens)
    for folder in (export, again):
        files = {p.name for p in folder.iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors"} <= files
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert all(p.numel() > 0 for p in loaded.parameters())
        with torch.no_grad():
            got = loaded(input_ids=tokens).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        if model in ("tiny", "moe"):  # the byte-level tokenizer: id = byte
            assert tokenizer("héllo")["input_ids"] == list("héllo".encode())
        else:
            assert len(tokenizer) == len(world["tokenizer"])
    if model in ("tiny", "moe"):
        expected = "LlamaForCausalLM" if model == "tiny" else "MixtralForCausalLM"
        assert json.loads((export / "config.json").read_text())["architectures"] == [expected]


def test_a_model_directory_with_weights_starts_from_them(
    world: dict[str, Any], tmp_path: Path
) -> None:
    tok = world["tokenizer"]
    weighted = h.model_dir(tmp_path / "weighted", "qwen2", weights_seed=11, tokenizer=tok)
    data = world["data"]["jsonl"]
    args = [*COMMON, "--data", str(data), "--cache-dir", str(world["cache"]), "--steps", "1",
            "--eval-every", "1", "--eval-sequences", "6"]  # fmt: skip

    def start_loss(model: Path, seed: int) -> float:
        metrics = tmp_path / f"{model.name}-{seed}.jsonl"
        metrics.unlink(missing_ok=True)
        run([*args, "--model", str(model), "--seed", str(seed), "--metrics-file", str(metrics)])
        return _metrics(metrics)[0]["val_loss"]

    # Oracle: the saved model itself on the recipe's validation windows.
    corpus = load_corpus(data, tokenizer=load_tokenizer(None, weighted), cache_dir=world["cache"])
    windows = validation_windows(corpus.val, seq_len=32, num_sequences=6)
    saved = transformers.AutoModelForCausalLM.from_pretrained(weighted)
    with torch.no_grad():
        logits = saved(input_ids=windows[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert start_loss(weighted, 0) == pytest.approx(want.item(), abs=1e-5)
    assert start_loss(weighted, 5) == pytest.approx(want.item(), abs=1e-5)  # seed unused
    config_only = world["models"]["qwen2"]
    assert start_loss(config_only, 3) == start_loss(config_only, 3)  # deterministic init
    assert start_loss(config_only, 3) != start_loss(config_only, 4)


def test_export_cli_errors_name_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert checkpoint_main(["export-hf", str(tmp_path / "missing"), str(out)]) == 2
    assert "has no config.json to export with; pass --config MODEL_DIR" in capsys.readouterr().err
    model = h.model_dir(tmp_path / "model", "llama")
    assert checkpoint_main(["export-hf", str(tmp_path), str(out), "--config", str(model)]) == 2
    assert "is not a DCP checkpoint (no .metadata file)" in capsys.readouterr().err
    assert not out.exists()
