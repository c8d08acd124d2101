"""Reading a directory of shards as one dataset, consistent while a writer merges."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from ..schema import QM1B_COLUMNS, SCALAR_COLUMNS, SCHEMA_VERSION, Failure, RecordBatch
from .files import ShardChangedError, discover_shards, list_parts, num_shards_of, read_with, reading
from .layout import (
    READ_BLOCK, read_attrs, differing_keys, iter_blocks, read_merged_parts, read_column, read_failures, read_sizes,
)


OPEN_ATTEMPTS = 3


@dataclass
class _ShardView:
    """A consistent snapshot of one shard: its open shard file and its unmerged parts."""

    shard: Path
    main: h5py.File | None
    parts: list[Path] = field(default_factory=list)

    @classmethod
    def open(cls, shard: Path) -> _ShardView:
        parts = list_parts(shard)  # before the shard file: a concurrent merge is seen whole or not at all
        with reading(shard):
            main = h5py.File(shard, "r") if shard.exists() else None
            merged = read_merged_parts(main)
        return cls(shard, main, [p for k, p in parts if k not in merged])

    @property
    def empty(self) -> bool:
        return self.main is None and not self.parts

    def attrs(self) -> dict:
        if self.main is not None:
            with reading(self.shard):
                return read_attrs(self.main)
        with self._open_part(self.parts[0]) as f, reading(self.parts[0]):
            return read_attrs(f)

    def _open_part(self, path: Path) -> h5py.File:
        try:
            with reading(path):
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
        shards = discover_shards(self.directory)
        self._views = [v for v in map(_ShardView.open, shards) if not v.empty]
        if not self._views:
            raise FileNotFoundError(
                f"{self.directory} holds no qm1b shards (shard-XXXXX-of-XXXXX.h5 or .parts)"
            )
        self.num_shards = num_shards_of(shards[0])
        self.attrs = self._read_attrs()
        self._sizes = np.sum([read_with(f, read_sizes) for f in self._files()], axis=0)  # records, atoms, failures

    def _files(self) -> Iterator[h5py.File]:
        for view in self._views:
            yield from view.files()

    def _read_attrs(self) -> dict:
        attrs = [(view.shard.name, view.attrs()) for view in self._views]
        first_name, first = attrs[0]
        for name, other in attrs[1:]:
            if keys := differing_keys(first["settings"], other["settings"]):
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
            with reading(Path(f.filename)):
                yield from iter_blocks(f, block)

    def frames(self, block: int = READ_BLOCK) -> Iterator[RecordBatch]:
        """The trajectory frames (``generate --relax dft --trajectory``), at most block at a time:
        records of their own, with a ``step`` column and forces; none for other datasets."""
        for f in self._files():
            with reading(Path(f.filename)):
                yield from iter_blocks(f, block, group="frames")

    def arrays(self) -> RecordBatch:
        """Every record, concatenated."""
        return RecordBatch.concat(self.iter_batches())

    def column(self, name: str) -> np.ndarray:
        """One per-record column (a SCALAR_COLUMNS name or 'natoms'), (n,), without reading atoms."""
        if name not in SCALAR_COLUMNS and name != "natoms":
            raise KeyError(f"{name!r} is not a per-record column")
        parts = [read_with(f, lambda f: read_column(f["records"][name])) for f in self._files()]
        return np.concatenate(parts)

    def failures(self) -> list[Failure]:
        return [x for f in self._files() for x in read_with(f, read_failures)]

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
        ordered = list(QM1B_COLUMNS) + [k for k in batch.columns if k not in QM1B_COLUMNS]
        return frame[ordered + (["forces"] if batch.forces is not None else [])]


def open_dataset(directory: Path | str) -> Dataset:
    """Open a directory written by ShardWriter (FileNotFoundError if it holds no shards)."""
    return Dataset(directory)
