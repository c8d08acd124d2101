"""pyscf-ipu: float32 restricted Kohn-Sham DFT in JAX, with PySCF as host-side integral engine and reference.

The public API::

    from pyscf_ipu import RKSConfig, parse_molecule, run_rks
    result = run_rks(parse_molecule(mol="water"), RKSConfig(xc="b3lyp", basis="sto-3g"))
    result.energy, result.homo, result.lumo, result.gap_ev

Batches of conformers (of molecules of one size bucket): ``method = resolve(config)``, then
``submit_batch(prepare_batch(molecules, method), method).results()``.
"""

from .config import RKSConfig
from .method import Method
from .resolution import resolve
from .geometries import from_xyz, parse_molecule
from .molecule import Molecule, MoleculeError, from_atom_string, from_name
from .results import SCFResult
from .problem import prepare_batch
from .rks import run_rks, submit_batch

__all__ = [
    "Method",
    "Molecule",
    "MoleculeError",
    "RKSConfig",
    "SCFResult",
    "from_atom_string",
    "from_name",
    "from_xyz",
    "parse_molecule",
    "prepare_batch",
    "resolve",
    "run_rks",
    "submit_batch",
]
__version__ = "0.1.0"
