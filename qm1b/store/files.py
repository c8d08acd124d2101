"""Store files: their names, their errors, durable atomic writes and the per-shard lock."""

from __future__ import annotations

import fcntl
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import h5py

from .layout import LIBVER, create_layout


SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.(h5|parts)$")
PART_RE = re.compile(r"^part-(\d{6,})\.h5$")  # numbers past 999999 get longer
TMP_SUFFIX = ".tmp"


CORRUPT_SUFFIX = ".corrupt"  # an unreadable file, set aside by a resuming writer


class StorageError(OSError):
    """A directory that cannot be written (full disk, read-only, permissions); nothing already
    published is touched, so a generator's ``--resume`` completes its run once the cause is gone."""


class CorruptFileError(ValueError):
    """A shard or part file that cannot be read (truncated by a copy, damaged by a disk)."""

    def __init__(self, path: Path, cause: BaseException):
        self.path = path
        super().__init__(f"{path} is truncated or corrupt ({_cause(cause)}); "
                         "qm1b generate --resume sets it aside and computes its rows again")


def _cause(err: BaseException) -> str:
    """The operating system's words for ``err`` where it carries an errno (h5py puts it in its text),
    else the first line of its message."""
    number = getattr(err, "errno", None)
    if not number and (found := re.search(r"errno = (\d+)", str(err))):
        number = int(found[1])
    if number:
        return os.strerror(number)
    return str(err).splitlines()[0] if str(err) else type(err).__name__


@contextmanager
def writing(directory: Path):
    """Turn a failed write into one :class:`StorageError` that names ``directory`` and the cause."""
    try:
        yield
    except (StorageError, FileExistsError):  # FileExistsError: --out is a file, a usage error
        raise
    except OSError as err:  # HDF5 only builds files in memory (write_atomically): writes are Python's
        raise StorageError(f"cannot write to {directory}: {_cause(err)}") from err


@contextmanager
def reading(path: Path):
    """Turn a failed read of ``path`` (an HDF5 file) into a :class:`CorruptFileError` naming it."""
    try:
        yield
    except (ShardChangedError, FileNotFoundError, CorruptFileError):
        raise
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise CorruptFileError(path, err) from err


def read_with(f: h5py.File, read: Callable[[h5py.File], object]):
    """``read(f)``, a failure raised as a :class:`CorruptFileError` naming the file."""
    with reading(Path(f.filename)):
        return read(f)


class ShardChangedError(RuntimeError):
    """A part vanished while reading: a writer compacted the shard meanwhile (open it again)."""


def shard_path(directory: Path | str, shard: int, num_shards: int) -> Path:
    return Path(directory) / f"shard-{shard:05d}-of-{num_shards:05d}.h5"


def parts_dir(shard: Path) -> Path:
    return shard.with_suffix(".parts")


def part_path(shard: Path, k: int) -> Path:
    return parts_dir(shard) / f"part-{k:06d}.h5"


def temporary(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def list_parts(shard: Path) -> list[tuple[int, Path]]:
    """(number, path) of every complete part of the shard, in commit order."""
    try:
        names = os.listdir(parts_dir(shard))
    except FileNotFoundError:
        return []
    found = [(int(m[1]), parts_dir(shard) / name) for name in names if (m := PART_RE.match(name))]
    return sorted(found)


def discover_shards(directory: Path) -> list[Path]:
    """Shard file paths (which may not exist yet when a shard only has parts), by shard index."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    found = {}
    for name in os.listdir(directory):
        if m := SHARD_RE.match(name):
            found[(int(m[1]), int(m[2]))] = shard_path(directory, int(m[1]), int(m[2]))
    totals = sorted({n for _, n in found})
    if len(totals) > 1:
        raise ValueError(f"{directory} mixes shards of different --num-shards: {totals}")
    return [found[key] for key in sorted(found)]


def shard_count(directory: Path | str) -> int:
    """n of the shard-i-of-n files (or parts folders) in ``directory``; 0 if it holds none."""
    shards = discover_shards(Path(directory)) if Path(directory).is_dir() else []
    return num_shards_of(shards[0]) if shards else 0


def num_shards_of(shard: Path) -> int:
    return int(SHARD_RE.match(shard.name)[2])


# ------------------------------------------------------------------------------ durable writes


def fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically (and durably) rename a finished file to its final name."""
    fsync(tmp)
    os.replace(tmp, final)
    fsync(final.parent, directory=True)


def discard(tmp: Path) -> None:
    """Remove an unfinished temporary file where the file system lets us (a read-only one does not):
    the error that brought us here is the one to report."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def write_atomically(final: Path, attrs: dict, fill: Callable[[h5py.File], None], sizes, layout: frozenset[str]) -> None:
    """Build a whole HDF5 file (its optional datasets ``layout``: :func:`~qm1b.store.layout.create_layout`)
    with fill(file) in memory, write it to final + '.tmp', then publish it.

    HDF5 never writes to the disk itself: when a write fails (a full disk), HDF5 keeps the
    half-written file open, reports the failure again whenever one of its objects is freed, and
    crashed the process at exit; a failed ``write`` of the finished image fails cleanly instead.
    """
    with h5py.File(f"{final}.image", "w", driver="core", backing_store=False, libver=LIBVER) as f:
        create_layout(f, *sizes, layout)
        f.attrs.update(attrs)
        fill(f)
        f.flush()
        image = f.id.get_file_image()
    tmp = temporary(final)
    try:
        with open(tmp, "wb") as out:
            out.write(image)
        publish(tmp, final)
    except BaseException:
        discard(tmp)
        raise


def remove_tmp_files(shard: Path) -> None:
    """Remove what killed writes left behind (caller holds the shard lock)."""
    temporary(shard).unlink(missing_ok=True)
    if parts_dir(shard).is_dir():
        for path in parts_dir(shard).glob("*" + TMP_SUFFIX):
            path.unlink(missing_ok=True)


class ShardLock:
    """Exclusive flock on DIR/.shard-....h5.lock: one writer (or compaction) per shard. The file holds
    the holder's process id.

    The kernel releases it when the holder dies, so a SIGKILLed run never blocks --resume.
    """

    def __init__(self, shard: Path):
        self.shard = shard
        self.path = shard.parent / f".{shard.name}.lock"
        self._fd: int | None = self._acquire()

    def _acquire(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RuntimeError(
                    f"{self.shard.name} is being written by another process (lock {self.path})"
                ) from None
            if self._is_current(fd):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for people and tests
                return fd
            os.close(fd)  # the previous holder removed the file after we opened it: retry

    def _is_current(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
