"""Per-user disk quotas on the data directory, held by the kernel.

A user whose limits give ``disk_gib`` gets a volume of their own: a file of that size,
``<data-dir>/volumes/images/<user>.img``, allocated in full when it is made
(``fallocate``: the space is taken from the disk at once, so no other job can fill it
later), formatted ext4 and loop-mounted at ``<data-dir>/volumes/mounts/<user>/``. Each of
the user's jobs gets a folder there, bind-mounted at its usual place,
``<data-dir>/jobs/<id>``, so every path the server and the job use stays the same. The kernel
refuses a write beyond the volume (``ENOSPC``), and the server stops the user's running
jobs once their volume is full, saying why (:meth:`UserVolumes.full`). The file system's
own bookkeeping (journal, inode tables) takes a few percent of the volume.

Two things follow, both wanted:

* one user filling their quota never fails another user's running job: the other's space
  was set aside when their volume was made;
* a user without ``disk_gib`` (an admin, a server without users) writes to the data
  directory's disk as before.

Mounting needs root and a loop device: where either is missing, :meth:`UserVolumes.detect`
says so at start-up, and jobs run without their quota. Volumes outlive the server (a
restart finds them mounted); after a reboot :meth:`UserVolumes.restore` mounts them and
their jobs' folders again. A quota raised in the users file grows the volume the next time
one of the user's jobs starts; a lowered one applies once the user's jobs are deleted and
the volume with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from dmuon_server.storage.datadir import free_bytes

log = logging.getLogger("dmuon_server.launching.volumes")

#: The folder of the data directory that holds the volumes.
VOLUMES_FOLDER = "volumes"
_IMAGE_SUFFIX = ".img"
#: Tools the volumes need (util-linux and e2fsprogs).
_TOOLS = ("mount", "umount", "losetup", "mkfs.ext4", "resize2fs", "dumpe2fs", "e2fsck")
_GIB = 1 << 30
#: Where the administrator's tools live; cron's and some service units' ``PATH`` lacks them.
SYSTEM_FOLDERS = ("/usr/sbin", "/sbin")


def add_system_folders_to_path() -> None:
    """Put `SYSTEM_FOLDERS` at the end of this process's ``PATH`` where they are missing,
    so the volumes' tools (``losetup``, ``mkfs.ext4``) are found as a root shell finds them."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    missing = [f for f in SYSTEM_FOLDERS if f not in folders and os.path.isdir(f)]
    if missing:
        os.environ["PATH"] = os.pathsep.join([p for p in folders if p] + missing)


#: A volume counts as full below this much free space, or 1% of its size if more: ext4
#: refuses a large write with a little space left (what it keeps for its own metadata).
FULL_BELOW_BYTES = 4 << 20
#: Bytes per inode of a volume's file system (checkpoints are few, large files).
_BYTES_PER_INODE = 1 << 16


class VolumeError(OSError):
    """A user's volume could not be made, grown or mounted; the message says why."""


def quota_bytes(disk_gib: float) -> int:
    """The size of a volume for a quota of ``disk_gib`` GiB (a whole number of MiB)."""
    return max(1, round(disk_gib * 1024)) << 20


def _run(argv: list[str]) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip().splitlines()
        raise VolumeError(0, f"{' '.join(argv[:2])} failed: {why[-1] if why else out.returncode}")


def _loop_device(image: Path) -> str | None:
    """The loop device ``image`` is attached to, or None."""
    out = subprocess.run(
        ["losetup", "-j", str(image), "-O", "NAME", "-n"], capture_output=True, text=True
    )
    names = out.stdout.split()
    return names[0] if out.returncode == 0 and names else None


class UserVolumes:
    """The volumes of one data directory (see the module docstring)."""

    def __init__(self, data_dir: Path, jobs_dir: Path) -> None:
        """Volumes under ``<data_dir>/volumes`` for the job folders of ``jobs_dir``."""
        self.root = data_dir / VOLUMES_FOLDER
        # Images and mount points apart: a user called "ada.img" cannot meet ada's image.
        self.images = self.root / "images"
        self.mounts = self.root / "mounts"
        self.jobs_dir = jobs_dir

    @classmethod
    def detect(cls, data_dir: Path, jobs_dir: Path) -> tuple[UserVolumes | None, str]:
        """The volumes where this machine can mount them (None otherwise), and a line for
        the start-up log saying which."""
        add_system_folders_to_path()
        missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
        if os.geteuid() != 0:
            why = "the server does not run as root"
        elif missing:
            why = f"{', '.join(missing)} not found (install util-linux and e2fsprogs)"
        else:
            probe = subprocess.run(["losetup", "-f"], capture_output=True, text=True)
            why = "" if probe.returncode == 0 else "no free loop device (losetup -f failed)"
        if why:
            return None, why
        return cls(data_dir, jobs_dir), (
            "disk quotas: each user with disk_gib gets a loop-mounted volume of that size "
            f"under {data_dir / VOLUMES_FOLDER}"
        )

    def image(self, user: str) -> Path:
        """The file that holds ``user``'s volume."""
        return self.images / f"{user}{_IMAGE_SUFFIX}"

    def mount_point(self, user: str) -> Path:
        """Where ``user``'s volume is mounted."""
        return self.mounts / user

    # ----------------------------------------------------------------- volumes

    def attach(self, user: str, size: int) -> Path:
        """Make ``user``'s volume (at least ``size`` bytes, allocated) and mount it; its
        mount point. Raises :class:`VolumeError` saying why not."""
        for folder in (self.root, self.images, self.mounts):
            folder.mkdir(mode=0o700, exist_ok=True)
        image, point = self.image(user), self.mount_point(user)
        grown = False
        if not image.exists():
            self._make(image, size)
        elif image.stat().st_size < size:
            self._allocate(image, size)
            grown = True
        elif image.stat().st_size > size:
            log.warning(
                "user %s: the volume stays at %d MiB until the user's jobs are deleted "
                "(disk_gib asks for %d MiB)",
                user,
                image.stat().st_size >> 20,
                size >> 20,
            )
        point.mkdir(mode=0o700, exist_ok=True)
        if not os.path.ismount(point):
            self._fit_offline(image)
            _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(point)])
            point.chmod(0o700)
        elif grown:
            self._fit_online(user, image)
        return point

    def _make(self, image: Path, size: int) -> None:
        free = free_bytes(self.root)
        if size > free:
            raise VolumeError(
                0,
                f"the data directory's disk has {free / _GIB:.2f} GiB free, and the user's "
                f"disk quota needs {size / _GIB:.2f} GiB set aside: lower disk_gib or free space",
            )
        partial = image.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        try:
            self._allocate(partial, size)
            # nodiscard: discarding would punch holes in the file and give the space back.
            mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-i", str(_BYTES_PER_INODE)]
            _run([*mkfs, "-E", "nodiscard", str(partial)])
        except VolumeError:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, image)

    @staticmethod
    def _allocate(image: Path, size: int) -> None:
        """Allocate ``image`` up to ``size`` bytes (not a sparse file: the space is taken)."""
        fd = os.open(image, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise VolumeError(
                e.errno, f"cannot set aside the user's disk quota: {e.strerror}"
            ) from None
        finally:
            os.close(fd)

    @staticmethod
    def _fit_offline(image: Path) -> None:
        """Grow the unmounted file system of ``image`` to the file's size, if smaller."""
        out = subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, text=True)
        fields = dict(line.split(":", 1) for line in out.stdout.splitlines() if ":" in line)
        try:
            fs_bytes = int(fields["Block count"]) * int(fields["Block size"])
        except (KeyError, ValueError):
            return
        if fs_bytes < image.stat().st_size:
            subprocess.run(["e2fsck", "-f", "-p", str(image)], capture_output=True)
            _run(["resize2fs", str(image)])

    @staticmethod
    def _fit_online(user: str, image: Path) -> None:
        """Grow the mounted file system of ``image``; where the kernel does not allow it
        (no CAP_SYS_RESOURCE), the larger size applies at the volume's next mount."""
        device = _loop_device(image)
        try:
            if device is None:
                raise VolumeError(0, "its loop device was not found")
            _run(["losetup", "-c", device])
            _run(["resize2fs", device])
        except VolumeError as e:
            log.warning(
                "user %s: the volume's larger quota applies once it is mounted again (%s)",
                user,
                e.strerror,
            )

    # ---------------------------------------------------------------- job folders

    def place(self, user: str, size: int, job_id: str) -> Path:
        """Put the folder of job ``job_id`` on ``user``'s volume (made and mounted first):
        ``<jobs>/<id>`` becomes a bind mount of ``<volume>/<id>``; what the folder already
        held (a checkpoint copied at submission) moves onto the volume. Idempotent."""
        job_dir = self.jobs_dir / job_id
        if os.path.ismount(job_dir):
            return job_dir
        source = self.attach(user, size) / job_id
        source.mkdir(mode=0o700, exist_ok=True)
        job_dir.mkdir(mode=0o700, exist_ok=True)
        if any(os.scandir(job_dir)):
            # cp -a keeps each file's owner (the job's account); a copy across file systems.
            _run(["cp", "-a", "--", f"{job_dir}/.", str(source)])
            for entry in os.scandir(job_dir):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        _run(["mount", "--bind", "-o", "nosuid,nodev", str(source), str(job_dir)])
        return job_dir

    def full(self, job_dir: Path) -> bool:
        """Whether ``job_dir`` lies on a volume that is full: under ``FULL_BELOW_BYTES``
        or 1% of it free, or no inode left."""
        if not os.path.ismount(job_dir):
            return False
        try:
            st = os.statvfs(job_dir)
        except OSError:
            return False
        size = st.f_blocks * st.f_frsize
        margin = max(FULL_BELOW_BYTES, size // 100)
        return st.f_bavail * st.f_frsize < margin or st.f_favail == 0

    def remove(self, job_id: str) -> None:
        """Remove job ``job_id``'s folder and, where it lies on a volume, its place there."""
        job_dir = self.jobs_dir / job_id
        shutil.rmtree(job_dir, ignore_errors=True)  # the contents; a mount point stays
        if os.path.ismount(job_dir):
            subprocess.run(["umount", "-l", str(job_dir)], capture_output=True)
        with contextlib.suppress(OSError):
            job_dir.rmdir()
        for point in self._mounted():
            shutil.rmtree(point / job_id, ignore_errors=True)

    def restore(self) -> int:
        """Mount every volume and job folder a reboot unmounted; how many job folders
        were bound again."""
        bound = 0
        if not self.images.is_dir():
            return 0
        for image in sorted(self.images.glob(f"*{_IMAGE_SUFFIX}")):
            user = image.name.removesuffix(_IMAGE_SUFFIX)
            try:
                point = self.attach(user, image.stat().st_size)
            except VolumeError as e:
                log.error("user %s: cannot mount the volume %s: %s", user, image, e)
                continue
            for entry in os.scandir(point):
                if entry.is_dir(follow_symlinks=False) and entry.name != "lost+found":
                    job_dir = self.jobs_dir / entry.name
                    if not os.path.ismount(job_dir):
                        job_dir.mkdir(mode=0o700, exist_ok=True)
                        _run(["mount", "--bind", "-o", "nosuid,nodev", entry.path, str(job_dir)])
                        bound += 1
        return bound

    def _mounted(self) -> list[Path]:
        if not self.mounts.is_dir():
            return []
        return [p for p in self.mounts.iterdir() if p.is_dir() and os.path.ismount(p)]


def remove_job_folder(data_dir: Path, jobs_dir: Path, job_id: str) -> None:
    """Remove a job's folder, on a user's volume or not (the HTTP layer's deletions)."""
    UserVolumes(data_dir, jobs_dir).remove(job_id)
