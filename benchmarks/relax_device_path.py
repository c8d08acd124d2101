"""The relaxation on the path a GPU takes, forced on this CPU: host work per step, and programs
compiled once per size bucket whatever the compositions.

    python benchmarks/relax_device_path.py [--conformers 12] [--max-steps 1] [--out DIR]

Two molecules of one size bucket (QM9 120000 and 120003, 20 and 19 atoms), ``--conformers`` ETKDG
conformers each, are relaxed by one fresh ``qm1b generate --geometries start.xyz --relax dft
--integrals jax --max-steps K`` with an empty program directory and compilation cache
(``PYSCF_IPU_CACHE``); then a third molecule of the same bucket (20 atoms) by a second fresh process
with the same cache. Reported:

- each compiled program's signatures after the first run (one per program: one bucket, one width),
  and the program files the second run added (none: a new composition traces nothing);
- the ``jit`` compilations ``JAX_LOG_COMPILES=1`` logged in each run;
- the generator's own host clock: CPU seconds per gradient evaluation in the main process outside
  compiled programs (their loading and compiling counted apart), and geomeTRIC's in its workers.

The step limit keeps the run short: what is measured is per step, and whether conformers converge
is the other benchmark's (``benchmarks/relax.py``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relax import starting_geometries, write_xyz  # noqa: E402

FIRST = ("CC1CC(=O)N1CCO", "CC1OC(=O)C1CCO")
SECOND = ("OCC1CC(=O)N1CC",)


def programs(directory: Path) -> collections.Counter:
    """Program files per program name in ``directory`` (one file per traced signature)."""
    return collections.Counter(p.name.rsplit("-", 1)[0] for p in directory.glob("*.program"))


def run(geometries: Path, out: Path, cache: Path, max_steps: int) -> tuple[str, int]:
    """One fresh generator run; its summary lines and the jit compilations it logged."""
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "PYSCF_IPU_CACHE": str(cache), "JAX_LOG_COMPILES": "1"}
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--geometries", str(geometries), "--relax", "dft",
               "--integrals", "jax", "--max-steps", str(max_steps), "--out", str(out), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the generator failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip(), len(re.findall(r"Finished XLA compilation", done.stderr))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conformers", type=int, default=12)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--out", default="/tmp/relax_device_path")
    args = parser.parse_args()
    directory = Path(args.out)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    cache = directory / "cache"
    for name, smiles in (("first", FIRST), ("second", SECOND)):
        molecules = starting_geometries(list(smiles), args.conformers if name == "first" else 2)
        write_xyz(molecules, directory / f"{name}.xyz")
        before = programs(cache / "jax-programs")
        summary, compilations = run(directory / f"{name}.xyz", directory / name, cache, args.max_steps)
        after = programs(cache / "jax-programs")
        print(f"## {name} run: {len(molecules)} conformers of {', '.join(smiles)}")
        print(summary)
        print(f"jit compilations logged: {compilations}")
        print("program signatures after it: " + ", ".join(f"{k} {v}" for k, v in sorted(after.items())))
        print(f"program files it added: {sum((after - before).values())}")


if __name__ == "__main__":
    main()
