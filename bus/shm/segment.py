"""Shared-memory segments and doorbells: files in ``/dev/shm`` named for their creator.

Why files in ``/dev/shm`` and not :mod:`multiprocessing.shared_memory`: the
latter registers every segment with a ``resource_tracker`` process that
unlinks it (and warns) when *any* process that attached exits, and it has no
way to say "this creator died, sweep its leftovers". A plain ``O_EXCL`` file,
mode 0600, mapped with :mod:`mmap`, has neither problem.

Every name starts ``tsb-<creator pid>-``. The creator unlinks its segments
on close (and, failing that, at interpreter exit); after a crash (SIGKILL),
the next process that creates a segment sweeps every ``tsb-<pid>-*`` whose
creator is dead, and a process whose parent died unlinks its own before it
exits (:func:`unlink_own`, from the parent watch of ``scheduler.launch``).

Space is reserved when a segment is made (``posix_fallocate``), not when
it is first written: a tmpfs file made by ``ftruncate`` alone is sparse,
and running out of room would surface as SIGBUS on a write, killing the
process, instead of an :class:`OSError` at creation that a caller can
handle (the frame pool falls back to the socket; the tensor-parallel
start-up names ``/dev/shm``'s size). ``TSB_SHM_DIR`` puts the files in
another directory (a bigger tmpfs, say). Doorbells (FIFOs a parked reader or writer sleeps on) live
beside the segments under the same names, so one sweep covers both. The
directory is world-writable but sticky, ``mkfifo``/``O_EXCL`` refuse a name
that exists, and every opener checks the file is ours (uid, type), so no
other user can plant or swap one.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
import weakref

from messages.errors import BusError

__all__ = ["SHM_DIR", "Segment", "ShmSpaceError", "fence", "make_fifo", "open_fifo", "pid_alive",
           "shm_space", "sweep_stale", "unlink_own"]

SHM_DIR = os.environ.get("TSB_SHM_DIR") or (
    "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
_NAME = re.compile(r"tsb-(\d+)-[a-z]+-[0-9a-f]{12}(\.[a-z0-9]+)?")
_swept = False
_sweep_lock = threading.Lock()
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (StoreLoad), from Python.

    CPython's lock acquire/release are atomic read-modify-writes (``lock
    cmpxchg`` on x86), which order every earlier store before every later
    load. The park protocols need exactly that: "I parked" must be visible
    before "is there data?" is read, or a wake-up can be lost.
    """
    _fence_lock.acquire()
    _fence_lock.release()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _stat(pid)
    return stat is None or stat[0] not in (b"Z", b"X")


def start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks after boot): with its pid, what names one
    process for as long as the machine runs (a pid alone may be reused). -1 where it
    cannot be read (the process is gone)."""
    stat = _stat(pid)
    try:
        return -1 if stat is None else int(stat[19])
    except (IndexError, ValueError):
        return -1


def _stat(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat``'s fields from the third on (the state, ...), or None where it
    cannot be read. Split after the last ``)``: the command name may hold spaces."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


class ShmSpaceError(BusError, OSError):
    """No room in the shared-memory directory for a segment: says how big it is.

    A :class:`~messages.BusError`, and an :class:`OSError` (``errno`` as the
    system gave it, ENOSPC most often), so code that handles a failed
    allocation keeps handling it.

    Attributes:
        wanted: bytes the segment needed.
        free: bytes free in :data:`SHM_DIR` when it failed (``None``: unknown).
        total: the directory's size in bytes (``None``: unknown).
    """

    def __init__(self, errno_: int, wanted: int, free: int | None, total: int | None,
                 what: str, cause: str) -> None:
        self.wanted, self.free, self.total = wanted, free, total
        size = ("of unknown size" if total is None or free is None
                else f"{_mib(free)} free of {_mib(total)}")
        super().__init__(errno_, f"cannot reserve {_mib(wanted)} of shared memory for {what} "
                                 f"in {SHM_DIR} ({size}): {cause}. Give it more room "
                                 f"(docker: --shm-size=1g; or set TSB_SHM_DIR to a bigger "
                                 f"tmpfs)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def shm_space() -> tuple[int, int] | None:
    """``(free, total)`` bytes of :data:`SHM_DIR`'s filesystem, or None if unknown."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:  # missing, or not ours to read
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of the file now (the seam tests fail on purpose)."""
    os.posix_fallocate(fd, 0, size)


def new_name(kind: str) -> str:
    """A fresh segment name for this process: ``tsb-<pid>-<kind>-<random>``."""
    return f"tsb-{os.getpid()}-{kind}-{secrets.token_hex(6)}"


def dead_creators(root: str, pattern: re.Pattern[str]) -> list[str]:
    """This user's entries of ``root`` whose name matches ``pattern`` and whose
    creator (the pid in its first group) is dead: what a sweep may remove."""
    try:
        names = os.listdir(root)
    except OSError:  # pragma: no cover
        return []
    uid = os.getuid()
    found: list[str] = []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid == uid:
                found.append(path)
        except OSError:
            continue
    return found


def sweep_stale() -> list[str]:
    """Unlink every ``tsb-*`` segment or doorbell whose creator is dead. Returns their names."""
    removed: list[str] = []
    for path in dead_creators(SHM_DIR, _NAME):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


def unlink_own() -> list[str]:
    """Unlink every ``tsb-<this pid>-*`` segment and doorbell. Returns their names.

    For a process about to exit without running finalizers (``os._exit``
    once its parent died): what it created must not outlive it. Mappings
    stay valid, so a thread still using one does not fault.
    """
    prefix = f"tsb-{os.getpid()}-"
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:  # pragma: no cover
        return removed
    for name in names:
        if name.startswith(prefix) and _NAME.fullmatch(name) is not None:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _sweep_once() -> None:
    global _swept
    with _sweep_lock:
        if not _swept:
            _swept = True
            sweep_stale()


def _check_name(name: str) -> str:
    if _NAME.fullmatch(name) is None:
        raise ValueError(f"not a shared-memory segment name of ours: {name!r}")
    return os.path.join(SHM_DIR, name)


def _flags(populate: bool) -> int:
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Segment:
    """A mapping of one ``/dev/shm`` file. The creator owns it and unlinks it.

    Use :meth:`create` or :meth:`attach`. ``buf`` is a writable memoryview of
    the whole mapping. Mappings stay valid after the file is unlinked, so a
    peer holding a view never faults.
    """

    def __init__(self, name: str, mm: mmap.mmap, *, owner: bool) -> None:
        self.name = name
        self.size = len(mm)
        self.owner = owner
        self._mm = mm
        self.buf = memoryview(mm)
        path = os.path.join(SHM_DIR, name)
        # The creator unlinks at close, or at exit if nobody closed it.
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @property
    def mmap(self) -> mmap.mmap:
        """The underlying mapping."""
        return self._mm

    @classmethod
    def create(cls, kind: str, size: int, *, populate: bool = False,
               what: str = "a segment") -> Segment:
        """Create and map a fresh segment of ``size`` bytes (zeroed), its space reserved.

        The first creation in a process sweeps the leftovers of dead creators.
        ``populate`` faults every page in now (``MAP_POPULATE``) rather than
        on first touch: for a ring, whose first lap would otherwise pay a
        fault per 4 KiB written (4x the cost of a 280 KiB record).

        Raises:
            ShmSpaceError: no room in :data:`SHM_DIR` for ``size`` bytes (an
                ``OSError`` naming ``what`` and the directory's size; never a
                SIGBUS later, on a write).
            OSError: the file could not be made (permissions, a full inode table).
        """
        _sweep_once()
        name = new_name(kind)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            try:
                _reserve(fd, size)
            except OSError as exc:
                free, total = shm_space() or (None, None)
                raise ShmSpaceError(exc.errno or errno.ENOSPC, size, free, total, what,
                                    exc.strerror or str(exc)) from exc
            mm = mmap.mmap(fd, size, flags=_flags(populate))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str, *, min_size: int = 0, populate: bool = False) -> Segment:
        """Map an existing segment by name (``populate``: map every page now).

        Raises:
            ValueError: the name is not one of ours, or the file is not a
                regular file of this user at least ``min_size`` long.
            FileNotFoundError: no such segment (its creator closed it).
        """
        path = _check_name(name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError(f"segment {name!r} is not a regular file of this user")
            if st.st_size < max(min_size, 1):
                raise ValueError(f"segment {name!r} is {st.st_size} bytes, expected "
                                 f">= {min_size}")
            mm = mmap.mmap(fd, st.st_size, flags=_flags(populate))
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name (the creator's job; mappings stay valid). Idempotent."""
        if self._unlink is not None:
            self._unlink()

    def close(self) -> None:
        """Unlink (if the creator) and unmap, unless views are still out (then the GC unmaps)."""
        self.unlink()
        self.buf.release()
        try:
            self._mm.close()
        except BufferError:  # a peer's view still uses it: unmapped when that dies
            pass


def make_fifo(segment: str, suffix: str) -> str:
    """Create the doorbell ``<segment>.<suffix>`` (mode 0600) and return its name."""
    name = f"{segment}.{suffix}"
    path = _check_name(name)
    os.mkfifo(path, 0o600)
    return name


def open_fifo(name: str) -> int:
    """Open doorbell ``name`` read-write and non-blocking (never ENXIO, never EOF).

    Raises:
        ValueError: the file is not a FIFO of this user.
        FileNotFoundError: no such doorbell.
    """
    path = _check_name(name)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise ValueError(f"doorbell {name!r} is not a FIFO of this user")
    return fd
