"""Batched DFT geometry optimisation against PySCF with geomeTRIC, from the same starting geometries.

    python benchmarks/relax.py [--smiles S ...] [--conformers 2] [--preset qm1b] [--basis B] [--out DIR]
                               [--sides pyscf ours] [--generate-options "--integrals jax"]

Each molecule's ETKDG conformers (the generator's embedding, seed 1) are the starting geometries of
both sides, written to ``DIR/start.xyz``. At a preset's level (``qm1b``: B3LYP5, grid level 0,
STO-3G; ``--basis`` another basis), where both sides fit the density beyond a minimal basis (PySCF's
``density_fit()`` in the same fitting basis, and our ``--jk auto``):

- PySCF: each conformer in a fresh process, the same method as PySCF runs it
  (:func:`pyscf_ipu.reference.pyscf_method`: the functional through libxc, the grid level, its
  dispersion; ``conv_tol`` its default) and its gradient with ``grid_response = True``, relaxed by
  ``pyscf.geomopt.geometric_solver`` at geomeTRIC's default criteria and step limit (100). The
  process's wall time is the conformer's.
- ours: one fresh ``qm1b generate --geometries DIR/start.xyz --relax dft --trajectory`` for all of
  them, every other option at the generator's default (or as ``--generate-options`` sets it: the
  GPU's path forced on a CPU is ``--integrals jax``); a conformer's time is the process's wall time
  over the conformers.

Each side's results are kept in ``DIR`` as it finishes a conformer, and a later run with the same
``DIR`` reuses them (``--sides`` picks what runs). Reported per conformer: converged, steps, final
energy, the energy difference and the RMSD after alignment (where both reach the same minimum:
the same bonds), and seconds. Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 for both.
``--profile K`` instead times the parts of a step of ours on the first K conformers.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

# two QM9 molecules with 9 heavy atoms (indices 120000 and 120003) and paracetamol (11)
MOLECULES = ("CC1CC(=O)N1CCO", "CC1OC(=O)C1CCO", "CC(=O)Nc1ccc(O)cc1")
HARTREE_EV = 27.211386245988
BOHR_ANGSTROM = 0.529177210903


def starting_geometries(smiles: list[str], conformers: int) -> list:
    from qm1b.conformers import embed_conformers

    return [c for i, s in enumerate(smiles) for c in embed_conformers(s, conformers, 1, i)]


def write_xyz(molecules, path: Path) -> None:
    lines = []
    for m in molecules:
        lines += [str(m.natom), m.name]
        lines += [f"{s} {x:.10f} {y:.10f} {z:.10f}" for s, (x, y, z) in zip(m.symbols, m.positions * BOHR_ANGSTROM)]
    path.write_text("\n".join(lines) + "\n")


def level_config(preset: str, basis: str):
    """The run's :class:`~pyscf_ipu.config.RKSConfig`: ``preset``'s level at ``basis``, the density
    fitted where ours is by default (``--jk auto``)."""
    from pyscf_ipu.config import RKSConfig
    from qm1b.presets import preset_settings

    return RKSConfig(**{**preset_settings(preset), "basis": basis, "jk": "auto", "integrals": "auto"})


def pyscf_side(xyz_frame: str, preset: str, basis: str) -> dict:
    """A child process: one conformer relaxed by PySCF with geomeTRIC at ``preset``'s level (density
    fitted, as ours is by default, at a basis beyond the minimal ones)."""
    import logging

    from pyscf.geomopt import geometric_solver

    from pyscf_ipu.molecule import from_atom_string
    from pyscf_ipu.reference import pyscf_method
    from pyscf_ipu.resolution import resolve

    logging.getLogger("geometric").setLevel(logging.ERROR)
    mf = pyscf_method(from_atom_string(xyz_frame), resolve(level_config(preset, basis)))
    gradient = mf.nuc_grad_method()
    gradient.grid_response = True
    steps = []
    conv, final = geometric_solver.kernel(gradient, maxsteps=100, callback=lambda env: steps.append(env["energy"]))
    return {"converged": bool(conv), "steps": len(steps), "energy": float(steps[-1]),
            "positions_angstrom": final.atom_coords(unit="Angstrom").tolist()}  # fmt: skip


def child(side: str, argument: str, preset: str, basis: str) -> dict:
    """Run ``side`` in a fresh process; its JSON answer and wall seconds."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", side, argument, preset, basis], capture_output=True,
                         text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "seconds": seconds}


def ours_side(directory: Path, count: int, options: list[str]) -> list[dict]:
    """One fresh generator run over every starting geometry (the file's frames in order are its
    conformers in (molecule id, conformer id) order); per conformer its relaxed record, or for a
    failure its last frame."""
    from qm1b.store import open_dataset

    out = directory / "ours"
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--geometries", str(directory / "start.xyz"),
               "--relax", "dft", "--trajectory", "--out", str(out), "--no-progress", *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"ours failed:\n{done.stderr[-3000:]}")
    print(done.stdout.strip(), flush=True)
    rows: dict[tuple, dict] = {}
    with open_dataset(out) as ds:
        for batch in ds.frames():  # the last frame of each conformer: its final geometry
            off = batch.atom_offsets()
            for i in range(len(batch)):
                key = (int(batch.columns["molecule_id"][i]), int(batch.columns["conformer_id"][i]))
                step = int(batch.columns["step"][i])
                if key not in rows or step >= rows[key]["steps"]:
                    rows[key] = {"converged": False, "steps": step + 1,
                                 "energy": float(batch.columns["energy"][i]) / HARTREE_EV,
                                 "positions_angstrom": (batch.pos[off[i]:off[i + 1]] * BOHR_ANGSTROM).tolist()}  # fmt: skip
        records = ds.arrays()
        for i, key in enumerate(records.keys()):
            rows[key]["converged"] = True
            assert rows[key]["steps"] == int(records.columns["optimizer_steps"][i])
    keys = sorted(rows)
    if len(keys) != count:
        raise RuntimeError(f"ours relaxed {len(keys)} conformers of {count}")
    return [{**rows[k], "seconds": seconds / count} for k in keys]


def profile(molecules, config, count: int) -> None:
    """Where a step's time goes: ``relax`` on the first ``count`` conformers in this process, geomeTRIC
    in it too, each part of a step timed (run it after the benchmark, whose compilation cache it then
    finds)."""
    import collections

    from pyscf_ipu import forces, optimize
    from pyscf_ipu.jk import exact
    from pyscf_ipu.resolution import resolve
    from pyscf_ipu.runtime import default_cache_dir, enable_compilation_cache

    enable_compilation_cache(default_cache_dir() / "jax")
    seconds = collections.Counter()

    def timed(module, name, label):
        function = getattr(module, name)

        def run(*args, **kwargs):
            start = time.perf_counter()
            out = function(*args, **kwargs)
            seconds[label] += time.perf_counter() - start
            return out

        setattr(module, name, run)

    timed(optimize, "_dispatch", "dispatch (integrals, SCF, gradients)")
    timed(optimize, "_collect", "waiting for the SCF, finalisation and gradients")
    timed(exact, "exact_two_electron_gradient", "two-electron gradient")
    timed(forces, "one_electron_gradient", "one-electron gradient")
    timed(forces, "grid_and_nuclei_gradient", "XC and nuclear-repulsion gradient")
    timed(optimize.ConformerOptimizer, "tell", "geomeTRIC's step")
    method = resolve(config.for_forces())
    start = time.perf_counter()
    relaxations = optimize.relax(molecules[:count], method, workers=0)  # geomeTRIC here, where it can be timed
    wall = time.perf_counter() - start
    steps = sum(r.steps for r in relaxations)
    print(f"{count} conformers, {steps} steps, {wall:.1f} s: {wall / steps:.2f} s per conformer and step")
    for label, value in seconds.most_common():
        print(f"  {label:50s} {value / steps:6.3f} s per conformer and step")


def rmsd_after_alignment(a: np.ndarray, b: np.ndarray) -> float:
    """Kabsch: the RMSD of ``a`` and ``b`` (n, 3) after the best rotation and translation."""
    a, b = a - a.mean(0), b - b.mean(0)
    u, _, vt = np.linalg.svd(a.T @ b)
    d = np.sign(np.linalg.det(u @ vt))
    rotation = u @ np.diag([1.0, 1.0, d]) @ vt
    return float(np.sqrt(np.mean(np.sum((a @ rotation - b) ** 2, axis=1))))


def same_bonds(numbers, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the two geometries (Angstrom) have the same bonds: both reached the same minimum's
    basin (1.2 times the sum of RDKit's covalent radii)."""
    from rdkit import Chem

    table = Chem.GetPeriodicTable()
    radii = np.array([table.GetRcovalent(int(z)) for z in numbers])
    limit = 1.2 * (radii[:, None] + radii[None, :])

    def bonds(x):
        return np.linalg.norm(x[:, None] - x[None], axis=-1) < limit

    return bool(np.array_equal(bonds(a), bonds(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smiles", nargs="+", default=list(MOLECULES))
    parser.add_argument("--conformers", type=int, default=2)
    parser.add_argument("--out", default="/tmp/relax_benchmark")
    parser.add_argument("--sides", nargs="+", default=["pyscf", "ours"], choices=["pyscf", "ours"])
    parser.add_argument("--preset", default="qm1b", help="the level of theory of both sides (qm1b.presets)")
    parser.add_argument("--basis", help="another basis than the preset's")
    parser.add_argument("--generate-options", default="", help="more options for our side's qm1b generate")
    parser.add_argument("--profile", type=int, metavar="K", help="time the parts of a step on the first K conformers")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _, argument, preset, basis = args.child
        print(json.dumps(pyscf_side(argument, preset, basis)))
        return
    from qm1b.presets import PRESETS

    if args.preset not in PRESETS:
        parser.error(f"unknown --preset {args.preset!r}: choose one of {', '.join(PRESETS)}")
    basis = args.basis or PRESETS[args.preset].settings["basis"]
    directory = Path(args.out)
    directory.mkdir(parents=True, exist_ok=True)
    molecules = starting_geometries(args.smiles, args.conformers)
    if args.profile:
        return profile(molecules, level_config(args.preset, basis), args.profile)
    write_xyz(molecules, directory / "start.xyz")
    results_file = directory / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {"pyscf": {}, "ours": None}
    if "pyscf" in args.sides:
        for i, m in enumerate(molecules):
            if str(i) in results["pyscf"]:
                continue
            frame = "; ".join(f"{s} {x} {y} {z}" for s, (x, y, z) in zip(m.symbols, m.positions * BOHR_ANGSTROM))
            results["pyscf"][str(i)] = child("pyscf", frame, args.preset, basis)
            print(f"pyscf {i}: {results['pyscf'][str(i)]['steps']} steps, {results['pyscf'][str(i)]['seconds']:.1f} s",
                  flush=True)  # fmt: skip
            results_file.write_text(json.dumps(results))
    if "ours" in args.sides:
        options = ["--preset", args.preset, "--basis", basis, *shlex.split(args.generate_options)]
        results["ours"] = ours_side(directory, len(molecules), options)
        results_file.write_text(json.dumps(results))
    report(molecules, results)


def report(molecules, results: dict) -> None:
    print("| conformer | atoms | PySCF converged | steps | ours converged | steps | E ours - PySCF meV | RMSD A | "
          "PySCF s | ours s | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for i, m in enumerate(molecules):
        theirs, ours = results["pyscf"].get(str(i)), (results["ours"] or [None] * len(molecules))[i]
        if theirs is None or ours is None:
            continue
        a, b = np.array(ours["positions_angstrom"]), np.array(theirs["positions_angstrom"])
        same = same_bonds(m.atomic_numbers, a, b)
        rmsd = f"{rmsd_after_alignment(a, b):.4f}" if same else "other minimum"
        ratio = theirs["seconds"] / ours["seconds"]
        ratios.append(ratio)
        print(f"| {m.name} | {m.natom} | {theirs['converged']} | {theirs['steps']} | {ours['converged']} | "
              f"{ours['steps']} | {(ours['energy'] - theirs['energy']) * HARTREE_EV * 1e3:+.3f} | {rmsd} | "
              f"{theirs['seconds']:.1f} | {ours['seconds']:.1f} | {ratio:.1f}x |")  # fmt: skip
    if ratios:
        print(f"median ratio PySCF / ours: {statistics.median(ratios):.1f}x; "
              f"total {sum(r['seconds'] for r in results['pyscf'].values()):.0f} s against "
              f"{sum(r['seconds'] for r in results['ours']):.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
