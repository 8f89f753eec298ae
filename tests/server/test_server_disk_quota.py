"""Per-user disk quotas on the data directory, held by the kernel (loop-mounted volumes).

Oracles: the kernel (a write beyond a volume fails with ``ENOSPC``; ``st_blocks`` says
whether a file's space is allocated; ``statvfs`` says what a disk has free) and, end to
end, a real server: one user's job that writes without end is stopped with a cause naming
the quota, while another user's job, writing at the same time, succeeds. The data
directory lies on a small tmpfs, so without the quotas the first job would fill it.

Root and a loop device are needed (skipped otherwise, saying why).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from isolation_helpers import (
    ALICE,
    BOB,
    JOBS,
    World,
    make_world,
    require_root_and_accounts,
    script_job,
)
from server_helpers import LiveServer, job_end, mount_tmpfs

from dmuon_server.launching import sandbox
from dmuon_server.launching.volumes import UserVolumes, quota_bytes
from dmuon_server.storage.datadir import free_bytes

MIB = 1 << 20

#: Writes 1 MiB files into its folder for ever, shrugging off every failed write (a
#: hostile job: only the server can stop it).
FILLER = r"""
import os, time
n = 0
while True:
    try:
        with open(f"fill-{n}.bin", "wb") as f:
            f.write(os.urandom(1 << 20))
        n += 1
    except OSError:
        time.sleep(0.01)
"""

#: Writes and syncs ``argv[1]`` files of 256 KiB, one every 0.1 s, then ends well.
WRITER = r"""
import os, sys, time
for i in range(int(sys.argv[1])):
    with open(f"part-{i}.bin", "wb") as f:
        f.write(os.urandom(256 << 10))
        f.flush()
        os.fsync(f.fileno())
    time.sleep(0.1)
print("wrote", sys.argv[1], "parts", flush=True)
"""


def _require_volumes(root: Path) -> None:
    found, note = UserVolumes.detect(root, root / "jobs")
    if found is None:
        pytest.skip(note)


def _unmount_under(root: Path) -> None:
    """Unmount every mount below ``root``, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point == str(root) or point.startswith(f"{root}/"):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.fixture
def volumes(tmp_path: Path) -> Iterator[UserVolumes]:
    if os.geteuid() != 0:
        pytest.skip("loop-mounted volumes need root")
    data = tmp_path / "data"
    (data / "jobs").mkdir(parents=True)
    _require_volumes(data)
    yield UserVolumes(data, data / "jobs")
    _unmount_under(data)


def _write(path: Path, nbytes: int) -> None:
    with path.open("wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())


def test_a_volume_is_allocated_holds_its_user_and_survives_a_reboot(
    volumes: UserVolumes,
) -> None:
    size = quota_bytes(16 / 1024)
    assert size == 16 * MIB
    alice = volumes.place("alice", size, "job-a")
    bob = volumes.place("bob", size, "job-b")
    assert alice == volumes.jobs_dir / "job-a" and os.path.ismount(alice)
    # Set aside, not promised: every byte of the file is allocated on the disk.
    image = volumes.image("alice")
    assert image.stat().st_size == size
    assert image.stat().st_blocks * 512 >= size

    # Alice cannot write past her quota; the kernel says so.
    with pytest.raises(OSError) as e:
        _write(alice / "big.bin", 20 * MIB)
    assert e.value.errno == errno.ENOSPC
    assert volumes.full(alice)
    # Bob's space is untouched.
    _write(bob / "mine.bin", 8 * MIB)
    assert not volumes.full(bob)
    assert not volumes.full(volumes.jobs_dir)  # not a volume

    # Placing again is a no-op; a reboot (everything unmounted) is undone by restore().
    assert volumes.place("alice", size, "job-a") == alice
    _unmount_under(volumes.root.parent)
    assert not (bob / "mine.bin").exists()
    assert volumes.restore() == 2
    assert (bob / "mine.bin").stat().st_size == 8 * MIB

    # Removing a job gives its space back to its user.
    free_before = free_bytes(alice)
    volumes.remove("job-a")
    assert not alice.exists() and not (volumes.mount_point("alice") / "job-a").exists()
    assert free_bytes(volumes.mount_point("alice")) > free_before + 8 * MIB


def test_a_folder_that_holds_files_moves_onto_the_volume_with_its_owners(
    volumes: UserVolumes,
) -> None:
    job_dir = volumes.jobs_dir / "job-c"
    (job_dir / "init" / "step_1").mkdir(parents=True)
    (job_dir / "init" / "step_1" / "model.bin").write_bytes(b"x" * 4096)
    os.chown(job_dir / "init" / "step_1" / "model.bin", 4242, 4243)
    volumes.place("carol", 16 * MIB, "job-c")
    moved = job_dir / "init" / "step_1" / "model.bin"
    assert os.path.ismount(job_dir)
    assert moved.read_bytes() == b"x" * 4096
    assert (moved.stat().st_uid, moved.stat().st_gid) == (4242, 4243)
    assert (volumes.mount_point("carol") / "job-c" / "init").is_dir()


def _size(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def test_a_user_named_like_anothers_image_gets_a_volume_of_their_own(
    volumes: UserVolumes,
) -> None:
    ada = volumes.place("ada", 16 * MIB, "job-g")
    dotted = volumes.place("ada.img", 16 * MIB, "job-h")
    _write(ada / "a.bin", 4 * MIB)
    _write(dotted / "b.bin", 4 * MIB)
    assert volumes.image("ada") != volumes.mount_point("ada.img")
    assert os.stat(ada).st_dev != os.stat(dotted).st_dev  # two file systems
    assert not (dotted / "a.bin").exists()


def test_a_raised_quota_grows_the_volume(volumes: UserVolumes) -> None:
    job_dir = volumes.place("dave", 16 * MIB, "job-d")
    small = _size(job_dir)
    # Mounted: grown at once where the kernel allows it (CAP_SYS_RESOURCE), else at the
    # next mount; either way the space is set aside now.
    volumes.place("dave", 32 * MIB, "job-e")
    assert volumes.image("dave").stat().st_blocks * 512 >= 32 * MIB
    _unmount_under(volumes.root.parent)
    volumes.restore()
    assert _size(job_dir) > small + 14 * MIB
    _write(job_dir / "after.bin", 20 * MIB)  # more than the first size held
    assert (volumes.jobs_dir / "job-e").is_dir()


def test_a_quota_larger_than_the_disk_is_refused_saying_so(volumes: UserVolumes) -> None:
    huge = free_bytes(volumes.jobs_dir) + (1 << 40)
    with pytest.raises(OSError, match="lower disk_gib or free space"):
        volumes.place("erin", huge, "job-f")
    assert not volumes.image("erin").exists()


# ------------------------------------------------------------------ end to end

SMALL_DISK_MIB = 96
QUOTA_GIB = 0.03  # 31 MiB each: two users fit, one unbounded filler would not


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    require_root_and_accounts()
    why = sandbox.probe(None)
    if why is not None:
        pytest.skip(f"the sandbox is needed: {why}")
    w = make_world({"alice": ALICE, "bob": BOB})
    disk = w.root / "disk"
    try:  # a skip below still cleans up
        mount_tmpfs(disk, SMALL_DISK_MIB, "mode=0755")
        w.data_dir = disk / "data"
        w.data_dir.mkdir(mode=0o755)
        _require_volumes(w.data_dir)
        doc = json.loads(w.users_file.read_text())
        doc["default_limits"] = {"disk_gib": QUOTA_GIB}
        for entry in doc["users"]:
            entry.pop("limits", None)
        w.users_file.write_text(json.dumps(doc))
        for name, text in (("filler.py", FILLER), ("writer.py", WRITER)):
            (w.code_root / name).write_text(text)
            (w.code_root / name).chmod(0o644)
        yield w
    finally:
        subprocess.run(["pkill", "-9", "-f", str(w.code_root)], capture_output=True)
        _unmount_under(disk)
        shutil.rmtree(w.root, ignore_errors=True)


def _end(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return job_end(client, job_id)


def test_a_user_over_quota_is_stopped_and_another_users_job_keeps_running(
    world: World,
) -> None:
    server = LiveServer(
        world.data_dir,
        *("--users-file", str(world.users_file), "--code-root", str(world.code_root)),
        *("--max-nproc", "1", "--max-concurrent-jobs", "2", "--sandbox", "bwrap"),
        *("--job-user", JOBS),
        own_identity=True,
    )
    server.log_path = world.root / "server.log"  # off the small disk
    server.start()
    try:
        alice = server.client(headers={"Authorization": f"Bearer {world.token('alice')}"})
        bob = server.client(headers={"Authorization": f"Bearer {world.token('bob')}"})
        with alice, bob:
            r = bob.post("/v1/jobs", json=script_job("writer.py", "40", name="writer"))
            assert r.status_code == 201, r.text
            writer = r.json()["id"]
            r = alice.post("/v1/jobs", json=script_job("filler.py", name="filler"))
            assert r.status_code == 201, r.text
            filler = r.json()["id"]

            stopped = _end(alice, filler)
            done = _end(bob, writer)
            disk_free = free_bytes(world.data_dir)
            alice_jobs = world.data_dir / "jobs" / filler
            bob_jobs = world.data_dir / "jobs" / writer
            print(
                f"\nfiller: {stopped['state']} ({stopped['reason']}); writer: {done['state']}; "
                f"disk free {disk_free / MIB:.1f} MiB of {SMALL_DISK_MIB}"
            )
            assert stopped["state"] == "failed"
            assert "disk quota" in stopped["reason"] and "alice" in stopped["reason"]
            assert done["state"] == "succeeded", done
            assert len(list(bob_jobs.glob("part-*.bin"))) == 40
            # Alice's files stop at her quota; the shared disk never filled.
            written = sum(p.stat().st_size for p in alice_jobs.glob("fill-*.bin"))
            assert 20 * MIB < written <= quota_bytes(QUOTA_GIB)
            assert disk_free > 4 * MIB
            # Nothing of the filler is left running.
            left = subprocess.run(["pgrep", "-f", "filler.py"], capture_output=True, text=True)
            assert left.stdout.strip() == ""

            # Deleting the job gives alice her space back: her next job writes again.
            assert alice.delete(f"/v1/jobs/{filler}").status_code == 204
            assert not alice_jobs.exists()
            r = alice.post("/v1/jobs", json=script_job("writer.py", "8", name="again"))
            assert _end(alice, r.json()["id"])["state"] == "succeeded"
    finally:
        server.stop()


def test_the_quota_tools_are_found_without_sbin_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root server started with cron's PATH (``/usr/bin:/bin``) used to warn that disk
    quotas "cannot be held here"; the tools live in /usr/sbin and /sbin."""
    if os.geteuid() != 0:
        pytest.skip("loop-mounted volumes need root")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    data = tmp_path / "data"
    (data / "jobs").mkdir(parents=True)
    found, note = UserVolumes.detect(data, data / "jobs")
    assert found is not None, note
    assert os.environ["PATH"].split(os.pathsep)[-2:] == ["/usr/sbin", "/sbin"]
