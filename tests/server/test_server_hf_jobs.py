"""The job service with Hugging Face model directories, tokenizers, data formats and exports.

Oracles: transformers itself (the parameter count admission computes from ``config.json``
against the model it builds; the vocabulary read from ``tokenizer.json`` against
``len(tokenizer)``), the recipe's contract (defaults recorded in the job, flag spellings,
the recipe's own messages for bad inputs), the files on disk (artifacts and their bytes),
and a real server running the real recipe under torchrun.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import pytest
from fastapi.testclient import TestClient
from server_helpers import LiveServer, iter_sse, job_processes, job_spec, make_settings

from dmuon_server.app import create_app
from dmuon_server.recipe.hf_models import read_model_dir, tokenizer_vocab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
import hf_models as h

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("models")
    docs = h.documents(60)
    tokenizer = h.train_tokenizer(docs)
    dirs = {a: h.model_dir(root / a, a, tokenizer=tokenizer) for a in h.ARCHS}
    dirs["bare"] = h.model_dir(root / "bare", "llama")
    dirs["short"] = h.model_dir(root / "short", "llama", positions=16, tokenizer=tokenizer)
    dirs["small-vocab"] = h.model_dir(root / "small-vocab", "qwen2", vocab=256, tokenizer=tokenizer)
    return {"root": root, "dirs": dirs, "tokenizer": tokenizer, "docs": docs}


@pytest.fixture
def hf_client(tmp_path: Path, data_dir: Path, fake_env: None, models: dict[str, Any]) -> TestClient:
    (tmp_path / "datasets").mkdir()
    settings = make_settings(tmp_path, data_dir=data_dir, model_roots=(models["root"],))
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _hf(arch: str, **train: Any) -> dict[str, Any]:
    body = job_spec(**train)
    body["train"]["model"] = {"path": arch}
    return body


def test_parameter_counts_and_vocabularies_match_transformers(models: dict[str, Any]) -> None:
    import torch

    extra = {
        "mistral": transformers.MistralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, eos_token_id=0, bos_token_id=0,
        ),
        "qwen3": transformers.Qwen3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, head_dim=16,
        ),
        "llama-tied-biased": transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            vocab_size=100, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
            bos_token_id=0, eos_token_id=0,
        ),
    }  # fmt: skip
    dirs = dict(models["dirs"])
    for name, config in extra.items():
        config.save_pretrained(models["root"] / name)
        dirs[name] = models["root"] / name
    for name, path in dirs.items():
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        info = read_model_dir(path, name)
        assert info.exact and info.num_params == sum(p.numel() for p in model.parameters()), name
    assert tokenizer_vocab(dirs["llama"]) == len(models["tokenizer"]) == h.TOKENIZER_VOCAB
    assert tokenizer_vocab(dirs["bare"]) is None


def test_validate_shows_the_model_tokenizer_and_estimate(
    hf_client: TestClient, models: dict[str, Any]
) -> None:
    body = _hf("mixtral", export_hf=True, activation_checkpointing=True, compile=True,
               param_dtype="bfloat16", text_field="body")  # fmt: skip
    for key in ("lr", "adamw_lr", "optimizer", "mode", "seed"):
        del body["train"][key]
    plan = hf_client.post("/v1/jobs:validate", json=body)
    assert plan.status_code == 200, plan.text
    plan = plan.json()
    adm = plan["admission"]
    assert adm["model"] == "<model-root>/mixtral" and adm["model_type"] == "mixtral"
    assert adm["model_params"] == read_model_dir(models["dirs"]["mixtral"], "x").num_params
    assert adm["tokenizer_vocab"] == h.TOKENIZER_VOCAB and adm["max_seq_len"] == h.MAX_POSITIONS
    assert adm["memory"]["parameters_bytes"] == 16 * adm["model_params"]
    argv = plan["torchrun_argv"]
    flag = {f.dest: f.option for f in contract.FLAGS}

    def value(dest: str) -> str:
        return argv[argv.index(flag[dest]) + 1]

    assert value("model") == "<model-root>/mixtral"
    assert value("export_hf") == "<job-dir>/export"
    assert value("param_dtype") == "bfloat16" and value("text_field") == "body"
    assert flag["activation_checkpointing"] in argv and flag["compile"] in argv
    # The recipe's defaults, written out (the job record shows the same values).
    assert value("lr") == repr(contract.flag("lr").default)
    assert value("adamw_lr") == repr(contract.ADAMW_LR)  # the same under both optimizers
    assert (value("optimizer"), value("mode")) == ("dmuon", "z3") and value("seed") == "0"
    job = hf_client.post("/v1/jobs", json=body).json()
    assert {k: job["train"][k] for k in ("lr", "adamw_lr", "optimizer", "mode", "seed")} == {
        "lr": contract.flag("lr").default, "adamw_lr": contract.ADAMW_LR,
        "optimizer": "dmuon", "mode": "z3", "seed": 0,
    }  # fmt: skip
    assert job["train"]["model"] == {"path": "mixtral"}
    hf_client.post(f"/v1/jobs/{job['id']}/cancel")
    baseline = job_spec(optimizer="adamw")
    del baseline["train"]["adamw_lr"]
    job = hf_client.post("/v1/jobs", json=baseline).json()
    assert job["train"]["adamw_lr"] == contract.ADAMW_LR
    hf_client.post(f"/v1/jobs/{job['id']}/cancel")


def _refusal(client: TestClient, body: dict[str, Any]) -> tuple[str, str]:
    r = client.post("/v1/jobs:validate", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["errors"][0]
    return error["field"], error["message"]


def test_bad_model_tokenizer_and_data_get_the_recipes_messages(
    hf_client: TestClient, models: dict[str, Any], tmp_path: Path
) -> None:
    data = tmp_path / "datasets"
    (data / "nosidecar.bin").write_bytes(b"\0\1" * 100)
    (data / "linked").mkdir()
    (data / "linked" / "a.txt").write_text("text " * 100)
    (tmp_path / "secret.txt").write_text("secret " * 100)
    (data / "linked" / "escape.txt").symlink_to(tmp_path / "secret.txt")
    h.write_bin(data / "wide.bin", list(range(200)), vocab_size=50_000)
    outside = tmp_path / "elsewhere"
    h.model_dir(outside, "llama")
    (models["root"] / "escape").symlink_to(outside, target_is_directory=True)
    (models["root"] / "empty").mkdir()
    root = "<model-root>"
    cases = [
        (_hf("empty"), "body.train.model.path",
         contract.not_model_directory_message(f"{root}/empty")),
        (_hf("short"), "body.train.seq_len", contract.positions_message(32, 16, f"{root}/short")),
        (_hf("bare"), "body.train.tokenizer", contract.no_tokenizer_message(f"{root}/bare")),
        (_hf("small-vocab"), "body.train.tokenizer", contract.vocab_message(
            h.TOKENIZER_VOCAB, 256, f"the tokenizer {root}/small-vocab", f"{root}/small-vocab")),
        (_hf("escape"), "body.train.model.path", "lies outside the model roots (<model-root>)"),
        (_hf("../elsewhere"), "body.train.model.path", "lies outside the model roots"),
        (_hf("llama", tokenizer="/etc"), "body.train.tokenizer", "lies outside the model roots"),
        (_hf("llama", data="nosidecar.bin"), "body.train.data",
         contract.sidecar_message("<data-root>/nosidecar.bin")),
        (_hf("llama", data="linked"), "body.train.data",
         "links that lead outside the data roots ('escape.txt')"),
        (_hf("llama", data="wide.bin"), "body.train.data", "has a vocabulary of 50000 tokens"),
        (job_spec(model={"path": "llama", "extra": 1}), "body.train.model", "must be a preset"),
    ]  # fmt: skip
    for body, field, message in cases:
        got_field, got = _refusal(hf_client, body)
        assert (got_field, message in got) == (field, True), (field, message, got_field, got)


def test_a_server_without_model_roots_takes_presets_only(client: TestClient) -> None:
    field, message = _refusal(client, _hf("llama"))
    assert field == "body.train.model.path" and "started without --model-root" in message
    as_string = job_spec(model="llama")  # the path spelled as a string: the same refusal
    assert _refusal(client, as_string) == (field, message)


def test_artifacts_are_listed_and_served_without_leaving_the_job_folder(
    client: TestClient, data_dir: Path, tmp_path: Path
) -> None:
    job = client.post("/v1/jobs", json=job_spec(steps=2)).json()
    job_dir = data_dir / "jobs" / job["id"]
    files = {
        "export/config.json": b'{"model_type": "llama"}',
        "export/model.safetensors": b"\0" * 2048,
        "checkpoints/step_00000002/.metadata": b"m",
        "checkpoints/step_00000002/__0_0.distcp": b"x" * 10,
        "torchrun-logs/rank0.log": b"log",
        "metrics.attempt-2.jsonl": b'{"step": 1}\n',
    }
    from server_helpers import finish_all_jobs

    finish_all_jobs(client)
    for rel, data in files.items():
        (job_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (job_dir / rel).write_bytes(data)
    (job_dir / "checkpoints" / ".tmp_step_00000004").mkdir()
    (job_dir / "checkpoints" / ".tmp_step_00000004" / "half").write_bytes(b"h")
    (tmp_path / "secret").write_text("s")
    (job_dir / "export" / "leak").symlink_to(tmp_path / "secret")
    listed = client.get(f"/v1/jobs/{job['id']}/artifacts").json()["items"]
    by_path = {a["path"]: a for a in listed}
    for rel, data in files.items():
        assert by_path[rel]["bytes"] == len(data)
    assert by_path["export/config.json"]["kind"] == "export"
    assert by_path["checkpoints/step_00000002/.metadata"]["kind"] == "checkpoint"
    assert by_path["torchrun-logs/rank0.log"]["kind"] == "log"
    assert (
        by_path["job.log"]["kind"] == "log"
        and by_path["metrics.attempt-2.jsonl"]["kind"] == "metrics"
    )
    assert not any(p.startswith(("spec.json", "exit.json")) for p in by_path)
    assert not any(".tmp_" in p or p.endswith("leak") for p in by_path)
    got = client.get(f"/v1/jobs/{job['id']}/artifacts/export/model.safetensors")
    assert got.status_code == 200 and got.content == files["export/model.safetensors"]
    for bad in ("spec.json", "export/leak", "checkpoints/.tmp_step_00000004/half",
                "export/../spec.json", "export/%2e%2e/spec.json", "..%2F..%2Fetc%2Fpasswd",
                "export/missing.json"):  # fmt: skip
        r = client.get(f"/v1/jobs/{job['id']}/artifacts/{bad}")
        assert r.status_code == 404, (bad, r.status_code)
    assert client.get("/v1/jobs/nope/artifacts").status_code == 404


def test_listings_page_and_folders_download_as_one_tar(
    client: TestClient, data_dir: Path, tmp_path: Path
) -> None:
    """Oracles: the files written (bytes, names) and the one-page listing; the archive is
    read back with Python's tarfile."""
    import io
    import tarfile

    from server_helpers import finish_all_jobs

    job = client.post("/v1/jobs", json=job_spec(steps=2)).json()
    finish_all_jobs(client)
    job_dir = data_dir / "jobs" / job["id"]
    written = {
        f"checkpoints/step_{i:08d}/__0_0.distcp": bytes([i]) * (700 + i) for i in range(1, 40)
    }
    written["export/config.json"] = b'{"model_type": "llama"}'
    written["export/sub/weights.bin"] = b"\1" * 3000
    for rel, data in written.items():
        (job_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (job_dir / rel).write_bytes(data)
    (tmp_path / "secret").write_text("s")
    (job_dir / "export" / "leak").symlink_to(tmp_path / "secret")
    everything = client.get(f"/v1/jobs/{job['id']}/artifacts", params={"limit": 10000}).json()
    assert everything["next"] is None
    paged, after = [], None
    while True:
        params = {"limit": 7, **({"after": after} if after else {})}
        page = client.get(f"/v1/jobs/{job['id']}/artifacts", params=params).json()
        assert len(page["items"]) <= 7
        paged += page["items"]
        after = page["next"]
        if after is None:
            break
    assert paged == everything["items"]  # every file once, in the same order
    only = client.get(f"/v1/jobs/{job['id']}/artifacts", params={"under": "export"}).json()
    assert [a["path"] for a in only["items"]] == ["export/config.json", "export/sub/weights.bin"]
    paths = [a["path"] for a in paged]
    assert paths == sorted(paths, key=lambda p: p.split("/")) and set(written) <= set(paths)
    folders = {
        "export": ["export/config.json", "export/sub/weights.bin"],
        "checkpoints/step_00000007": ["step_00000007/__0_0.distcp"],
    }
    for folder, names in folders.items():
        r = client.get(f"/v1/jobs/{job['id']}/archive/{folder}")
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            assert tar.getnames() == names  # no link, nothing outside the folder
            for member in tar.getmembers():
                source = (
                    f"{folder.rsplit('/', 1)[0]}/{member.name}" if "/" in folder else member.name
                )
                assert tar.extractfile(member).read() == written[source]
    for bad in ("spec.json", "%2e%2e", "export/%2e%2e", "nothing", "checkpoints/step_00000099"):
        assert client.get(f"/v1/jobs/{job['id']}/archive/{bad}").status_code == 404, bad


def test_real_hf_job_runs_streams_and_lists_its_export(
    tmp_path: Path, data_dir: Path, models: dict[str, Any]
) -> None:
    """The real recipe under torchrun, 2 processes, an HF Llama directory, JSON lines."""
    datasets = tmp_path / "datasets"
    h.write_jsonl(datasets / "docs.jsonl", models["docs"] * 2)
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    env["DMUON_CACHE_DIR"] = str(tmp_path / "cache")
    server = LiveServer(
        data_dir, "--data-root", str(datasets), "--model-root", str(models["root"]), env=env
    )
    server.env = env
    server.start()
    body = _hf("llama", steps=4, seq_len=32, data="docs.jsonl", export_hf=True, eval_every=0,
               checkpoint_every=0)  # fmt: skip
    try:
        with server.client(timeout=300) as c:
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            losses, end = [], None
            with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
                for ev in iter_sse(resp):
                    if ev.event == "metric":
                        losses.append(ev.json()["loss"])
                    elif ev.event == "end":
                        end = ev.json()
                        break
            assert end is not None and end["state"] == "succeeded", c.get(
                f"/v1/jobs/{job_id}/logs", params={"tail": 60}
            ).json()
            assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
            items = c.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]
            export = {a["path"]: a for a in items if a["kind"] == "export"}
            assert {
                "export/config.json",
                "export/model.safetensors",
                "export/tokenizer.json",
            } <= set(export)
            config = c.get(f"/v1/jobs/{job_id}/artifacts/export/config.json")
            on_disk = data_dir / "jobs" / job_id / "export" / "config.json"
            assert config.content == on_disk.read_bytes()
            assert json.loads(config.content)["model_type"] == "llama"
            assert any(a["kind"] == "checkpoint" for a in items)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(on_disk.parent)
        assert type(loaded).__name__ == "LlamaForCausalLM"
    finally:
        server.stop()
    assert not job_processes(data_dir)


def test_artifact_names_a_job_chose_are_escaped_in_listings_and_renamed_in_archives(
    client: TestClient, data_dir: Path
) -> None:
    """A file named with a right-to-left override (U+202E): the listing keeps its exact
    path (to fetch it) and shows it escaped; the archive's member is renamed to the
    escaped name, so no entry can pass for another. One with a line break (U+000A) could
    not be asked for again in a URL: it is neither listed nor archived."""
    import io
    import tarfile

    from server_helpers import finish_all_jobs

    job = client.post("/v1/jobs", json=job_spec(steps=2)).json()
    finish_all_jobs(client)
    job_dir = data_dir / "jobs" / job["id"]
    tricky = "export/model\u202egpj.exe.config.json"
    (job_dir / "export").mkdir(parents=True, exist_ok=True)
    (job_dir / tricky).write_bytes(b"payload")
    (job_dir / "export/line\nbreak.json").write_bytes(b"unreachable")
    (job_dir / "export/plain.json").write_bytes(b"{}")
    listed = client.get(f"/v1/jobs/{job['id']}/artifacts", params={"under": "export"}).json()
    by_path = {a["path"]: a["shown"] for a in listed["items"]}
    assert by_path == {
        tricky: "export/model\\u202egpj.exe.config.json",
        "export/plain.json": "export/plain.json",
    }
    r = client.get(f"/v1/jobs/{job['id']}/archive/export")
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = tar.getnames()
        assert names == ["export/model\\u202egpj.exe.config.json", "export/plain.json"]
        assert tar.extractfile(names[0]).read() == b"payload"


def test_a_model_path_is_spelled_as_the_recipes_config_file_spells_it(
    hf_client: TestClient,
) -> None:
    """``train.model`` as a string path (what ``--model`` and a ``--config`` file take) is
    the same job as ``{"path": ...}``; outside the roots, or on a server without model
    roots, it is refused naming them."""
    import tomllib

    as_object = hf_client.post("/v1/jobs:validate", json=_hf("llama")).json()
    body = _hf("llama")
    body["train"]["model"] = "llama"
    as_string = hf_client.post("/v1/jobs:validate", json=body).json()
    # The same admission, less what the host has free at that moment.
    stable = ("parameters_bytes", "activations_bytes", "batch_bytes", "corpus_bytes")
    for admission in (as_string["admission"], as_object["admission"]):
        memory = admission.pop("memory")
        admission["memory"] = {k: memory[k] for k in stable}
    assert as_string["admission"] == as_object["admission"]
    assert as_string["admission"]["model"] == "<model-root>/llama"
    assert as_string["torchrun_argv"] == as_object["torchrun_argv"]
    # A --config file's text, parsed, with its table and option spellings, is a spec.
    config = tomllib.loads('model = "llama"\n[schedule]\nsteps = 3\nseq-len = 32\n')
    from_file = hf_client.post("/v1/jobs:validate", json={"name": "from-toml", "train": config})
    assert from_file.status_code == 200, from_file.text
    job = hf_client.post("/v1/jobs", json=body).json()
    assert job["train"]["model"] == {"path": "llama"}  # held in one form
    hf_client.post(f"/v1/jobs/{job['id']}/cancel")
    body["train"]["model"] = "../elsewhere"
    field, message = _refusal(hf_client, body)
    assert field == "body.train.model.path" and "lies outside the model roots" in message
    body["train"]["model"] = "tiny"  # a preset name stays a preset
    assert hf_client.post("/v1/jobs:validate", json=body).json()["admission"]["model"] == "tiny"
