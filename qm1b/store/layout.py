"""The HDF5 layout shared by shard and part files: creating, appending, reading (see the package doc)."""

from __future__ import annotations

import json
from typing import Iterable, Iterator

import h5py
import numpy as np

from pyscf_ipu.config import ADDED_SETTINGS, RENAMED_VALUES

from ..schema import FORCES_DTYPE, OPTIONAL_COLUMNS, SCALAR_COLUMNS, SCHEMA_VERSION, STRING_DTYPE, Failure, RecordBatch


FAILURE_COLUMNS: dict[str, np.dtype] = {
    "input": STRING_DTYPE,
    "reason": STRING_DTYPE,
    "molecule_id": np.dtype(np.int64),
    "conformer_id": np.dtype(np.int32),
}
RECORD_CHUNK = 16384  # records per HDF5 chunk (at most)
ATOM_CHUNK = 65536  # atoms per HDF5 chunk (at most)
READ_BLOCK = 65536  # records read at a time when streaming


GZIP_LEVEL = 4
LIBVER = ("v108", "latest")  # v1.8+ object headers: attributes (merged_parts) may exceed 64 KiB


def create_layout(f: h5py.File, n_records: int, n_atoms: int, n_failures: int, layout: frozenset[str] = frozenset()
                  ) -> None:  # fmt: skip
    """Empty resizable datasets; ``layout`` names the optional ones (:data:`~qm1b.schema.OPTIONAL_COLUMNS`,
    ``forces``) and ``frames``, a group of trajectory frames laid out as records with a ``step``
    column and forces. The sizes only choose the chunk shapes."""
    _create_records(f.create_group("records"), n_records, n_atoms, layout - {"frames", "step"})
    fail = f.create_group("failures")
    for name, dtype in FAILURE_COLUMNS.items():
        _create(fail, name, dtype, min(n_failures, RECORD_CHUNK))
    if "frames" in layout:
        _create_records(f.create_group("frames"), n_records, n_atoms, frozenset({"step", "forces"}))


def _create_records(rec: h5py.Group, n_records: int, n_atoms: int, layout: frozenset[str]) -> None:
    for name, dtype in SCALAR_COLUMNS.items():
        _create(rec, name, dtype, min(n_records, RECORD_CHUNK))
    for name, dtype in OPTIONAL_COLUMNS.items():
        if name in layout:
            _create(rec, name, dtype, min(n_records, RECORD_CHUNK))
    _create(rec, "natoms", np.dtype(np.int32), min(n_records, RECORD_CHUNK))
    _create(rec, "atom_offset", np.dtype(np.int64), min(n_records, RECORD_CHUNK))
    _create(rec, "z", np.dtype(np.int8), min(n_atoms, ATOM_CHUNK))
    _create(rec, "pos", np.dtype(np.float32), min(n_atoms, ATOM_CHUNK), width=3)
    if "forces" in layout:
        _create(rec, "forces", FORCES_DTYPE, min(n_atoms, ATOM_CHUNK), width=3)


def file_layout(f: h5py.File) -> frozenset[str]:
    """The optional datasets of a shard or part file (:func:`create_layout`'s ``layout``)."""
    return _group_layout(f["records"]) | (frozenset({"frames"}) if "frames" in f else frozenset())


def _group_layout(rec: h5py.Group) -> frozenset[str]:
    """The optional datasets of one group of records (:attr:`RecordBatch.layout`'s names)."""
    return frozenset([k for k in OPTIONAL_COLUMNS if k in rec] + (["forces"] if "forces" in rec else []))


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


def append_records(rec: h5py.Group, batch: RecordBatch) -> None:
    if not len(batch):
        return
    stored = _group_layout(rec)
    if batch.layout != stored:
        raise ValueError(f"{rec.name}: the file has the optional columns {sorted(stored)}, the records "
                         f"{sorted(batch.layout)} (generated with other settings)")  # fmt: skip
    first_atom = rec["z"].shape[0]
    for name, values in batch.columns.items():
        _extend(rec[name], values)
    _extend(rec["natoms"], batch.natoms.astype(np.int32))
    _extend(rec["atom_offset"], first_atom + batch.atom_offsets()[:-1])
    _extend(rec["z"], batch.z)
    _extend(rec["pos"], batch.pos)
    if batch.forces is not None:
        _extend(rec["forces"], batch.forces)


def append_failures(fail: h5py.Group, failures: list[Failure]) -> None:
    for name, dtype in FAILURE_COLUMNS.items():
        _extend(fail[name], _as_column([getattr(x, name) for x in failures], dtype))


def _as_column(values: list, dtype: np.dtype) -> np.ndarray:
    if h5py.check_string_dtype(dtype):
        out = np.empty(len(values), dtype)  # object array of str
        out[:] = values
        return out
    return np.asarray(values, dtype)


def read_column(ds: h5py.Dataset, start: int = 0, stop: int | None = None) -> np.ndarray:
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
    columns = {name: read_column(rec[name], start, stop) for name in [*SCALAR_COLUMNS, *OPTIONAL_COLUMNS] if name in rec}
    forces = rec["forces"][a0:a1] if "forces" in rec else None
    return RecordBatch(columns, natoms, rec["z"][a0:a1], rec["pos"][a0:a1], forces)


def iter_blocks(f: h5py.File, block: int = READ_BLOCK, group: str = "records") -> Iterator[RecordBatch]:
    """The records (or the trajectory ``frames``) of a file, at most ``block`` at a time."""
    if group not in f:
        return
    n = f[group]["natoms"].shape[0]
    for start in range(0, n, block):
        yield _read_records(f[group], start, min(start + block, n))


def read_failures(f: h5py.File) -> list[Failure]:
    cols = {name: read_column(f["failures"][name]).tolist() for name in FAILURE_COLUMNS}
    return [Failure(*row) for row in zip(cols["input"], cols["reason"], cols["molecule_id"], cols["conformer_id"])]


def read_sizes(f: h5py.File) -> tuple[int, int, int]:
    return f["records/natoms"].shape[0], f["records/z"].shape[0], f["failures/input"].shape[0]


def read_attrs(f: h5py.File) -> dict:
    return {
        "schema_version": int(f.attrs["schema_version"]),
        "settings": json.loads(f.attrs["settings"]),
        "versions": json.loads(f.attrs["versions"]),
    }


def read_merged_parts(f: h5py.File | None) -> set[int]:
    return set() if f is None else set(json.loads(f.attrs["merged_parts"]))


def new_attrs(settings: dict, versions: dict, merged_parts: Iterable[int] = ()) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": json.dumps(settings, sort_keys=True),
        "versions": json.dumps(versions, sort_keys=True),
        "merged_parts": json.dumps(sorted(merged_parts)),
    }


def normalized(obj: dict) -> dict:
    """The dict as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(obj, sort_keys=True))


def differing_keys(stored: dict, given: dict) -> list[str]:
    """The settings whose values differ, reading a renamed value's old spelling (``RENAMED_VALUES``:
    an older version wrote it) as the current one, and a setting that an older version did not write
    (``ADDED_SETTINGS``) as the value it had then."""
    missing = object()

    def value(settings: dict, key: str):
        v = settings.get(key, ADDED_SETTINGS.get(key, missing))
        return RENAMED_VALUES.get(key, {}).get(v, v) if isinstance(v, str) else v

    keys = sorted(set(stored) | set(given))
    return [k for k in keys if value(stored, k) != value(given, k)]
