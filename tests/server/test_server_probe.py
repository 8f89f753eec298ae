"""A security reviewer's and an operator's probe of a live ``dmuon-server`` process, each
point through a real HTTP client (httpx): symbolic links out of the data roots, DNS
rebinding, poisoned metrics lines, late cancels, and the smaller holes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_helpers import LiveServer, fake_recipe_env, job_spec

Start = Callable[..., LiveServer]


@pytest.fixture
def start_server(data_dir: Path) -> Iterator[Start]:
    """Start live servers on ``data_dir`` (fake recipe, extra flags and knobs); all are
    stopped at the end."""
    started: list[LiveServer] = []

    def start(*flags: str, **knobs: str) -> LiveServer:
        server = LiveServer(data_dir, *flags, env=fake_recipe_env(**knobs))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def test_links_out_of_the_data_roots_are_refused(tmp_path: Path, start_server: Start) -> None:
    root = tmp_path / "datasets"
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("the secret text\n" * 400)
    (outside / "more").mkdir()
    (outside / "more" / "b.txt").write_text("more secret text\n" * 400)
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "ok.txt").write_text("plain text inside the root\n" * 400)
    (root / "dir" / "leak.txt").symlink_to(secret)
    (root / "sub").mkdir()
    (root / "sub" / "ok.txt").write_text("plain text inside the root\n" * 400)
    (root / "sub" / "linked").symlink_to(outside / "more")  # a folder out of the root
    (root / "hidden").mkdir()
    (root / "hidden" / "ok.txt").write_text("plain text inside the root\n" * 400)
    (root / "hidden" / ".dot").symlink_to(secret)
    (root / "fine").mkdir()
    (root / "fine" / "a.txt").write_text("plain text inside the root\n" * 400)
    (root / "fine" / "b.txt").symlink_to(root / "dir" / "ok.txt")  # stays inside: fine
    server = start_server("--data-root", str(root))
    with server.client() as c:
        for data, entry in (
            ("dir", "leak.txt"),
            (".", "dir/leak.txt"),
            ("sub", "linked"),
            ("hidden", ".dot"),
        ):
            for path in ("/v1/jobs:validate", "/v1/jobs"):
                r = c.post(path, json=job_spec(data=data))
                assert r.status_code == 422, (data, r.text)
                body = r.json()
                assert body["errors"][0]["field"] == "body.train.data"
                assert f"'{entry}'" in body["detail"] and "outside the data roots" in body["detail"]
                assert str(outside) not in r.text and str(root) not in r.text
        assert c.get("/v1/jobs").json()["items"] == []
        # A link to a file inside a root is read like any other file.
        plan = c.post("/v1/jobs:validate", json=job_spec(data="fine"))
        assert plan.status_code == 200, plan.text
        size = (root / "fine" / "a.txt").stat().st_size
        assert plan.json()["admission"]["data"]["bytes"] == 2 * size
        assert plan.json()["admission"]["data"]["files"] == 2
    assert os.path.islink(root / "dir" / "leak.txt")  # nothing was changed on disk
