"""qm1b: a QM1B-style dataset generator (SMILES -> conformers -> DFT labels -> HDF5 shards).

Read a generated dataset with :func:`open_dataset`; see :mod:`qm1b.store` for the on-disk format.
"""

from .store import open_dataset

__all__ = ["open_dataset"]
