"""The streamed density-fitting factor: held once in float64, in the rectangular layout, and read a
block of fitting functions at a time where the memory budget cannot hold the loop's unpacked copy."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from pyscf_ipu.cli import differences_mev
from pyscf_ipu.config import RKSConfig
from pyscf_ipu.integral_sources import host_integrals
from pyscf_ipu.memory import GB, batch_memory
from pyscf_ipu.molecule import from_name
from pyscf_ipu.packed import (pair_index, rectangular_columns, rectangular_order, rectangular_times,
                              to_rectangular)  # fmt: skip
from pyscf_ipu.padding import pad_to
from pyscf_ipu.prepare import prepare
from pyscf_ipu.problem import prepare_batch
from pyscf_ipu.programs import full_precision
from pyscf_ipu.resolution import resolve
from pyscf_ipu.rks import submit_batch
from pyscf_ipu.units import HARTREE_TO_MEV

from .test_fitting import dm_of, pyscf_fitted_jk
from .tolerances import LABEL_MEV

SIZES = [1, 2, 3, 6, 7, 24, 25]  # odd and even AO counts: the layout's two shapes


@pytest.mark.parametrize("n", SIZES)
def test_the_rectangular_layout_holds_each_pair_once_and_reorders_in_place(n):
    """Every pair of n AOs has one column of N(N+1)/2; the in-place reordering of row-packed rows
    (a few rows at a time) puts each pair in its column, and ``rectangular_order`` inverts the map."""
    npair = n * (n + 1) // 2
    columns = rectangular_columns(n)
    lower = np.tril_indices(n)
    assert sorted(columns[lower]) == list(range(npair)) and (columns == columns.T).all()
    rows = np.random.default_rng(n).standard_normal((5, npair))
    moved = rows.copy()
    to_rectangular(moved, block=2)
    np.testing.assert_array_equal(moved[:, columns], rows[:, pair_index(n)])
    np.testing.assert_array_equal(moved, rows[:, rectangular_order(n)])


@pytest.mark.parametrize("n", SIZES)
def test_the_rectangular_product_is_the_symmetric_matrix_times_w(n):
    """S_q W from the rectangular rows equals the unpacked symmetric matrices times W (float64: to round-off)."""
    rng = np.random.default_rng(n)
    rows = rng.standard_normal((4, n * (n + 1) // 2))
    w = rng.standard_normal((n, 3))
    expected = rows[:, pair_index(n)] @ w
    to_rectangular(rows)
    with jax.enable_x64(True):
        ours = np.asarray(jax.jit(rectangular_times)(rows, w))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12 * np.abs(expected).max())


def streamed_budget(method, molecule) -> float:
    """GB: a memory budget between one conformer's peak with the factor streamed and held whole."""
    bucket = method.bucket(molecule)
    whole = batch_memory(bucket, method, 1).total
    streamed = batch_memory(dataclasses.replace(bucket, streams_factor=True), method, 1).total
    assert streamed < whole
    return (whole + streamed) / 2 / GB


def test_the_backend_streams_only_where_the_arrays_held_whole_exceed_the_budget():
    """At the default budget paracetamol's bucket holds its factor whole; under a budget between the two
    estimates it streams, and its estimate then fits that budget: no float32 copies of the factor, and
    no unpacked one."""
    molecule = from_name("paracetamol")
    config = RKSConfig(basis="def2-svp", jk="df")
    assert not resolve(config).bucket(molecule).streams_factor
    budget = streamed_budget(resolve(config), molecule)
    method = resolve(config, budget)
    bucket = method.bucket(molecule)
    assert bucket.streams_factor and bucket.label().endswith(":streamed")
    assert batch_memory(bucket, method, 1).total <= budget * GB
    exact = resolve(RKSConfig(basis="sto-3g", jk="ipu"), budget)  # one layout: never streams
    assert not exact.bucket(molecule).streams_factor


@pytest.mark.parametrize("name, basis, pad", [("water", "def2-svp", 3), ("paracetamol", "def2-svp", 4)])
def test_streamed_coulomb_and_exchange_match_pyscf_density_fitting(name, basis, pad):
    """The streamed arrays' J and K, against PySCF's float64 density fitting in the same fitting basis,
    padded to an odd and an even AO count (water's 128 padded fitting functions, two whole blocks;
    paracetamol's 1109, whose last block starts early): the bounds of the factor held whole
    (tests/test_fitting.py). Measured: the loop's float32 J and K 6e-8 to 1.0e-6 of the largest
    element (bound 1e-5); the finalisation's J 1.8e-13 (1e-10), K 1.3e-7 to 5.3e-7 (1e-6), and B3LYP's
    exchange energy from tr(D K) 0.006 to 0.013 meV (0.05)."""
    from pyscf_ipu.jk.fitted import FittedExchange, StreamedArrays

    method = resolve(RKSConfig(basis=basis, jk="df"))
    host = prepare([from_name(name)], method)[0]
    host = dataclasses.replace(host, bucket=dataclasses.replace(host.bucket, streams_factor=True))
    n, npad = host.nao, host.bucket.nao_padded + pad
    dm = dm_of(host)
    ref_j, ref_k = pyscf_fitted_jk(host.mol, basis, dm)
    with jax.enable_x64(True):
        integrals, _, _ = host_integrals([host], method, (npad, host.bucket.grid_points_padded))
        member = jax.tree.map(lambda a: a[0], method.backend.prepare(integrals.eris, npad, method.dtype))
        assert isinstance(member, StreamedArrays) and member.exact.dtype == np.float64
        j64, k64, trace = jax.jit(full_precision(FittedExchange().on_device))(member, pad_to(dm, (npad, npad)))
    j32, k32 = jax.jit(full_precision(method.backend.contract))(member, pad_to(dm, (npad, npad), np.float32))
    largest_j, largest_k = np.abs(ref_j).max(), np.abs(ref_k).max()
    for ours, ref, bound in ((j32, ref_j, 1e-5 * largest_j), (k32, ref_k, 1e-5 * largest_k), (j64, ref_j, 1e-10),
                             (k64, ref_k, 1e-6 * largest_k)):  # fmt: skip
        ours = np.asarray(ours, np.float64)
        assert np.abs(ours[:n, :n] - ref).max() < bound
        assert not ours[n:].any() and not ours[:, n:].any()  # padded AOs decoupled
    assert 0.25 * 0.2 * abs(float(trace) - np.sum(dm * ref_k)) * HARTREE_TO_MEV < 0.05


@pytest.mark.parametrize("integrals", ["auto", "jax", "libcint"])
def test_streamed_labels_within_half_a_mev_of_pyscf_density_fitting(reference, integrals):
    """Paracetamol at def2-SVP under a budget that makes its bucket stream, from each integral source
    (libcint's factor reordered on the host, the device's reordered by a program, PySCF's preparation):
    every label within the 0.5 meV guard of PySCF's float64 density-fitted SCF."""
    molecule = from_name("paracetamol")
    config = RKSConfig(basis="def2-svp", xc="b3lyp5", jk="df", integrals=integrals)
    method = resolve(config, streamed_budget(resolve(config), molecule))
    assert method.bucket(molecule).streams_factor
    (result,) = submit_batch(prepare_batch([molecule], method), method).results()
    ref = reference(molecule, config)
    mev = {k: abs(v) for k, v in differences_mev(result, ref).items()}
    assert result.converged and max(mev.values()) < LABEL_MEV, mev


def test_the_generator_says_which_size_buckets_stream(tmp_path):
    """Under a budget between paracetamol's two layouts, its size bucket streams and ethanol's does
    not; the progress bar's and the summary's label says so."""
    from qm1b.batching import batch_sizes, chosen
    from qm1b.settings import GenerateConfig

    smiles = tmp_path / "in.smi"
    smiles.write_text("CC(=O)Nc1ccc(O)cc1 paracetamol\nCCO ethanol\n")
    dft = RKSConfig(basis="def2-svp", xc="b3lyp5", jk="df")
    budget = streamed_budget(resolve(dft), from_name("paracetamol"))
    run = GenerateConfig(smiles=str(smiles), memory_budget=budget, progress=False).resolved(dft)
    method, inputs = resolve(dft, run.budget_gb), run.inputs()
    sizes = batch_sizes(run, method, inputs, run.buckets(method, inputs))
    assert sorted(bucket.streams_factor for bucket in sizes) == [False, True]
    assert chosen(dft, sizes) == "def2-svp, jk df, batch 1, factor streamed in 1 of 2 size buckets"


def test_a_range_separated_functional_streams_both_factors(reference):
    """ωB97X under a budget that makes paracetamol's bucket stream: the Coulomb and the long-range
    factor both streamed, and every label within the 0.5 meV guard of PySCF's float64 density fitting."""
    from pyscf_ipu.jk.fitted import StreamedArrays

    molecule = from_name("paracetamol")
    config = RKSConfig(basis="def2-svp", xc="wb97x", jk="df", integrals="auto")
    method = resolve(config, streamed_budget(resolve(config), molecule))
    batch = prepare_batch([molecule], method)
    assert isinstance(batch.problem.jk.coulomb, StreamedArrays) and isinstance(batch.problem.jk.long_range,
                                                                                StreamedArrays)  # fmt: skip
    (result,) = submit_batch(batch, method).results()
    ref = reference(molecule, config)
    mev = {k: abs(v) for k, v in differences_mev(result, ref).items()}
    assert result.converged and max(mev.values()) < LABEL_MEV, mev
