"""A local job whose checkpoints cannot fit its user's disk quota is refused at
submission, saying how much it needs; one that fits is accepted.

Oracles: the recipe's own checkpoints on disk (each at least the bytes the server's
bound says, for both optimizers, and no more of them at once than it counts); the
parameter count of the recipe's model; the in-process app's HTTP answers.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import replace
from pathlib import Path

import pytest
from fake_launcher import FakeLauncher
from fastapi.testclient import TestClient
from server_helpers import job_spec, make_settings

from dmuon_server.app import create_app
from dmuon_server.recipe.admission import RECIPE_MODELS
from dmuon_server.recipe.checkpoint_space import checkpoint_bytes, checkpoints_held

TOKEN = secrets.token_urlsafe(24)


@pytest.mark.parametrize("optimizer", ["dmuon", "adamw"])
def test_the_bound_is_below_the_recipes_real_checkpoints(tmp_path: Path, optimizer: str) -> None:
    from dmuon.train import TrainConfig, run
    from dmuon.train.models import build_model

    params = sum(p.numel() for p in build_model("tiny").parameters())
    assert RECIPE_MODELS["tiny"].num_params == params
    base = TrainConfig(
        model="tiny", seq_len=32, micro_batch_size=2, steps=3, eval_every=0, progress="plain",
        cache_dir=str(tmp_path / "cache"), threads=1, optimizer=optimizer, checkpoint_every=1,
        keep_checkpoints=2, checkpoint_dir=str(tmp_path / "ck"),
    )  # fmt: skip
    run(replace(base))
    saved = sorted((tmp_path / "ck").glob("step_*"))
    assert len(saved) == 2 <= checkpoints_held(3, 1, 2) == 3
    for folder in saved:
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        bound = checkpoint_bytes(params, optimizer)
        assert bound <= size < bound + (1 << 20), (folder.name, size, bound)


def test_held_counts_the_saves_and_the_one_being_written() -> None:
    assert checkpoints_held(100, 0, 3) == 1  # only the end
    assert checkpoints_held(100, 50, 3) == 2  # steps 50 and 100
    assert checkpoints_held(101, 50, 3) == 3  # 50, 100 and the end
    assert checkpoints_held(1000, 10, 3) == 4  # three kept and the new one
    assert checkpoints_held(1000, 10, 0) == 100  # keeping all


def test_a_job_whose_checkpoints_cannot_fit_the_quota_is_refused(tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    entry = {"name": "ada", "token_sha256": digest, "limits": {"disk_gib": 0.01}}
    users.write_text(json.dumps({"users": [entry]}))
    users.chmod(0o600)
    settings = make_settings(tmp_path, users_file=users)
    params = RECIPE_MODELS["tiny"].num_params
    quota = int(0.01 * 2**30)
    assert 8 * params <= quota < 40 * 8 * params  # one fits, forty do not
    app = create_app(settings, make_launcher=FakeLauncher)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app, headers=auth) as c:
        many = job_spec(1, steps=40, checkpoint_every=1, keep_checkpoints=0)
        r = c.post("/v1/jobs", json=many)
        assert r.status_code == 422, r.text
        (error,) = [e for e in r.json()["errors"] if e["field"] == "body.train.keep_checkpoints"]
        need = 40 * 8 * params  # keeping all 40 saves
        assert f"at least {need / 2**30:.2f} GiB" in error["message"]
        assert "user ada's disk quota (0.01 GiB, disk_gib) has 0.01 GiB free" in error["message"]
        one = job_spec(1, steps=40, checkpoint_every=0)
        assert c.post("/v1/jobs", json=one).status_code == 201
