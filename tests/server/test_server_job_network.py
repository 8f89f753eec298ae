"""Each sandboxed job has a network of its own: the rendezvous store, ports and abstract
Unix sockets of one user's job cannot be reached from another user's job.

Oracle: the kernel, asked by the jobs themselves. A listener job opens what a torchrun
rendezvous store opens (a TCP port on every address) and an abstract Unix socket, and
stays up; a prober job, started as another user, tries to connect to both and looks for
the port in its ``/proc/net/tcp``. The control: two jobs of a user given the host's
network (``host_network`` in the users file) do reach each other, so a refusal is the
namespace's doing, not the probe's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from isolation_helpers import ALICE, BOB, World, make_world, require_root_and_accounts, script_job
from server_helpers import LiveServer, job_end, wait_until

from dmuon_server.launching import sandbox

#: Listens on a TCP port on every address (as torchrun's TCPStore does) and on an abstract
#: Unix socket, writes where into its checkpoint folder, and answers until cancelled.
LISTENER = r"""
import json, os, socket, threading
from pathlib import Path

tcp = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
tcp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
tcp.bind(("::", 0))
tcp.listen(8)
name = "dmuon-test-" + os.urandom(6).hex()
unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
unix.bind("\0" + name)
unix.listen(8)


def answer(server):
    while True:
        conn, _ = server.accept()
        conn.sendall(b"store")
        conn.close()


for server in (tcp, unix):
    threading.Thread(target=answer, args=(server,), daemon=True).start()
out = Path(os.environ["DMUON_CHECKPOINT_DIR"]) / "step_00000001"
out.mkdir(parents=True, exist_ok=True)
where = {"port": tcp.getsockname()[1], "abstract": name}
(out / "listening.json").write_text(json.dumps(where))
print("listening", json.dumps(where), flush=True)
threading.Event().wait(300)
"""

#: Tries to reach the listener's port (loopback, both families) and abstract socket.
PROBE = r"""
import json, os, socket, sys
from pathlib import Path

port, name = int(sys.argv[1]), sys.argv[2]
report = {}


def attempt(what, family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(address)
        report[what] = "reached: " + s.recv(16).decode()
    except OSError as e:
        report[what] = type(e).__name__
    finally:
        s.close()


attempt("tcp 127.0.0.1", socket.AF_INET, ("127.0.0.1", port))
attempt("tcp ::1", socket.AF_INET6, ("::1", port))
attempt("abstract socket", socket.AF_UNIX, "\0" + name)
listed = ""
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        listed += Path(table).read_text()
    except OSError:
        pass
report["port in /proc/net/tcp"] = f":{port:04X} " in listed
out = Path(os.environ["DMUON_CHECKPOINT_DIR"]) / "step_00000001"
out.mkdir(parents=True, exist_ok=True)
(out / "report.json").write_text(json.dumps(report))
"""

pytestmark = pytest.mark.usefixtures("root_and_accounts")


@pytest.fixture(scope="module")
def root_and_accounts() -> None:
    require_root_and_accounts()
    why = sandbox.probe(None)
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sandbox tests must run in CI: {why}")
        pytest.skip(why)


@pytest.fixture
def world() -> Iterator[World]:
    w = make_world({"alice": ALICE, "bob": BOB, "carol": None}, host_network=frozenset({"carol"}))
    for name, text in (("listener.py", LISTENER), ("probe.py", PROBE)):
        (w.code_root / name).write_text(text)
        (w.code_root / name).chmod(0o644)
    yield w
    shutil.rmtree(w.root, ignore_errors=True)


def _client(world: World, server: LiveServer, user: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {world.token(user)}"})


def _listen(world: World, client: httpx.Client) -> tuple[str, dict[str, Any]]:
    r = client.post("/v1/jobs", json=script_job("listener.py", name="listener"))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    path = world.data_dir / "jobs" / job_id / "checkpoints" / "step_00000001" / "listening.json"
    wait_until(path.exists, 60, "the listener to listen", interval=0.2)
    return job_id, json.loads(path.read_text())


def _probe(client: httpx.Client, where: dict[str, Any]) -> dict[str, Any]:
    body = script_job("probe.py", str(where["port"]), where["abstract"], name="probe")
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = job_end(client, job_id, what="the probe to end")
    assert job["state"] == "succeeded", job
    got = client.get(f"/v1/jobs/{job_id}/artifacts/checkpoints/step_00000001/report.json")
    assert got.status_code == 200, got.text
    return got.json()


UNREACHED = {
    "tcp 127.0.0.1": "ConnectionRefusedError",
    "tcp ::1": "ConnectionRefusedError",
    "abstract socket": "ConnectionRefusedError",
    "port in /proc/net/tcp": False,
}
REACHED = {
    "tcp 127.0.0.1": "reached: store",
    "tcp ::1": "reached: store",
    "abstract socket": "reached: store",
    "port in /proc/net/tcp": True,
}


def test_a_users_job_cannot_reach_another_users_store_ports_or_sockets(world: World) -> None:
    server = LiveServer(
        world.data_dir,
        *("--users-file", str(world.users_file), "--code-root", str(world.code_root)),
        *("--job-user", "dmuon-t-jobs", "--max-nproc", "1", "--max-concurrent-jobs", "2"),
        *("--sandbox", "bwrap", "--cancel-grace-s", "2"),
        own_identity=True,
    ).start()
    try:
        assert "a loopback-only network of their own" in server.log_path.read_text()
        with (
            _client(world, server, "alice") as alice,
            _client(world, server, "bob") as bob,
            _client(world, server, "carol") as carol,
        ):
            # bob's job, on its own network: neither alice's nor carol's (host network)
            # reaches it.
            listener, where = _listen(world, bob)
            assert _probe(alice, where) == UNREACHED
            assert _probe(carol, where) == UNREACHED
            assert bob.post(f"/v1/jobs/{listener}/cancel").status_code == 202
            # carol's job on the host's network: another of carol's reaches it (the
            # control), alice's, on its own network, does not.
            listener, where = _listen(world, carol)
            assert _probe(carol, where) == REACHED
            assert _probe(alice, where) == UNREACHED
            assert carol.post(f"/v1/jobs/{listener}/cancel").status_code == 202
    finally:
        server.stop()
