"""Exports of a dataset: Parquet with the QM1B column names, and extended XYZ for ASE and the MLIP trainers."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pyscf_ipu.geometries import extxyz_frame
from pyscf_ipu.units import BOHR_PER_ANGSTROM

from ..schema import QM1B_COLUMNS, RecordBatch
from .files import discard, publish, temporary, writing
from .reader import open_dataset


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


@contextmanager
def _published(path: Path):
    """The temporary path to write ``path``'s content to; published as ``path`` when the block ends
    without an error, discarded otherwise."""
    tmp = temporary(path)
    try:
        yield tmp
        with writing(path.parent):
            publish(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def export_parquet(directory: Path | str, path: Path | str) -> Path:
    """Write one Parquet file with exactly the QM1B columns, in order (atomically); the schema's
    metadata holds the dataset's settings and versions as JSON (``qm1b.settings``, ``qm1b.versions``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    with _published(path) as tmp, open_dataset(directory) as ds:
        # the labels' settings (functional, basis, grid, ...) and versions travel with the columns
        schema = _parquet_schema(pa).with_metadata(
            {f"qm1b.{key}": json.dumps(ds.attrs[key], sort_keys=True) for key in ("settings", "versions")})
        with writing(path.parent), pq.ParquetWriter(tmp, schema, compression="zstd") as out:
            for batch in ds.iter_batches():
                if len(batch):
                    out.write_table(_to_arrow(batch, schema, pa))
    return path


def export_extxyz(directory: Path | str, path: Path | str, frames: bool = False) -> Path:
    """Write the records (or, with ``frames``, the trajectory frames) as one extended XYZ file
    (atomically): positions in Angstrom; ``energy`` (eV) and ``forces`` (eV/Angstrom, where the dataset
    has them) under the keys ASE reads as a calculator's results and MACE and NequIP train on; the
    SMILES, ids, step, HOMO, LUMO and gap (eV) beside them. ValueError where ``frames`` asks for
    frames a dataset does not have."""
    from pyscf.data.elements import ELEMENTS

    path = Path(path)
    written = 0
    with _published(path) as tmp, open_dataset(directory) as ds, writing(path.parent), open(tmp, "w") as out:
        for batch in ds.frames() if frames else ds.iter_batches():
            off, cols = batch.atom_offsets(), batch.columns
            for i in range(len(batch)):
                atoms = slice(off[i], off[i + 1])
                info = {"smiles": cols["smile"][i], "molecule_id": int(cols["molecule_id"][i]),
                        "conformer_id": int(cols["conformer_id"][i]),
                        **({"step": int(cols["step"][i])} if "step" in cols else {}),
                        **{k: float(cols[k][i]) for k in ("homo", "lumo", "y")}}  # fmt: skip
                forces = None if batch.forces is None else batch.forces[atoms].astype(float) * BOHR_PER_ANGSTROM
                out.write(extxyz_frame([ELEMENTS[z] for z in batch.z[atoms]], batch.pos[atoms] / BOHR_PER_ANGSTROM,
                                       energy_ev=float(cols["energy"][i]), forces_ev_per_angstrom=forces, info=info))
                written += 1
        if frames and not written:
            raise ValueError(f"{directory} holds no trajectory frames: generate them with --relax dft --trajectory")
    return path
