"""Crash-safe HDF5 storage of qm1b records.

Modules: :mod:`.layout` (the HDF5 layout of a shard or part file), :mod:`.files` (names, errors,
durable writes, the shard lock), :mod:`.writer` (:class:`ShardWriter`, :func:`compact`),
:mod:`.reader` (:func:`open_dataset`), :mod:`.export` (Parquet) and :mod:`.info` (the summary).

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
``--forces`` (or ``--relax dft``) ``forces`` (M, 3) float32 (eV/Bohr); with ``--relax dft`` also
``optimizer_steps`` (n,) int16.
``frames/`` (``--relax dft --trajectory``): every evaluated geometry of each relaxation, laid out as
``records/``, with ``step`` (n,) int16 (0: the start) and ``forces``; ``molecule_id`` and
``conformer_id`` link a frame to its conformer's record or failure.
``failures/``: ``input``, ``reason`` (str), ``molecule_id`` (int64), ``conformer_id`` (int32).
File attributes: ``schema_version``, ``settings`` and ``versions`` (JSON strings given by the
caller) and ``merged_parts`` (JSON list of the part numbers merged into this file).
"""

from .export import export_extxyz, export_parquet
from .files import CORRUPT_SUFFIX, CorruptFileError, ShardChangedError, StorageError, part_path, shard_count, shard_path
from .info import info
from .reader import Dataset, open_dataset
from .writer import ShardWriter, compact, set_aside_corrupt

__all__ = [
    "CORRUPT_SUFFIX", "CorruptFileError", "Dataset", "ShardChangedError", "ShardWriter", "StorageError",
    "compact", "export_extxyz", "export_parquet", "info", "open_dataset", "part_path", "set_aside_corrupt", "shard_count",
    "shard_path",
]
