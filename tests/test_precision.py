"""Full float32 precision in every program: no float32 product may be left to a backend's faster mode.

Left to its default, JAX lets an NVIDIA GPU compute float32 matrix products in TF32 (a 10-bit
mantissa); a float32 SCF loop then never converges and its labels are off by up to an eV. The CPU
ignores the setting, so a CPU test cannot watch the labels go wrong; it reads the programs instead:
every dot product of float32 operands must carry precision HIGHEST in the exported StableHLO,
which is what a GPU (or any backend) compiles.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pyscf_ipu.program_files import read_program
from pyscf_ipu.programs import PROGRAM_DIRECTORY_SUFFIX, compiled

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = re.compile(r"stablehlo\.(dot_general|dot|convolution)\b")
OPERANDS = re.compile(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->")
PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")


def float32_products(mlir: str) -> list[tuple[str, str]]:
    """(operation, precision) of every product of float32 operands in a StableHLO module's text;
    the precision is "DEFAULT" where the operation carries none."""
    out = []
    for line in mlir.splitlines():
        op = PRODUCT.search(line)
        operands = OPERANDS.search(line)
        if op is None or operands is None or not all(t.endswith(("xf32>", "<f32>")) for t in operands.groups()):
            continue
        precision = PRECISION.search(line)
        out.append((op[1], "DEFAULT" if precision is None else ",".join(sorted(set(precision.groups())))))
    return out


def stored_products(directory: Path, pattern: str = "*.program") -> dict[str, list[tuple[str, str]]]:
    """Every stored program of ``directory`` -> its float32 products (see :func:`float32_products`)."""
    out = {}
    for path in sorted(directory.glob(pattern)):
        exported, _ = read_program(path.read_bytes())
        out[path.name] = float32_products(exported.mlir_module())
    return out


def low_precision(products: dict[str, list[tuple[str, str]]]) -> dict[str, int]:
    """Program name -> how many of its float32 products lack full precision (only those with any)."""
    counts = {name: sum(p != "HIGHEST" for _, p in ops) for name, ops in products.items()}
    return {name: n for name, n in counts.items() if n}


def test_the_reader_sees_precision_and_dtypes():
    """The reader itself, on programs whose answer is known: a float32 product at JAX's default is
    caught, one at HIGHEST passes, and float64 products are not float32 products."""
    a = jnp.ones((3, 3), jnp.float32)
    default = jax.jit(lambda x: x @ x).lower(a).as_text()
    highest = jax.jit(lambda x: jnp.dot(x, x, precision="highest")).lower(a).as_text()
    assert float32_products(default) == [("dot_general", "DEFAULT")]
    assert float32_products(highest) == [("dot_general", "HIGHEST")]
    with jax.enable_x64(True):
        assert float32_products(jax.jit(lambda x: x @ x).lower(np.ones((3, 3))).as_text()) == []


def test_a_compiled_program_is_traced_at_full_precision_whatever_the_callers_setting():
    """``compiled`` writes HIGHEST into every float32 product of the program it stores, also when
    the caller asks JAX for a lower default (a stored program serves every later caller)."""
    program = compiled(lambda x, y: (x @ y, jnp.einsum("ij,jk->ik", x, y)), name="precision_probe")
    x = np.ones((4, 4), np.float32)
    with jax.default_matmul_precision("bfloat16"):
        program(x, x)
    (key,) = program._programs
    stored = program._file(key)
    (products,) = stored_products(stored.parent, stored.name).values()
    assert [p for _, p in products] == ["HIGHEST", "HIGHEST"]


def test_every_float32_product_of_a_generator_run_has_full_precision(tmp_path):
    """A small generator run from an empty program directory, once with its defaults (device
    integrals, the ipu J-K backend) and once with libcint's integrals, the dense J-K backend and PBE:
    every float32 dot product of every program it stores carries precision HIGHEST."""
    smiles = tmp_path / "in.smi"
    smiles.write_text("CO m0\nCC m1\n")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYSCF_IPU_CACHE": str(cache)}
    common = [sys.executable, "-m", "qm1b.cli", "generate", "--smiles", str(smiles), "--conformers", "2",
              "--batch-size", "2", "--no-progress"]  # fmt: skip
    for k, extra in enumerate([[], ["--integrals", "host", "--jk", "dense", "--xc", "pbe"]]):
        run = subprocess.run([*common, "--out", str(tmp_path / f"out{k}"), *extra], env=env, capture_output=True,
                             text=True, timeout=900)  # fmt: skip
        assert run.returncode == 0, run.stderr
    products = stored_products(Path(str(cache / "jax") + PROGRAM_DIRECTORY_SUFFIX))
    total = sum(len(ops) for ops in products.values())
    assert len(products) >= 20 and total >= 50, (len(products), total)  # the run stored real programs
    bad = low_precision(products)
    assert not bad, f"{sum(bad.values())} of {total} float32 products lack full precision: {bad}"
