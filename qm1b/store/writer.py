"""Writing a shard: committed batches as atomic part files, merged into the shard file on close."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from ..schema import Failure, RecordBatch
from .files import (
    CORRUPT_SUFFIX, CorruptFileError, ShardLock, discover_shards, fsync, list_parts, reading,
    remove_tmp_files,
)
from .files import write_atomically, writing, part_path, parts_dir, shard_path
from .layout import (
    append_failures, append_records, file_layout, read_attrs, differing_keys, new_attrs, normalized, iter_blocks,
    read_merged_parts, read_failures, read_sizes,
)


def _on_merge_replaced(shard: Path) -> None:
    """Called between publishing a merged shard file and deleting its parts (a test hook)."""


def _verify(path: Path) -> None:
    """Read every dataset and attribute of one shard or part file; :class:`CorruptFileError` if any fails."""
    with reading(path), h5py.File(path, "r") as f:
        read_attrs(f)
        for group in f:
            for name in f[group]:
                f[group][name][...]


def set_aside_corrupt(shard: Path) -> list[tuple[Path, Path]]:
    """Rename every unreadable file of ``shard`` (its shard file, its parts) to NAME.corrupt, so that
    their rows count as not done and are computed again; returns (old, new) paths (caller holds the lock)."""
    moved = []
    for path in ([shard] if shard.exists() else []) + [p for _, p in list_parts(shard)]:
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
        fsync(shard.parent, directory=True)
    return moved


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
    all_parts = list_parts(shard)
    main = shard if shard.exists() else None
    merged = set()
    if main:
        with h5py.File(main, "r") as f:
            merged = read_merged_parts(f)
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
    remove_tmp_files(shard)
    state = _shard_state(shard)
    if state.parts or (state.main is None and fallback_attrs is not None):
        sources = state.files
        attrs = _source_attrs(sources[0]) if sources else dict(fallback_attrs)
        attrs["merged_parts"] = json.dumps(sorted(state.merged | {k for k, _ in state.parts}))
        write_atomically(shard, attrs, lambda f: _copy_all(f, sources), _total_sizes(sources), _layout(sources))
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
            total += read_sizes(f)
    return tuple(int(x) for x in total)


def _layout(paths: list[Path]) -> frozenset[str]:
    """The optional datasets of any of the files (those of one shard share them; a file of failures
    alone may lack one, and copying records into a file that lacks their columns fails)."""
    found: frozenset[str] = frozenset()
    for path in paths:
        with h5py.File(path, "r") as f:
            found |= file_layout(f)
    return found


def _copy_all(dst: h5py.File, sources: list[Path]) -> None:
    for path in sources:
        with h5py.File(path, "r") as src:
            for batch in iter_blocks(src):
                append_records(dst["records"], batch)
            append_failures(dst["failures"], read_failures(src))
            for batch in iter_blocks(src, group="frames"):
                append_records(dst["frames"], batch)


def _scan_keys(paths: list[Path]) -> tuple[set[tuple[int, int]], int, int]:
    """(keys of all records and failures, number of records, number of failures)."""
    keys: set[tuple[int, int]] = set()
    n_records = n_failures = 0
    for path in paths:
        with reading(path), h5py.File(path, "r") as f:
            for group in ("records", "failures"):
                mol = f[group]["molecule_id"][:].tolist()
                conf = f[group]["conformer_id"][:].tolist()
                keys.update(zip(mol, conf))
            n_records += f["records/natoms"].shape[0]
            n_failures += f["failures/input"].shape[0]
    return keys, n_records, n_failures


class ShardWriter:
    """Commits batches of records and failures to one shard, each batch atomically (see module doc).

    Usage::

        with ShardWriter(out, shard, num_shards, settings=..., versions=..., resume=args.resume) as w:
            todo = [m for m in molecules if (m.id, c) not in w.done()]
            ...
            w.commit(batch, failures)
        # on normal exit the parts are merged into DIR/shard-....h5; on an exception they stay for --resume

    On resume, the stored ``settings`` must equal the given ones but for ``ignored_settings``: keys
    that earlier versions recorded and that no longer define a label.
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
        ignored_settings: tuple[str, ...] = (),
        layout: frozenset[str] = frozenset(),
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in [0, {num_shards})")
        self.directory = Path(directory)
        self.path = shard_path(self.directory, shard, num_shards)
        self.settings = normalized(settings)
        self.versions = normalized(versions)
        self.ignored_settings = frozenset(ignored_settings)  # stored by older versions; never define a label
        self.layout = frozenset(layout)  # the optional datasets of every file it writes (layout.create_layout)
        self.set_aside: list[tuple[Path, Path]] = []  # unreadable files renamed by --resume: redone
        with writing(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = ShardLock(self.path)
        self._closed = False
        try:
            self._open(resume)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, resume: bool) -> None:
        with writing(self.directory):
            remove_tmp_files(self.path)
            if resume:
                self.set_aside = set_aside_corrupt(self.path)
        with reading(self.path):
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
        settings = {k: v for k, v in json.loads(stored["settings"]).items() if k not in self.ignored_settings}
        if keys := differing_keys(settings, self.settings):
            detail = "; ".join(f"{k}: stored {settings.get(k)!r}, given {self.settings.get(k)!r}" for k in keys)
            raise ValueError(
                f"cannot resume {self.path}: settings differ in {', '.join(keys)} ({detail}); "
                "resuming with other settings would mix labels: use the same settings or another --out"
            )
        versions = json.loads(stored["versions"])
        if keys := differing_keys(versions, self.versions):
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

    def commit(self, records: RecordBatch | None, failures: Iterable[Failure] = (), frames: RecordBatch | None = None
               ) -> None:  # fmt: skip
        """Validate, then write records, failures and trajectory frames (records with a ``step``
        column and forces) as one atomic part file."""
        if self._closed:
            raise RuntimeError(f"commit on closed ShardWriter of {self.path}")
        records = RecordBatch.empty() if records is None else records
        records.validate()
        if frames is not None:
            frames.validate()
        failures = list(failures)
        _check_failures(failures)
        keys = records.keys() + [f.key for f in failures]
        self._check_new(keys)
        if keys or (frames is not None and len(frames)):
            with writing(self.directory):
                self._write_part(records, failures, frames)
            self._done.update(keys)
            self._n_records += len(records)
            self._n_failures += len(failures)

    def close(self) -> None:
        """Merge the shard file and its parts into the single shard file (atomically)."""
        if self._closed:
            return
        self._closed = True
        try:
            with writing(self.directory):
                _merge_shard(self.path, new_attrs(self.settings, self.versions))
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

    def _write_part(self, records: RecordBatch, failures: list[Failure], frames: RecordBatch | None) -> None:
        folder = parts_dir(self.path)
        if not folder.is_dir():
            folder.mkdir()
            fsync(self.directory, directory=True)
        attrs = new_attrs(self.settings, self.versions)

        def fill(f: h5py.File) -> None:
            append_records(f["records"], records)
            append_failures(f["failures"], failures)
            if frames is not None:
                append_records(f["frames"], frames)

        sizes = (len(records), len(records.z), len(failures))
        layout = self.layout | (records.layout if len(records) else frozenset()) | (
            {"frames"} if frames is not None else frozenset())  # fmt: skip
        write_atomically(part_path(self.path, self._next_part), attrs, fill, sizes, layout)
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
    for shard in discover_shards(Path(directory)):
        lock = ShardLock(shard)
        try:
            _merge_shard(shard)
        finally:
            lock.release()
