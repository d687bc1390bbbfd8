"""What one sandbox may use, apart from every other sandbox: a uid of its own and a cgroup of its own.

The code judge runs two sandboxes per task and up to a slot per core at once. Limits shared between
them let one answer fail its neighbours: ``RLIMIT_NPROC`` counts every process of a *uid* on the
host, so a candidate holding 60 sleeping processes as ``nobody`` left every other sandbox of
``nobody`` unable to start (``failed to execute bwrap: Resource temporarily unavailable``), and
``RLIMIT_AS`` caps each process, not the answer (5 children of 200 MB each under a 256 MB limit).

- :class:`UidLease`: as root, each sandbox runs outside as a uid of its own, leased from a pool
  (:data:`UID_POOL`, no user of the machine) with an ``flock`` per uid, so leases hold across the
  judge's threads and across processes judging at once; ``RLIMIT_NPROC`` then counts that sandbox
  alone.
- :class:`Cgroup`: where the machine lets this process make cgroups (as root, cgroup v1's ``memory``
  and ``pids`` hierarchies, or v2 with both controllers delegated), each sandbox gets one with the
  judge's memory limit for all its processes together (swap included where the kernel accounts
  it) and its process limit; the judge moves the sandbox's first process into it before any of
  the program runs, reads its peak memory and its out-of-memory kills, then removes it. Without
  cgroups the memory limit is per process (``isolation()["cgroup"]`` says which, and the stages'
  cards print it).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import tempfile
import time
import uuid
from functools import lru_cache
from pathlib import Path

__all__ = ["UID_POOL", "Cgroup", "UidLease", "cgroup_support"]

log = logging.getLogger("kibidango.judges.confine")

UID_POOL = range(1_700_000_000, 1_700_000_512)
"""Outside uids the sandboxes run as (as root): far above any user a machine gives out."""

_CGROUP_ROOT = Path("/sys/fs/cgroup")


class UidLease:
    """``with UidLease() as uid``: a uid of :data:`UID_POOL` no other sandbox on this machine holds
    (an ``flock`` on ``<tmp>/kibidango-judge-uids-<euid>/<uid>``, released with the lease)."""

    def __init__(self):
        self.uid: int | None = None
        self._fd: int | None = None

    def __enter__(self) -> int:
        where = Path(tempfile.gettempdir()) / f"kibidango-judge-uids-{os.geteuid()}"
        where.mkdir(mode=0o700, exist_ok=True)
        if where.stat().st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{where} belongs to another user: cannot lease sandbox uids")
        start = uuid.uuid4().int % len(UID_POOL)  # spread threads and processes over the pool
        for i in range(len(UID_POOL)):
            uid = UID_POOL[(start + i) % len(UID_POOL)]
            fd = os.open(where / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return uid
        raise OSError(errno.EAGAIN, f"all {len(UID_POOL)} sandbox uids are leased")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = None


@lru_cache(maxsize=1)
def cgroup_support() -> dict | None:
    """How this process can make a sandbox's cgroup: ``{"version": 1, "memory": dir, "pids": dir}``
    (v1: the directories of this process's own cgroups, under which a sandbox's are made),
    ``{"version": 2, "parent": dir}``, or None (not root, no writable hierarchy, or the controllers
    are not delegated). Checked by making and removing one."""
    try:
        own = dict(_own_cgroups())
    except OSError:
        return None
    v1 = {c: _CGROUP_ROOT / c / own[c].lstrip("/") for c in ("memory", "pids") if c in own}
    if len(v1) == 2 and all((d / "cgroup.procs").is_file() for d in v1.values()):
        support = {"version": 1, **v1}
    elif "" in own and (_CGROUP_ROOT / "cgroup.controllers").is_file():
        parent = _CGROUP_ROOT / own[""].lstrip("/")
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            return None
        if not {"memory", "pids"} <= set(enabled):
            return None
        support = {"version": 2, "parent": parent}
    else:
        return None
    try:
        probe = Cgroup(support, memory_bytes=64 << 20, processes=4)
        probe.remove()
    except OSError as e:
        log.info(f"sandboxes get no cgroup of their own ({e}): their memory limit is per process")
        return None
    return support


def _own_cgroups():
    """(controller, path) of this process's cgroups; controller '' is v2's unified hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            yield c, path


class Cgroup:
    """One sandbox's cgroup(s): ``memory_bytes`` for all its processes together (swap included
    where accounted) and at most ``processes`` of them. :attr:`procs` are the files a process
    a process is moved in through (:meth:`add`); :meth:`remove` kills what is left in it and
    removes it."""

    def __init__(self, support: dict, memory_bytes: int, processes: int):
        name = f"kibidango-judge-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.version = support["version"]
        if self.version == 1:
            self.dirs = [support["memory"] / name, support["pids"] / name]
        else:
            self.dirs = [support["parent"] / name]
        made = []
        try:
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            if self.version == 1:
                memory, pids = self.dirs
                _write(memory / "memory.limit_in_bytes", memory_bytes)
                if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounted: no swapping past the cap
                    _write(memory / "memory.memsw.limit_in_bytes", memory_bytes)
                _write(pids / "pids.max", processes)
            else:
                (d,) = self.dirs
                _write(d / "memory.max", memory_bytes)
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", 0)
                _write(d / "pids.max", processes)
        except OSError:
            for d in reversed(made):
                _rmdir(d)
            raise
        self.procs = [str(d / "cgroup.procs") for d in self.dirs]

    def add(self, pid: int) -> None:
        """Move the process ``pid`` (and the threads of it) into this cgroup; what it starts from then
        on is born inside."""
        for procs in self.procs:
            with open(procs, "w") as f:
                f.write(str(pid))

    def peak_bytes(self) -> int | None:
        """The most memory its processes held at once (None where the kernel does not say)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.dirs[0] / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed in it for passing its memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.dirs[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """Kill every process still in it (a sandbox's are already gone when its namespace's init
        died; this is the belt to that brace) and remove its directories."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except (OSError, ValueError):
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.01)
            _rmdir(d)


def _write(path: Path, value: int) -> None:
    path.write_text(str(value))


def _rmdir(d: Path) -> None:
    for _ in range(100):  # a cgroup is busy until the kernel has finished reaping its last process
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                log.warning(f"could not remove the sandbox cgroup {d}: {e}")
                return
            time.sleep(0.01)
    log.warning(f"could not remove the sandbox cgroup {d}: still busy")
