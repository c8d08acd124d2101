"""Which optimiser, in which coordinates, for batched relaxation: gradient evaluations to geomeTRIC's
default criteria on a cheap surface with a molecule's shape (MMFF94, RDKit), from ETKDG conformers.

    python benchmarks/relax_optimisers.py [--molecules 12] [--conformers 2]

Each conformer is relaxed three ways, every evaluation counted, all to the same five criteria
(geomeTRIC's GAU set: energy change, gradient rms and max, step rms and max):

- geomeTRIC in TRIC internal coordinates (``pyscf_ipu.optimize.ConformerOptimizer``, what
  ``--relax dft`` uses);
- geomeTRIC's own optimiser in Cartesian coordinates (``coordsys cart``): the coordinates' share;
- scipy's L-BFGS in Cartesians, the first-order quasi-Newton of the ML-potential relaxers
  (optax's ``lbfgs`` is the same method), stopped at the first iterate that meets the criteria.

The molecules are QM9's with 9 heavy atoms from index 120000 on, and paracetamol.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import numpy as np

KCAL_PER_HARTREE = 627.509474
BOHR_ANGSTROM = 0.529177210903


def surface(smiles: str, conformers: int):
    """(symbols, starts in Bohr, energy-and-gradient function in Hartree and Bohr) of MMFF94."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    params = AllChem.ETKDGv3()
    params.randomSeed = 7
    ids = list(AllChem.EmbedMultipleConfs(mol, conformers, params))
    properties = AllChem.MMFFGetMoleculeProperties(mol)
    field = AllChem.MMFFGetMoleculeForceField(mol, properties, confId=ids[0])

    def evaluate(bohr: np.ndarray):
        x = (bohr * BOHR_ANGSTROM).ravel().tolist()
        energy = field.CalcEnergy(x) / KCAL_PER_HARTREE
        gradient = np.array(field.CalcGrad(x)).reshape(-1, 3) / KCAL_PER_HARTREE * BOHR_ANGSTROM
        return energy, gradient

    starts = [np.array(mol.GetConformer(i).GetPositions()) / BOHR_ANGSTROM for i in ids]
    return [a.GetSymbol() for a in mol.GetAtoms()], starts, evaluate


def tric(symbols, start, evaluate) -> int:
    from pyscf_ipu.molecule import Molecule, validate
    from pyscf_ipu.optimize import ConformerOptimizer
    from pyscf.data.elements import charge

    molecule = validate(Molecule(np.array([charge(s) for s in symbols]), start))
    optimizer = ConformerOptimizer(molecule)
    while (x := optimizer.proposal()) is not None:
        optimizer.tell(*evaluate(x))
    return optimizer.evaluations if not optimizer.failure else -optimizer.evaluations


def cartesian(symbols, start, evaluate) -> int:
    import geometric.molecule
    from geometric.internal import CartesianCoordinates
    from geometric.optimize import Optimizer, OPT_STATE
    from geometric.params import OptParams

    from pyscf_ipu.config import Criteria
    from pyscf_ipu.optimize import _Engine

    described = geometric.molecule.Molecule()
    described.elem = list(symbols)
    described.xyzs = [start * BOHR_ANGSTROM]
    engine = _Engine(described)
    opt = Optimizer(start.ravel().copy(), described, CartesianCoordinates(described), engine, None,
                    OptParams(maxiter=300, **Criteria().params()), print_info=False)  # fmt: skip
    count = 0
    while True:
        engine.answer = (opt.X, *evaluate(opt.X.reshape(-1, 3)))
        opt.calcEnergyForce()
        opt.prepareFirstStep() if count == 0 else opt.evaluateStep()
        count += 1
        if opt.state in (OPT_STATE.CONVERGED, OPT_STATE.FAILED):
            return count if opt.state == OPT_STATE.CONVERGED else -count
        opt.step()
        while opt.state == OPT_STATE.SKIP_EVALUATION:
            opt.step()


def lbfgs(symbols, start, evaluate) -> int:
    """scipy's L-BFGS, every evaluation (line searches included) counted, stopped at the first
    evaluated point that meets the five criteria against the previous one."""
    from scipy.optimize import minimize

    from pyscf_ipu.config import Criteria

    criteria = Criteria()
    seen = []

    class Done(Exception):
        pass

    def objective(x):
        energy, gradient = evaluate(x.reshape(-1, 3))
        if seen:
            e0, x0 = seen[-1]
            step = (x - x0).reshape(-1, 3) * BOHR_ANGSTROM
            if (abs(energy - e0) < criteria.energy and np.sqrt(np.mean(gradient**2)) < criteria.grms
                    and np.abs(gradient).max() < criteria.gmax and np.sqrt(np.mean(step**2)) < criteria.drms
                    and np.abs(step).max() < criteria.dmax):  # fmt: skip
                seen.append((energy, x))
                raise Done
        seen.append((energy, x.copy()))
        return energy, gradient.ravel()

    try:
        minimize(objective, start.ravel(), jac=True, method="L-BFGS-B", options={"maxiter": 1000, "gtol": 0, "ftol": 0})
    except Done:
        return len(seen)
    return -len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--molecules", type=int, default=12)
    parser.add_argument("--conformers", type=int, default=2)
    args = parser.parse_args()
    from pyscf_ipu.qm9 import iter_qm9

    smiles = [r.smiles for r in itertools.islice(iter_qm9(9, start=120000), args.molecules - 1)]
    smiles.append("CC(=O)Nc1ccc(O)cc1")
    counts = {"tric": [], "cartesian": [], "lbfgs": []}
    for s in smiles:
        symbols, starts, evaluate = surface(s, args.conformers)
        for start in starts:
            row = {name: fn(symbols, start, evaluate) for name, fn in
                   (("tric", tric), ("cartesian", cartesian), ("lbfgs", lbfgs))}  # fmt: skip
            for name, value in row.items():
                counts[name].append(value)
            print(f"{s:24s} " + " ".join(f"{k} {v:5d}" for k, v in row.items()), flush=True)
    print("| optimiser, coordinates | converged | evaluations: median | mean | max |")
    print("|---|---|---|---|---|")
    for name, values in counts.items():
        done = [v for v in values if v > 0]
        print(f"| {name} | {len(done)}/{len(values)} | {statistics.median(done):.0f} | {statistics.mean(done):.1f} | "
              f"{max(done)} |")  # fmt: skip


if __name__ == "__main__":
    main()
