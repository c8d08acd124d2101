"""Density fitting (``--jk df``): J and K against PySCF's own density fitting, labels against PySCF's
density-fitted SCF in the same fitting basis, and the settings it refuses."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import scipy.linalg
from pyscf import df

from pyscf_ipu.buckets import auxiliary_basis
from pyscf_ipu.config import ConfigError, RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.molecule import from_name
from pyscf_ipu.padding import pad_to
from pyscf_ipu.prepare import prepare
from pyscf_ipu.integral_sources import host_integrals
from pyscf_ipu.programs import full_precision
from pyscf_ipu.rks import run_rks
from pyscf_ipu.units import HARTREE_TO_MEV
from .tolerances import LABEL_MEV


def fitted_member(host, npad: int, precision: str = "float32"):
    """The fitted backend's arrays of one host preparation, padded to ``npad`` AOs."""
    method = resolve(RKSConfig(basis=host.bucket.basis, jk="df", precision=precision))
    integrals, _, _ = host_integrals([host], method, (npad, host.bucket.grid_points_padded))
    return jax.tree.map(lambda a: a[0], method.backend.prepare(integrals.eris, npad, method.dtype))


def pyscf_fitted_jk(mol, basis: str, dm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PySCF's float64 density-fitted J and K of ``dm``, its DF object built from scratch (its own
    3-centre integrals and metric) in the fitting basis PySCF picks for ``basis``, contracted by its
    general path (no orbitals given)."""
    fitting = df.DF(mol, auxbasis={s: auxiliary_basis(basis, s) for s in set(mol.elements)})
    fitting.verbose = 0
    return df.df_jk.get_jk(fitting, dm, hermi=1)


@pytest.mark.parametrize("name, basis", [("benzene", "6-31g*"), ("water", "def2-svp")])
def test_fitted_jk_matches_pyscf_density_fitting(name, basis):
    """J and K in float32, padded by 3 AOs, against PySCF in float64: of an orbital density (the core
    Hamiltonian's occupied orbitals, rank nocc, within the bucket's occupied rank), and J of the initial
    guess, whose rank is higher (J is exact for any density; the guess's K keeps the bucket's rank).
    Float32 sums of O(1) terms keep 1e-5 of the largest element."""
    host = prepare([from_name(name)], resolve(RKSConfig(basis=basis, jk="df")))[0]
    n, npad = host.nao, host.bucket.nao_padded + 3
    assert host.nocc <= host.bucket.occupied_rank  # benzene's guess has rank 36 against 24 (water's: within)
    backend = resolve(RKSConfig(jk="df")).backend
    member = fitted_member(host, npad)
    contract = jax.jit(full_precision(backend.contract))
    orbitals = scipy.linalg.eigh(host.hcore, host.overlap)[1][:, : host.nocc]
    for dm, check_k in ((2 * orbitals @ orbitals.T, True), (host.density_guess, False)):
        j, k = contract(member, pad_to(dm, (npad, npad), np.float32))
        ref_j, ref_k = pyscf_fitted_jk(host.mol, basis, dm)
        for ours, ref in ((j, ref_j), (k, ref_k))[: 1 + check_k]:
            ours = np.asarray(ours, np.float64)
            assert np.abs(ours[:n, :n] - ref).max() < 1e-5 * np.abs(ref).max()
            assert not ours[n:].any() and not ours[:, n:].any()  # padded AOs decoupled


def dm_of(host) -> np.ndarray:
    """An orbital density: the core Hamiltonian's occupied orbitals."""
    orbitals = scipy.linalg.eigh(host.hcore, host.overlap)[1][:, : host.nocc]
    return 2 * orbitals @ orbitals.T


@pytest.mark.parametrize("name, basis", [("benzene", "6-31g*"), ("water", "def2-svp"), ("paracetamol", "def2-svp")])
def test_the_finalisations_coulomb_and_exchange(name, basis):
    """The float64 finalisation's J and K on the device (``FittedExchange``), against PySCF's own
    float64 density fitting in the same fitting basis, for an orbital density padded by 3 AOs: J
    from the float64 factor within 1e-10 (float64 round-off of sums of O(10) terms), K from float32
    products on the loop's float32 factor.
    K keeps 1e-6 of its largest element (measured 3.6e-7 to 4.1e-7): it moves orbital energies by
    about 1e-3 meV. tr(D K), summed in float64 from the blocks W^T B_Q W, keeps the exchange energy
    of B3LYP (a_x = 0.2) within 0.05 meV of the 2 meV label tolerance (measured 0.005-0.018 meV;
    tr(D K) over the float32 K itself was 0.035-0.082 meV off at benzene and paracetamol)."""
    from pyscf_ipu.jk.fitted import FittedExchange

    host = prepare([from_name(name)], resolve(RKSConfig(basis=basis, jk="df")))[0]
    n, npad = host.nao, host.bucket.nao_padded + 3
    with jax.enable_x64(True):
        member = fitted_member(host, npad)
        j, k, trace = jax.jit(full_precision(FittedExchange().on_device))(member, pad_to(dm_of(host), (npad, npad)))
    dm = dm_of(host)
    ref_j, ref_k = pyscf_fitted_jk(host.mol, basis, dm)
    j, k = np.asarray(j), np.asarray(k)
    assert j.dtype == k.dtype == np.float64
    assert np.abs(j[:n, :n] - ref_j).max() < 1e-10
    assert np.abs(k[:n, :n] - ref_k).max() < 1e-6 * np.abs(ref_k).max()
    assert not k[n:].any() and not k[:, n:].any()  # padded AOs decoupled
    assert 0.25 * 0.2 * abs(float(trace) - np.sum(dm * ref_k)) * HARTREE_TO_MEV < 0.05


def test_a_metric_without_a_cholesky_factor_falls_back_to_pyscfs_eigen_decomposition(monkeypatch):
    """Where the metric's Cholesky factorisation fails (numerically not positive definite), the factor
    comes from PySCF's ``cholesky_eri``, which decomposes the metric by its eigenpairs instead: fewer
    or other rows, but the same fitted ERIs B^T B, to round-off of their O(1) entries (water at
    def2-SVP: 8.5e-14 on entries up to 4.8)."""
    from pyscf_ipu.prepare import fitted_eri
    from pyscf_ipu.pyscf_mole import build_mole

    mol = build_mole(from_name("water"), "def2-svp")
    factor = fitted_eri(mol, "def2-svp")

    def refuse(*args, **kwargs):
        raise scipy.linalg.LinAlgError("not positive definite")

    into = np.full((len(factor) + 3, factor.shape[1]), np.nan)  # a caller's buffer with rows to spare
    placed = fitted_eri(mol, "def2-svp", out=into)
    assert np.shares_memory(placed, into) and placed.shape == factor.shape  # solved in place, in the leading rows
    np.testing.assert_array_equal(into[: len(factor)], factor)  # written there, by the same solve
    assert np.isnan(into[len(factor) :]).all()  # the padding rows untouched
    monkeypatch.setattr(scipy.linalg, "cholesky", refuse)
    fallback = fitted_eri(mol, "def2-svp")
    assert not np.array_equal(fallback, factor)  # the other decomposition ran
    assert np.abs(fallback.T @ fallback - factor.T @ factor).max() < 1e-11
    into[:] = np.nan
    placed = fitted_eri(mol, "def2-svp", out=into)
    assert np.shares_memory(placed, into) and len(placed) == len(fallback)
    np.testing.assert_array_equal(into[: len(fallback)], fallback)  # its rows first, the rest untouched
    assert np.isnan(into[len(fallback) :]).all()


@pytest.mark.parametrize("name, basis", [("water", "6-31g*"), ("benzene", "def2-svp"), ("qm9:21989", "6-31g*")])
def test_density_fitted_labels_within_half_a_mev_of_pyscf_density_fitting(reference, qm9_nine_heavy, name, basis):
    """The float32 loop on fitted integrals against PySCF's float64 density-fitted SCF in the same
    fitting basis: every label within the 0.5 meV guard (tests/tolerances.py)."""
    from .molecules import molecule_by_name

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(basis=basis, xc="b3lyp5", jk="df")
    result = run_rks(molecule, config)
    ref = reference(molecule, config)
    mev = {k: abs(a - b) * HARTREE_TO_MEV for k, a, b in [("energy", result.energy, ref.energy),
           ("homo", result.homo, ref.homo), ("lumo", result.lumo, ref.lumo), ("gap", result.gap, ref.gap)]}  # fmt: skip
    assert result.converged and max(mev.values()) < LABEL_MEV, mev


def test_screening_the_exact_eris_is_refused_with_density_fitting():
    with pytest.raises(ConfigError, match="--eri-threshold screens the s8 ERIs"):
        resolve(RKSConfig(jk="df", eri_threshold=1e-10))
