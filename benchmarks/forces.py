"""Forces at a larger basis as a user runs them: ``pyscf-ipu run --forces`` against PySCF's gradient.

    python benchmarks/forces.py [--smiles S ...] [--conformers 2] [--basis def2-svp] [--precisions float32 float64]
                                [--xc b3lyp] [--dispersion auto] [--grid-level 0] [--integrals libcint]

Every conformer (RDKit ETKDG, each molecule's own) runs in fresh processes, the sides alternating:

- ours: ``pyscf-ipu run --xyz F --basis B --xc X --dispersion D --grid-level L --integrals I --forces
  --json [--precision P]``, every other option at its default (``--jk auto`` picks density fitting at a
  non-minimal basis; the grid moves with the atoms; the SCF's float64 refinement is in its seconds).
  The run shares one new compilation cache, so a molecule's first conformer compiles and its later
  ones find their programs. "scf" is the run's own seconds (host preparation included),
  "forces" the gradient's;
- PySCF: the same method as PySCF runs it (:func:`pyscf_ipu.reference.pyscf_method`: the functional
  through libxc, the grid level, density fitted in the same fitting basis, ``mf.disp`` for D3(BJ)),
  conv_tol 1e-10, then ``nuc_grad_method()`` with ``grid_response = True`` (what ours differentiates).
  ωB97X-D's own correction is not PySCF's: run it with ``--dispersion none`` here (the correction's
  gradient is checked against Psi4's in ``tests/test_dispersion.py``).

Reported per conformer and side: seconds, the process's peak resident memory, and the largest
|ours - PySCF| component of the gradient. Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 for both
(PySCF's best here), XLA's default.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

DIAZEPAM, KETOPROFEN = "CN1C(=O)CN=C(c2ccccc2)c2cc(Cl)ccc21", "CC(C(=O)O)c1cccc(c1)C(=O)c1ccccc1"


def peak_gb() -> float:
    """This process's peak resident memory in GB (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def ours(xyz: str, basis: str, precision: str, level: list[str]) -> dict:
    """A child process: our command line's JSON, with the process's peak memory; ``level``: the
    functional's, dispersion's and grid's options."""
    import contextlib
    import io

    from pyscf_ipu.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["run", "--xyz", xyz, "--basis", basis, *level, "--forces", "--json", "--precision", precision])
    if code:
        raise SystemExit(code)
    out = json.loads(text.getvalue())
    return {"scf": out["seconds"], "forces": out["forces_seconds"], "peak_gb": peak_gb(), "jk": out["config"]["jk"],
            "iterations": out["iterations"], "refined": (out["refined"] or {}).get("iterations", 0),
            "energy": out["energy_hartree"],
            "gradient": out["gradient_hartree_per_bohr"]}  # fmt: skip


def generated(xyz: str, basis: str, precision: str, level: list[str]) -> dict:
    """A child process: ``qm1b generate --geometries F --forces`` (the batched path: with ``--integrals
    jax``, the GPU's device programs) on one conformer, its stored forces as a gradient; its seconds
    the run's whole wall time (no split into SCF and forces: ``forces`` is the summary's)."""
    import contextlib
    import io

    from pyscf_ipu.units import HARTREE_TO_EV
    from qm1b.cli import main
    from qm1b.store import open_dataset

    out = Path(tempfile.mkdtemp(prefix="generated-")) / "out"
    report = out.parent / "report.json"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["generate", "--geometries", xyz, "--basis", basis, *level, "--forces", "--precision", precision,
                     "--out", str(out), "--no-progress", "--report", str(report)])  # fmt: skip
    seconds = time.perf_counter() - start
    if code:
        raise SystemExit(code)
    (record,) = open_dataset(out).records()
    summary = json.loads(report.read_text())[0]
    return {"scf": seconds, "forces": summary["timings"].get("forces", 0.0), "peak_gb": peak_gb(),
            "jk": summary["method"], "iterations": int(record["iterations"]),
            "gradient": (-np.asarray(record["forces"], float) / HARTREE_TO_EV).tolist()}  # fmt: skip


def pyscf_side(xyz: str, basis: str, xc: str, dispersion: str, grid_level: int) -> dict:
    """A child process: PySCF's density-fitted SCF and its gradient with the grid's response."""
    from pyscf_ipu.config import RKSConfig
    from pyscf_ipu.geometries import from_xyz
    from pyscf_ipu.reference import pyscf_method
    from pyscf_ipu.resolution import resolve

    molecule = from_xyz(xyz)
    # the integral source only lets every functional resolve: PySCF's own integrals are libcint's
    config = RKSConfig(basis=basis, xc=xc, dispersion=dispersion, grid_level=grid_level, jk="df", integrals="auto")
    mf = pyscf_method(molecule, resolve(config))
    mf.conv_tol = 1e-10
    start = time.perf_counter()
    mf.kernel()
    scf = time.perf_counter() - start
    gradients = mf.nuc_grad_method()
    gradients.grid_response = True
    start = time.perf_counter()
    gradient = gradients.kernel()
    return {"scf": scf, "forces": time.perf_counter() - start, "peak_gb": peak_gb(), "converged": bool(mf.converged),
            "energy": float(mf.e_tot), "gradient": gradient.tolist()}  # fmt: skip


def child(argv: list[str], env: dict) -> dict:
    """Run this file as a child process on ``argv``; its last stdout line is its JSON."""
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"child {argv} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def conformers(smiles: str, count: int, directory: Path, tag: str) -> list[Path]:
    """``count`` ETKDG conformers of ``smiles`` (hydrogens added, seed 7) as XYZ files."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    ids = AllChem.EmbedMultipleConfs(mol, numConfs=count, randomSeed=7)
    paths = []
    for k, conf_id in enumerate(ids):
        path = directory / f"{tag}-{k}.xyz"
        path.write_text(Chem.MolToXYZBlock(mol, confId=conf_id))
        paths.append(path)
    return paths


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        kind, *rest = sys.argv[2:]
        if kind in ("ours", "generated"):
            out = (ours if kind == "ours" else generated)(rest[0], rest[1], rest[2], rest[3:])
        else:
            out = pyscf_side(rest[0], rest[1], rest[2], rest[3], int(rest[4]))
        print(json.dumps(out))
        return
    from pyscf_ipu.config import AUTO, RKSConfig

    defaults = RKSConfig()  # pyscf-ipu run's, which ours runs
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smiles", nargs="+", default=[DIAZEPAM, KETOPROFEN])
    parser.add_argument("--conformers", type=int, default=2)
    parser.add_argument("--basis", default="def2-svp")
    parser.add_argument("--precisions", nargs="+", default=["float32", "float64"])
    parser.add_argument("--xc", default=defaults.xc)
    parser.add_argument("--dispersion", default=AUTO)
    parser.add_argument("--grid-level", type=int, default=defaults.grid_level)
    parser.add_argument("--integrals", default=defaults.integrals, help="ours (range-separated functionals: auto)")
    parser.add_argument("--path", choices=("ours", "generated"), default="ours",
                        help="ours: pyscf-ipu run --forces (the host's gradient); generated: qm1b generate --forces "
                             "(with --integrals jax, the batch's device programs: the GPU's path)")
    parser.add_argument("--bucket-step", type=int, help="--path generated: the generator's --bucket-step")
    args = parser.parse_args()

    import jax
    import pyscf

    from pyscf_ipu.memory import default_budget

    work = Path(tempfile.mkdtemp(prefix="forces-bench-"))
    env = {**os.environ, "PYSCF_IPU_CACHE": str(work / "cache"), "PYTHONWARNINGS": "ignore"}
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; jax {jax.__version__}, pyscf {pyscf.__version__}; "
          f"{args.xc}/{args.basis}, dispersion {args.dispersion}, grid level {args.grid_level}; "
          f"memory budget {default_budget():.1f} GB; "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print("| conformer | side | SCF s | forces s | forces / SCF | peak GB | max abs(ours - PySCF) Ha/Bohr |")
    print("|---|---|---|---|---|---|---|")
    for m, smiles in enumerate(args.smiles):
        for k, path in enumerate(conformers(smiles, args.conformers, work, f"m{m}")):
            name = f"{m}.{k} ({'cold' if k == 0 else 'warm'})"
            runs = {}
            for side in [*args.precisions[:1], "pyscf", *args.precisions[1:]]:
                if side == "pyscf":
                    runs[side] = child(["pyscf", str(path), args.basis, args.xc, args.dispersion, str(args.grid_level)],
                                       env)  # fmt: skip
                else:
                    runs[side] = child([args.path, str(path), args.basis, side, "--xc", args.xc, "--dispersion",
                                        args.dispersion, "--grid-level", str(args.grid_level), "--integrals",
                                        args.integrals, *(["--bucket-step", str(args.bucket_step)]
                                                          if args.bucket_step else [])], env)  # fmt: skip
            reference = np.array(runs["pyscf"]["gradient"])
            for side, run in runs.items():
                error = "" if side == "pyscf" else f"{np.abs(np.array(run['gradient']) - reference).max():.1e}"
                refined = f" + {run['refined']} float64" if "refined" in run else ""  # the generator does not say
                label = "PySCF DF" if side == "pyscf" else (f"ours {side} ({run['jk']}, {run['iterations']} it."
                                                              f"{refined})")
                print(f"| {name} | {label} | {run['scf']:.1f} | {run['forces']:.1f} | {run['forces'] / run['scf']:.2f} "
                      f"| {run['peak_gb']:.2f} | {error} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
