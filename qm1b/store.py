"""Crash-safe HDF5 storage of qm1b records: writer, reader, Parquet export and summary.

Crash safety
------------
A run must never lose or corrupt what it wrote: the generator may be SIGKILLed at any moment, also
in the middle of an HDF5 write, and ``--resume`` must then continue with nothing duplicated and
nothing lost (at most the batch in flight is recomputed).  HDF5 has no journal, so a process that
dies inside a write or a flush can leave a file unreadable.  Hence **a final file is never opened
for writing**; every file is written whole under a temporary name and then published atomically:

1. A shard's final store is one HDF5 file ``DIR/shard-{i:05d}-of-{n:05d}.h5`` (layout below).
2. Each committed batch becomes its own small "part" file
   ``DIR/shard-{i:05d}-of-{n:05d}.parts/part-{k:06d}.h5`` with the same layout.  It is written to
   ``part-{k:06d}.h5.tmp``, closed, fsync'ed, ``os.replace``d to its final name and the folder is
   fsync'ed: a part exists completely or not at all.  Parts are numbered in commit order.
3. ``ShardWriter.close()`` and :func:`compact` merge the shard file (if any) and its parts, in
   order, into ``shard-....h5.tmp``, fsync it, ``os.replace`` it over the shard file, then delete the
   merged parts.  The shard file's ``merged_parts`` attribute lists every part it contains, so a
   crash between the replace and the deletions duplicates nothing: readers and later merges skip
   the parts listed there, and new parts are numbered after all of them.
4. Leftover ``*.tmp`` files (a write killed half-way) are ignored by readers and removed by the
   next writer (or compaction) of that shard.
5. One writer per shard: ``ShardWriter`` and :func:`compact` hold an exclusive ``flock`` on
   ``DIR/.shard-....h5.lock``.  The kernel drops it when the process dies, so a killed run never
   blocks ``--resume``, while a second live writer of the same shard is refused.

Every file is built in memory (HDF5's core driver) and written to its ``.tmp`` name by Python:
a disk that fills up fails that write cleanly (:class:`StorageError`), where HDF5 writing itself
would keep the broken file open to the end of the process. A merge therefore holds its shard file in
memory once.

Readers list a shard's parts *before* opening its shard file and keep that file open: a merge
running concurrently then either is already visible (its parts are skipped) or not at all.  If
such a merge deletes a part the reader listed before the reader gets to it, reading raises
:class:`ShardChangedError` (open the dataset again; ``open_dataset`` itself retries).

Layout (shard file and part files alike)
----------------------------------------
``records/``: one chunked, gzip-compressed, resizable 1-D dataset per scalar column of
:data:`~qm1b.schema.SCALAR_COLUMNS`, plus ``natoms`` (n,) int32, ``atom_offset`` (n,) int64 (start
of each record's atoms), ``z`` (M,) int8 and ``pos`` (M, 3) float32, M = sum(natoms), and with
``--forces`` ``forces`` (M, 3) float32 (eV/Bohr).
``failures/``: ``input``, ``reason`` (str), ``molecule_id`` (int64), ``conformer_id`` (int32).
File attributes: ``schema_version``, ``settings`` and ``versions`` (JSON strings given by the
caller) and ``merged_parts`` (JSON list of the part numbers merged into this file).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import h5py
import numpy as np

from .schema import (
    QM1B_COLUMNS,
    SCALAR_COLUMNS,
    FORCES_DTYPE,
    SCHEMA_VERSION,
    STRING_DTYPE,
    Failure,
    RecordBatch,
)

SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.(h5|parts)$")
PART_RE = re.compile(r"^part-(\d{6,})\.h5$")  # numbers past 999999 get longer
TMP_SUFFIX = ".tmp"

FAILURE_COLUMNS: dict[str, np.dtype] = {
    "input": STRING_DTYPE,
    "reason": STRING_DTYPE,
    "molecule_id": np.dtype(np.int64),
    "conformer_id": np.dtype(np.int32),
}
RECORD_CHUNK = 16384  # records per HDF5 chunk (at most)
ATOM_CHUNK = 65536  # atoms per HDF5 chunk (at most)
READ_BLOCK = 65536  # records read at a time when streaming
CORRUPT_SUFFIX = ".corrupt"  # an unreadable file, set aside by a resuming writer
GZIP_LEVEL = 4
LIBVER = ("v108", "latest")  # v1.8+ object headers: attributes (merged_parts) may exceed 64 KiB


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
def _writing(directory: Path):
    """Turn a failed write into one :class:`StorageError` that names ``directory`` and the cause."""
    try:
        yield
    except (StorageError, FileExistsError):  # FileExistsError: --out is a file, a usage error
        raise
    except OSError as err:  # HDF5 only builds files in memory (_write_atomically): writes are Python's
        raise StorageError(f"cannot write to {directory}: {_cause(err)}") from err


@contextmanager
def _reading(path: Path):
    """Turn a failed read of ``path`` (an HDF5 file) into a :class:`CorruptFileError` naming it."""
    try:
        yield
    except (ShardChangedError, FileNotFoundError, CorruptFileError):
        raise
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise CorruptFileError(path, err) from err


def _read(f: h5py.File, read: Callable[[h5py.File], object]):
    """``read(f)``, a failure raised as a :class:`CorruptFileError` naming the file."""
    with _reading(Path(f.filename)):
        return read(f)


def _verify(path: Path) -> None:
    """Read every dataset and attribute of one shard or part file; :class:`CorruptFileError` if any fails."""
    with _reading(path), h5py.File(path, "r") as f:
        _attrs(f)
        for group in ("records", "failures"):
            for name in f[group]:
                f[group][name][...]


def set_aside_corrupt(shard: Path) -> list[tuple[Path, Path]]:
    """Rename every unreadable file of ``shard`` (its shard file, its parts) to NAME.corrupt, so that
    their rows count as not done and are computed again; returns (old, new) paths (caller holds the lock)."""
    moved = []
    for path in ([shard] if shard.exists() else []) + [p for _, p in _list_parts(shard)]:
        try:
            _verify(path)
        except CorruptFileError:
            target = path.with_name(path.name + CORRUPT_SUFFIX)
            k = 1
            while target.exists():
                target, k = path.with_name(f"{path.name}{CORRUPT_SUFFIX}{k}"), k + 1
            os.replace(path, target)
            moved.append((path, target))
    if moved:
        _fsync(shard.parent, directory=True)
    return moved



# ----------------------------------------------------------------------------------------- paths


def shard_path(directory: Path | str, shard: int, num_shards: int) -> Path:
    return Path(directory) / f"shard-{shard:05d}-of-{num_shards:05d}.h5"


def parts_dir(shard: Path) -> Path:
    return shard.with_suffix(".parts")


def part_path(shard: Path, k: int) -> Path:
    return parts_dir(shard) / f"part-{k:06d}.h5"


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def _list_parts(shard: Path) -> list[tuple[int, Path]]:
    """(number, path) of every complete part of the shard, in commit order."""
    try:
        names = os.listdir(parts_dir(shard))
    except FileNotFoundError:
        return []
    found = [(int(m[1]), parts_dir(shard) / name) for name in names if (m := PART_RE.match(name))]
    return sorted(found)


def _discover_shards(directory: Path) -> list[Path]:
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
    shards = _discover_shards(Path(directory)) if Path(directory).is_dir() else []
    return _num_shards(shards[0]) if shards else 0


def _num_shards(shard: Path) -> int:
    return int(SHARD_RE.match(shard.name)[2])


# ------------------------------------------------------------------------------ durable writes


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically (and durably) rename a finished file to its final name."""
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(final.parent, directory=True)


def _discard(tmp: Path) -> None:
    """Remove an unfinished temporary file where the file system lets us (a read-only one does not):
    the error that brought us here is the one to report."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def _write_atomically(final: Path, attrs: dict, fill: Callable[[h5py.File], None], sizes, forces: bool) -> None:
    """Build a whole HDF5 file with fill(file) in memory, write it to final + '.tmp', then publish it.

    HDF5 never writes to the disk itself: when a write fails (a full disk), HDF5 keeps the
    half-written file open, reports the failure again whenever one of its objects is freed, and
    crashed the process at exit; a failed ``write`` of the finished image fails cleanly instead.
    """
    with h5py.File(f"{final}.image", "w", driver="core", backing_store=False, libver=LIBVER) as f:
        _create_layout(f, *sizes, forces=forces)
        f.attrs.update(attrs)
        fill(f)
        f.flush()
        image = f.id.get_file_image()
    tmp = _tmp(final)
    try:
        with open(tmp, "wb") as out:
            out.write(image)
        _publish(tmp, final)
    except BaseException:
        _discard(tmp)
        raise


def _remove_tmp_files(shard: Path) -> None:
    """Remove what killed writes left behind (caller holds the shard lock)."""
    _tmp(shard).unlink(missing_ok=True)
    if parts_dir(shard).is_dir():
        for path in parts_dir(shard).glob("*" + TMP_SUFFIX):
            path.unlink(missing_ok=True)


def _on_merge_replaced(shard: Path) -> None:
    """Called between publishing a merged shard file and deleting its parts (a test hook)."""


# ----------------------------------------------------------------------------- HDF5 layout


def _create_layout(f: h5py.File, n_records: int, n_atoms: int, n_failures: int, forces: bool = False) -> None:
    """Empty resizable datasets (``forces`` too if asked); the sizes only choose the chunk shapes."""
    rec = f.create_group("records")
    for name, dtype in SCALAR_COLUMNS.items():
        _create(rec, name, dtype, min(n_records, RECORD_CHUNK))
    _create(rec, "natoms", np.dtype(np.int32), min(n_records, RECORD_CHUNK))
    _create(rec, "atom_offset", np.dtype(np.int64), min(n_records, RECORD_CHUNK))
    _create(rec, "z", np.dtype(np.int8), min(n_atoms, ATOM_CHUNK))
    _create(rec, "pos", np.dtype(np.float32), min(n_atoms, ATOM_CHUNK), width=3)
    if forces:
        _create(rec, "forces", FORCES_DTYPE, min(n_atoms, ATOM_CHUNK), width=3)
    fail = f.create_group("failures")
    for name, dtype in FAILURE_COLUMNS.items():
        _create(fail, name, dtype, min(n_failures, RECORD_CHUNK))


def _create(group: h5py.Group, name: str, dtype, chunk_rows: int, width: int | None = None):
    tail = () if width is None else (width,)
    group.create_dataset(
        name,
        shape=(0, *tail),
        maxshape=(None, *tail),
        dtype=dtype,
        chunks=(max(chunk_rows, 1), *tail),
        compression="gzip",
        compression_opts=GZIP_LEVEL,
        shuffle=not h5py.check_string_dtype(dtype),
    )


def _extend(ds: h5py.Dataset, values: np.ndarray) -> None:
    if len(values):
        start = ds.shape[0]
        ds.resize(start + len(values), axis=0)
        ds[start:] = values


def _append_records(rec: h5py.Group, batch: RecordBatch) -> None:
    first_atom = rec["z"].shape[0]
    for name in SCALAR_COLUMNS:
        _extend(rec[name], batch.columns[name])
    _extend(rec["natoms"], batch.natoms.astype(np.int32))
    _extend(rec["atom_offset"], first_atom + batch.atom_offsets()[:-1])
    _extend(rec["z"], batch.z)
    _extend(rec["pos"], batch.pos)
    if ("forces" in rec) != (batch.forces is not None):
        raise ValueError("forces: a file with a forces column takes only records with forces, and vice versa")
    if batch.forces is not None:
        _extend(rec["forces"], batch.forces)


def _append_failures(fail: h5py.Group, failures: list[Failure]) -> None:
    for name, dtype in FAILURE_COLUMNS.items():
        _extend(fail[name], _as_column([getattr(x, name) for x in failures], dtype))


def _as_column(values: list, dtype: np.dtype) -> np.ndarray:
    if h5py.check_string_dtype(dtype):
        out = np.empty(len(values), dtype)  # object array of str
        out[:] = values
        return out
    return np.asarray(values, dtype)


def _read_column(ds: h5py.Dataset, start: int = 0, stop: int | None = None) -> np.ndarray:
    stop = ds.shape[0] if stop is None else stop
    if h5py.check_string_dtype(ds.dtype):
        out = np.empty(stop - start, STRING_DTYPE)  # object array of str, also when empty
        out[:] = ds.asstr()[start:stop] if stop > start else []
        return out
    return ds[start:stop]


def _read_records(rec: h5py.Group, start: int, stop: int) -> RecordBatch:
    """Records [start, stop) of a file; their atoms are contiguous."""
    natoms = rec["natoms"][start:stop]  # (n,) int32
    a0 = int(rec["atom_offset"][start]) if stop > start else 0
    a1 = a0 + int(natoms.sum(dtype=np.int64))
    columns = {name: _read_column(rec[name], start, stop) for name in SCALAR_COLUMNS}
    forces = rec["forces"][a0:a1] if "forces" in rec else None
    return RecordBatch(columns, natoms, rec["z"][a0:a1], rec["pos"][a0:a1], forces)


def _iter_blocks(f: h5py.File, block: int = READ_BLOCK) -> Iterator[RecordBatch]:
    n = f["records/natoms"].shape[0]
    for start in range(0, n, block):
        yield _read_records(f["records"], start, min(start + block, n))


def _read_failures(f: h5py.File) -> list[Failure]:
    cols = {name: _read_column(f["failures"][name]).tolist() for name in FAILURE_COLUMNS}
    return [Failure(*row) for row in zip(cols["input"], cols["reason"], cols["molecule_id"], cols["conformer_id"])]


def _sizes(f: h5py.File) -> tuple[int, int, int]:
    return f["records/natoms"].shape[0], f["records/z"].shape[0], f["failures/input"].shape[0]


def _attrs(f: h5py.File) -> dict:
    return {
        "schema_version": int(f.attrs["schema_version"]),
        "settings": json.loads(f.attrs["settings"]),
        "versions": json.loads(f.attrs["versions"]),
    }


def _merged_parts(f: h5py.File | None) -> set[int]:
    return set() if f is None else set(json.loads(f.attrs["merged_parts"]))


def _file_attrs(settings: dict, versions: dict, merged_parts: Iterable[int] = ()) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": json.dumps(settings, sort_keys=True),
        "versions": json.dumps(versions, sort_keys=True),
        "merged_parts": json.dumps(sorted(merged_parts)),
    }


# --------------------------------------------------------------------------- shard state


@dataclass
class _ShardState:
    """What is on disk for one shard (read while holding its lock)."""

    shard: Path
    main: Path | None  # the shard file, if it exists
    merged: set[int]  # parts contained in the shard file
    parts: list[tuple[int, Path]]  # unmerged parts, in commit order
    stale: list[Path]  # merged parts still on disk (a merge was killed before deleting them)

    @property
    def files(self) -> list[Path]:
        return ([self.main] if self.main else []) + [p for _, p in self.parts]

    @property
    def next_part(self) -> int:
        return max(self.merged | {k for k, _ in self.parts}, default=-1) + 1


def _shard_state(shard: Path) -> _ShardState:
    all_parts = _list_parts(shard)
    main = shard if shard.exists() else None
    merged = set()
    if main:
        with h5py.File(main, "r") as f:
            merged = _merged_parts(f)
    parts = [(k, p) for k, p in all_parts if k not in merged]
    stale = [p for k, p in all_parts if k in merged]
    return _ShardState(shard, main, merged, parts, stale)


def _delete_stale_parts(state: _ShardState) -> None:
    for path in state.stale:
        path.unlink(missing_ok=True)
    if not state.parts:
        try:
            parts_dir(state.shard).rmdir()
        except OSError:  # absent, or not empty
            pass


def _merge_shard(shard: Path, fallback_attrs: dict | None = None) -> None:
    """Merge the shard file and its unmerged parts into a new shard file (caller holds the lock).

    fallback_attrs: attributes of an empty shard file, written when the shard has no data at all.
    """
    _remove_tmp_files(shard)
    state = _shard_state(shard)
    if state.parts or (state.main is None and fallback_attrs is not None):
        sources = state.files
        attrs = _source_attrs(sources[0]) if sources else dict(fallback_attrs)
        attrs["merged_parts"] = json.dumps(sorted(state.merged | {k for k, _ in state.parts}))
        _write_atomically(shard, attrs, lambda f: _copy_all(f, sources), _total_sizes(sources), _has_forces(sources))
        _on_merge_replaced(shard)
        state = _shard_state(shard)
    _delete_stale_parts(state)


def _source_attrs(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return {k: f.attrs[k] for k in ("schema_version", "settings", "versions")}


def _total_sizes(paths: list[Path]) -> tuple[int, int, int]:
    total = np.zeros(3, dtype=np.int64)
    for path in paths:
        with h5py.File(path, "r") as f:
            total += _sizes(f)
    return tuple(int(x) for x in total)


def _has_forces(paths: list[Path]) -> bool:
    """True if the files have a forces column (all of them or none: one shard, one setting)."""
    found = set()
    for path in paths:
        with h5py.File(path, "r") as f:
            found.add("forces" in f["records"])
    if len(found) > 1:
        raise ValueError(f"{paths[0].parent}: some files have forces and some do not")
    return found == {True}


def _copy_all(dst: h5py.File, sources: list[Path]) -> None:
    for path in sources:
        with h5py.File(path, "r") as src:
            for batch in _iter_blocks(src):
                _append_records(dst["records"], batch)
            _append_failures(dst["failures"], _read_failures(src))


def _scan_keys(paths: list[Path]) -> tuple[set[tuple[int, int]], int, int]:
    """(keys of all records and failures, number of records, number of failures)."""
    keys: set[tuple[int, int]] = set()
    n_records = n_failures = 0
    for path in paths:
        with _reading(path), h5py.File(path, "r") as f:
            for group in ("records", "failures"):
                mol = f[group]["molecule_id"][:].tolist()
                conf = f[group]["conformer_id"][:].tolist()
                keys.update(zip(mol, conf))
            n_records += f["records/natoms"].shape[0]
            n_failures += f["failures/input"].shape[0]
    return keys, n_records, n_failures


# ---------------------------------------------------------------------------------- locking


class _ShardLock:
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


# ----------------------------------------------------------------------------------- writer


def _normalize(obj: dict) -> dict:
    """The dict as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _differing_keys(stored: dict, given: dict) -> list[str]:
    missing = object()
    keys = sorted(set(stored) | set(given))
    return [k for k in keys if stored.get(k, missing) != given.get(k, missing)]


class ShardWriter:
    """Commits batches of records and failures to one shard, each batch atomically (see module doc).

    Usage::

        with ShardWriter(out, shard, num_shards, settings=..., versions=..., resume=args.resume) as w:
            todo = [m for m in molecules if (m.id, c) not in w.done()]
            ...
            w.commit(batch, failures)
        # on normal exit the parts are merged into DIR/shard-....h5; on an exception they stay for --resume
    """

    def __init__(
        self,
        directory: Path | str,
        shard: int = 0,
        num_shards: int = 1,
        *,
        settings: dict,
        versions: dict,
        resume: bool = False,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in [0, {num_shards})")
        self.directory = Path(directory)
        self.path = shard_path(self.directory, shard, num_shards)
        self.settings = _normalize(settings)
        self.versions = _normalize(versions)
        self.set_aside: list[tuple[Path, Path]] = []  # unreadable files renamed by --resume: redone
        with _writing(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = _ShardLock(self.path)
        self._closed = False
        try:
            self._open(resume)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, resume: bool) -> None:
        with _writing(self.directory):
            _remove_tmp_files(self.path)
            if resume:
                self.set_aside = set_aside_corrupt(self.path)
        with _reading(self.path):
            state = _shard_state(self.path)
        _delete_stale_parts(state)
        self._done, self._n_records, self._n_failures = _scan_keys(state.files)
        if state.files:
            if not resume:
                raise FileExistsError(
                    f"{self.path.name} in {self.directory} already holds {self._n_records} records and "
                    f"{self._n_failures} failures: pass --resume to continue it, or choose another --out"
                )
            self._check_stored(_source_attrs(state.files[0]))
        self._next_part = state.next_part

    def _check_stored(self, stored: dict) -> None:
        settings = json.loads(stored["settings"])
        if keys := _differing_keys(settings, self.settings):
            detail = "; ".join(f"{k}: stored {settings.get(k)!r}, given {self.settings.get(k)!r}" for k in keys)
            raise ValueError(
                f"cannot resume {self.path}: settings differ in {', '.join(keys)} ({detail}); "
                "resuming with other settings would mix labels: use the same settings or another --out"
            )
        versions = json.loads(stored["versions"])
        if keys := _differing_keys(versions, self.versions):
            warnings.warn(
                f"resuming {self.path.name} with other package versions ({', '.join(keys)}); "
                "the shard keeps recording the versions it was started with",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ public API

    def done(self) -> set[tuple[int, int]]:
        """(molecule_id, conformer_id) of every committed record and failure (-1: whole molecule)."""
        return set(self._done)

    @property
    def counts(self) -> dict[str, int]:
        """Records and failures in the shard, including those of earlier (resumed) runs."""
        return {"records": self._n_records, "failures": self._n_failures}

    def commit(self, records: RecordBatch | None, failures: Iterable[Failure] = ()) -> None:
        """Validate, then write records and failures as one atomic part file."""
        if self._closed:
            raise RuntimeError(f"commit on closed ShardWriter of {self.path}")
        records = RecordBatch.empty() if records is None else records
        records.validate()
        failures = list(failures)
        _check_failures(failures)
        keys = records.keys() + [f.key for f in failures]
        self._check_new(keys)
        if keys:
            with _writing(self.directory):
                self._write_part(records, failures)
            self._done.update(keys)
            self._n_records += len(records)
            self._n_failures += len(failures)

    def close(self) -> None:
        """Merge the shard file and its parts into the single shard file (atomically)."""
        if self._closed:
            return
        self._closed = True
        try:
            with _writing(self.directory):
                _merge_shard(self.path, _file_attrs(self.settings, self.versions))
        finally:
            self._lock.release()

    def abandon(self) -> None:
        """Release the shard without merging: the parts stay for --resume (or compact)."""
        if not self._closed:
            self._closed = True
            self._lock.release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    # ------------------------------------------------------------------ internals

    def _check_new(self, keys: list[tuple[int, int]]) -> None:
        if len(set(keys)) != len(keys):
            raise ValueError("commit: the same (molecule_id, conformer_id) appears twice in one commit")
        if again := [k for k in keys if k in self._done]:
            raise ValueError(f"commit: already committed (molecule_id, conformer_id): {again[:5]}")

    def _write_part(self, records: RecordBatch, failures: list[Failure]) -> None:
        folder = parts_dir(self.path)
        if not folder.is_dir():
            folder.mkdir()
            _fsync(self.directory, directory=True)
        attrs = _file_attrs(self.settings, self.versions)

        def fill(f: h5py.File) -> None:
            _append_records(f["records"], records)
            _append_failures(f["failures"], failures)

        sizes = (len(records), len(records.z), len(failures))
        _write_atomically(part_path(self.path, self._next_part), attrs, fill, sizes, records.forces is not None)
        self._next_part += 1


def _check_failures(failures: list[Failure]) -> None:
    for x in failures:
        if not isinstance(x, Failure):
            raise TypeError(f"failures must be Failure objects, got {type(x).__name__}")
        if not (isinstance(x.input, str) and isinstance(x.reason, str)):
            raise ValueError(f"Failure input and reason must be str: {x!r}")
        if not (isinstance(x.molecule_id, (int, np.integer)) and isinstance(x.conformer_id, (int, np.integer))):
            raise ValueError(f"Failure molecule_id and conformer_id must be int: {x!r}")
        if x.conformer_id < -1:
            raise ValueError(f"Failure conformer_id must be >= -1: {x!r}")


def compact(directory: Path | str) -> None:
    """Merge the leftover parts of every shard in directory (what close() does), e.g. after a crash."""
    for shard in _discover_shards(Path(directory)):
        lock = _ShardLock(shard)
        try:
            _merge_shard(shard)
        finally:
            lock.release()


# ----------------------------------------------------------------------------------- reader

OPEN_ATTEMPTS = 3


class ShardChangedError(RuntimeError):
    """A part vanished while reading: a writer compacted the shard meanwhile (open it again)."""


@dataclass
class _ShardView:
    """A consistent snapshot of one shard: its open shard file and its unmerged parts."""

    shard: Path
    main: h5py.File | None
    parts: list[Path] = field(default_factory=list)

    @classmethod
    def open(cls, shard: Path) -> _ShardView:
        parts = _list_parts(shard)  # before the shard file: a concurrent merge is seen whole or not at all
        with _reading(shard):
            main = h5py.File(shard, "r") if shard.exists() else None
            merged = _merged_parts(main)
        return cls(shard, main, [p for k, p in parts if k not in merged])

    @property
    def empty(self) -> bool:
        return self.main is None and not self.parts

    def attrs(self) -> dict:
        if self.main is not None:
            with _reading(self.shard):
                return _attrs(self.main)
        with self._open_part(self.parts[0]) as f, _reading(self.parts[0]):
            return _attrs(f)

    def _open_part(self, path: Path) -> h5py.File:
        try:
            with _reading(path):
                return h5py.File(path, "r")
        except FileNotFoundError:
            message = f"{self.shard.name} was compacted while being read: open the dataset again"
            raise ShardChangedError(message) from None

    def files(self) -> Iterator[h5py.File]:
        """The shard file, then each unmerged part in commit order (open while iterated)."""
        if self.main is not None:
            yield self.main
        for path in self.parts:
            with self._open_part(path) as f:
                yield f

    def close(self) -> None:
        if self.main is not None:
            self.main.close()


class Dataset:
    """Every record and failure of a directory of shards (shard files and unmerged parts).

    Records come in shard order, then commit order.  Use as a context manager (or call close()) to
    release the open shard files.
    """

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        for attempt in range(OPEN_ATTEMPTS):  # a writer may compact a shard while we open it
            try:
                self._open()
                return
            except ShardChangedError:
                self.close()
                if attempt == OPEN_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.close()
                raise

    def _open(self) -> None:
        self._views = []
        shards = _discover_shards(self.directory)
        self._views = [v for v in map(_ShardView.open, shards) if not v.empty]
        if not self._views:
            raise FileNotFoundError(
                f"{self.directory} holds no qm1b shards (shard-XXXXX-of-XXXXX.h5 or .parts)"
            )
        self.num_shards = _num_shards(shards[0])
        self.attrs = self._read_attrs()
        self._sizes = np.sum([_read(f, _sizes) for f in self._files()], axis=0)  # records, atoms, failures

    def _files(self) -> Iterator[h5py.File]:
        for view in self._views:
            yield from view.files()

    def _read_attrs(self) -> dict:
        attrs = [(view.shard.name, view.attrs()) for view in self._views]
        first_name, first = attrs[0]
        for name, other in attrs[1:]:
            if keys := _differing_keys(first["settings"], other["settings"]):
                raise ValueError(f"{name} and {first_name} were made with different settings: {keys}")
        if first["schema_version"] > SCHEMA_VERSION:
            raise ValueError(
                f"{first_name} has schema version {first['schema_version']}, this qm1b reads up to {SCHEMA_VERSION}"
            )
        return first

    @property
    def shards(self) -> list[Path]:
        """The shards found (those holding data)."""
        return [v.shard for v in self._views]

    @property
    def unmerged_parts(self) -> int:
        return sum(len(v.parts) for v in self._views)

    def __len__(self) -> int:
        return int(self._sizes[0])

    def close(self) -> None:
        for view in self._views:
            view.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def iter_batches(self, block: int = READ_BLOCK) -> Iterator[RecordBatch]:
        """The records, at most block at a time (batches never span files)."""
        for f in self._files():
            with _reading(Path(f.filename)):
                yield from _iter_blocks(f, block)

    def arrays(self) -> RecordBatch:
        """Every record, concatenated."""
        return RecordBatch.concat(self.iter_batches())

    def column(self, name: str) -> np.ndarray:
        """One per-record column (a SCALAR_COLUMNS name or 'natoms'), (n,), without reading atoms."""
        if name not in SCALAR_COLUMNS and name != "natoms":
            raise KeyError(f"{name!r} is not a per-record column")
        parts = [_read(f, lambda f: _read_column(f["records"][name])) for f in self._files()]
        return np.concatenate(parts)

    def failures(self) -> list[Failure]:
        return [x for f in self._files() for x in _read(f, _read_failures)]

    def records(self) -> Iterator[dict]:
        """One dict per record: the scalars (Python values), z (natoms,), pos (natoms, 3) and, if
        generated with --forces, forces (natoms, 3) eV/Bohr."""
        for batch in self.iter_batches():
            off = batch.atom_offsets()
            cols = {k: v.tolist() for k, v in batch.columns.items()}
            for i in range(len(batch)):
                row = {k: v[i] for k, v in cols.items()}
                row["z"] = batch.z[off[i] : off[i + 1]]
                row["pos"] = batch.pos[off[i] : off[i + 1]]
                if batch.forces is not None:
                    row["forces"] = batch.forces[off[i] : off[i + 1]]
                yield row

    def molecules(self) -> Iterator[tuple[int, RecordBatch]]:
        """(molecule_id, its records) for every molecule with records, by increasing molecule_id."""
        batch = self.arrays()
        mol = batch.columns["molecule_id"]
        order = np.lexsort((batch.columns["conformer_id"], mol))
        bounds = np.flatnonzero(np.diff(mol[order])) + 1
        for group in np.split(order, bounds) if len(order) else []:
            yield int(mol[group[0]]), batch.take(group)

    def to_pandas(self):
        """One row per record: the QM1B columns first, then ours; z and pos as per-row arrays."""
        import pandas as pd

        batch = self.arrays()
        split = batch.atom_offsets()[1:-1]
        data = {k: batch.columns[k] for k in QM1B_COLUMNS if k in SCALAR_COLUMNS}
        data["z"] = list(np.split(batch.z, split)) if len(batch) else []
        data["pos"] = list(np.split(batch.pos, split)) if len(batch) else []
        data.update({k: v for k, v in batch.columns.items() if k not in data})
        if batch.forces is not None:
            data["forces"] = list(np.split(batch.forces, split)) if len(batch) else []
        frame = pd.DataFrame(data)
        ordered = list(QM1B_COLUMNS) + [k for k in SCALAR_COLUMNS if k not in QM1B_COLUMNS]
        return frame[ordered + (["forces"] if batch.forces is not None else [])]


def open_dataset(directory: Path | str) -> Dataset:
    """Open a directory written by ShardWriter (FileNotFoundError if it holds no shards)."""
    return Dataset(directory)


# ----------------------------------------------------------------------------------- export


def _parquet_schema(pa):
    types = {
        "smile": pa.string(),
        "atoms": pa.string(),
        "z": pa.list_(pa.int8()),
        "pos": pa.list_(pa.float32()),  # x0, y0, z0, x1, ... (Bohr)
        "energy": pa.float64(),
        "homo": pa.float64(),
        "lumo": pa.float64(),
        "y": pa.float64(),
        "N": pa.int32(),
        "std": pa.float64(),
    }
    return pa.schema([(name, types[name]) for name in QM1B_COLUMNS])


def _to_arrow(batch: RecordBatch, schema, pa):
    off = batch.atom_offsets().astype(np.int32)  # a batch never exceeds READ_BLOCK records
    arrays = {
        "z": pa.ListArray.from_arrays(pa.array(off), pa.array(batch.z, pa.int8())),
        "pos": pa.ListArray.from_arrays(pa.array(off * 3), pa.array(batch.pos.reshape(-1), pa.float32())),
    }
    for name in QM1B_COLUMNS:
        if name not in arrays:
            arrays[name] = pa.array(batch.columns[name], schema.field(name).type)
    return pa.Table.from_arrays([arrays[n] for n in QM1B_COLUMNS], schema=schema)


def export_parquet(directory: Path | str, path: Path | str) -> Path:
    """Write one Parquet file with exactly the QM1B columns, in order (atomically); the schema's
    metadata holds the dataset's settings and versions as JSON (``qm1b.settings``, ``qm1b.versions``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    tmp = _tmp(path)
    try:
        with open_dataset(directory) as ds:
            # the labels' settings (functional, basis, grid, ...) and versions travel with the columns
            schema = _parquet_schema(pa).with_metadata(
                {f"qm1b.{key}": json.dumps(ds.attrs[key], sort_keys=True) for key in ("settings", "versions")})
            with _writing(path.parent), pq.ParquetWriter(tmp, schema, compression="zstd") as out:
                for batch in ds.iter_batches():
                    if len(batch):
                        out.write_table(_to_arrow(batch, schema, pa))
        with _writing(path.parent):
            _publish(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    return path


# ------------------------------------------------------------------------------------- info


def _stats(x: np.ndarray) -> dict | None:
    if not len(x):
        return None
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max())}


def _throughput(seconds: np.ndarray) -> dict | None:
    """Conformers per hour of one generator process, from the per-record wall times.

    Shards run in parallel add their hours, so this is the rate per worker, not of the whole run.
    """
    total = float(np.sum(seconds, dtype=np.float64))
    if not len(seconds) or total <= 0:
        return None
    return {
        "conformers_per_hour_per_worker": 3600.0 * len(seconds) / total,
        "seconds_per_conformer": total / len(seconds),
        "worker_hours": total / 3600.0,
    }


def info(directory: Path | str) -> dict:
    """Counts, convergence, failure reasons and label statistics of a dataset (JSON-serializable)."""
    with open_dataset(directory) as ds:
        names = ("energy", "homo", "lumo", "y", "std", "converged", "iterations", "seconds", "molecule_id", "natoms")
        col = {k: ds.column(k) for k in names}
        failures = ds.failures()
        n = len(ds)
        labels = {"energy_per_atom": _stats(col["energy"] / col["natoms"])}
        labels.update({k: _stats(col[k]) for k in ("homo", "lumo", "y", "std")})
        return {
            "records": n,
            "failures": len(failures),
            "molecules": int(len(np.unique(col["molecule_id"]))),
            "failed_molecules": len({x.molecule_id for x in failures if x.conformer_id == -1}),
            "shards": len(ds.shards),
            "num_shards": ds.num_shards,
            "unmerged_parts": ds.unmerged_parts,
            "convergence_rate": float(col["converged"].mean()) if n else None,
            "failure_reasons": dict(Counter(x.reason for x in failures).most_common()),
            "labels": labels,
            "iterations": {
                "mean": float(col["iterations"].mean()) if n else None,
                "max": int(col["iterations"].max()) if n else None,
            },
            "throughput": _throughput(col["seconds"]),
            "settings": ds.attrs["settings"],
            "versions": ds.attrs["versions"],
            "schema_version": ds.attrs["schema_version"],
        }
