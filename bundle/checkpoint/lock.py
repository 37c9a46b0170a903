"""One job per save directory: ``SAVE_DIR/.bundle.lock``, held for the job's whole life.

The lock is an exclusive ``flock`` on that file, taken before anything is written (by the node
supervisor of node 0, or by rank 0 under torchrun) and released by the kernel when its holder
exits, however it exits: a job that died holds nothing. The file names the holder (host, pid,
start time, job id), so a second job is refused with who holds the directory, and a job finding
the name of one that is gone says it takes the directory over. A restarted attempt of the same
job (torchrun restarts its workers; the job id stays) takes it back without a note.

``flock`` is exclusive between hosts on local filesystems and NFSv4; on a filesystem without
locks (some FUSE mounts) the lock cannot be taken and the job is refused, naming the error.

A save directory is written by one user: one owned by another user, or that anyone may write to
without the sticky bit (anyone could then replace what the job writes), is refused, and the lock
file is opened without following a symbolic link (one planted there would have the job truncate
its target) and must be this user's own regular file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass

from bundle.errors import CheckpointError

NAME = ".bundle.lock"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str
    job: str

    @classmethod
    def me(cls, job: str) -> Holder:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        return cls(socket.gethostname(), os.getpid(), started, job)

    def __str__(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def _read(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        return Holder(**json.loads(raw))
    except (ValueError, TypeError):
        return None  # being written, or never written


class DirLock:
    """``acquire()`` once before the job writes; the lock lasts until ``release()`` or exit."""

    def __init__(self, save_dir: str, job: str) -> None:
        self.save_dir, self.path = save_dir, os.path.join(save_dir, NAME)
        self.me = Holder.me(job)
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; a note if it was a gone job's. Raises if another job holds it."""
        try:
            os.makedirs(self.save_dir, exist_ok=True)
            check_owner(self.save_dir)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise CheckpointError(
                f"--save-dir {self.save_dir}: cannot open {NAME} ({why})"
            ) from exc
        try:
            _own_regular_file(fd, self.path)
        except CheckpointError:
            os.close(fd)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # held; anything else: no locks here
                raise CheckpointError(
                    f"--save-dir {self.save_dir}: cannot lock {NAME} ({exc.strerror})"
                ) from exc
            who = f" ({holder})" if holder else ""
            raise CheckpointError(
                f"--save-dir {self.save_dir} is in use by another job{who}: one job per save "
                "directory; wait for it to end or choose another --save-dir"
            ) from exc
        previous = _read(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(self.me)).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        if previous is None or previous.job == self.me.job:
            return None
        return f"took over {self.path} from a job that is gone ({previous})"

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # no name of a holder that is gone
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def check_owner(save_dir: str) -> None:
    """Refuse a save directory another user owns, or one anyone may write to without the sticky
    bit: whoever can replace its entries can swap a step directory or plant a link the job follows."""
    st = os.stat(save_dir)
    if st.st_uid != os.geteuid():
        raise CheckpointError(
            f"--save-dir {save_dir} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}): use a directory of your own (e.g. one inside it)"
        )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise CheckpointError(
            f"--save-dir {save_dir} may be written by any user ({stat.filemode(st.st_mode)}): "
            f"chmod o-w {save_dir} (or +t), or use a directory of your own"
        )


def _own_regular_file(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}"
        raise CheckpointError(f"{path} is {what}: remove it, or use a directory of your own")


def job_id(env: dict[str, str]) -> str:
    """What stays the same across the restarts of one job: torchrun's run id (``--rdzv-id``);
    else this process (the node supervisor holds the lock through every attempt)."""
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}"
    return f"{socket.gethostname()}:{os.getpid()}"
