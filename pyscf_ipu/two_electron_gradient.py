r"""The two-electron part of the nuclear gradient, dE_2/dR at fixed orbitals, for the exact and the
density-fitted ERIs: each J-K backend differentiates the energy it computed
(:meth:`~pyscf_ipu.jk.ExactERIs.two_electron_gradient`, :meth:`~pyscf_ipu.jk.FittedJK.two_electron_gradient`).

- **Exact ERIs**: a dot product of the s8 ERIs with a host vector: each unique integral
  (u) = (mu nu|lambda sigma) stands for m_u index tuples (its distinct permutations), so its
  coefficient is m_u D_mu,nu D_lambda,sigma / 2 - a_x m_u (D_mu,lambda D_nu,sigma +
  D_mu,sigma D_nu,lambda) / 8.
- **Density fitting** (``--jk df``), with 3-centre integrals T_P,ij = (ij|P), metric M = (P|Q),
  c = M^-1 T D (the fitted density) and X_P = C_occ^T (M^-1 T)_P C_occ:

  .. math::

      \frac{dE_2}{dR} = \sum_{P,ij} T^R_{P,ij}\big[c_P D_{ij} - 2 a_x (C X_P C^T)_{ij}\big]
          + \sum_{PQ} M^R_{PQ}\big[-\tfrac12 c_P c_Q + a_x \operatorname{tr} X_P X_Q\big]

  (Weigend, Haser, Patzelt and Ahlrichs, Chem. Phys. Lett. 294, 143 (1998)). The brackets are
  computed once from libcint's integrals at the geometry (float64, as the CPU's SCF fits with), and
  contract libcint's derivative integrals (``int3c2e_ip1``, ``int2c2e_ip1``) a block of fitting
  functions at a time; the derivative on the fitting function follows from translation invariance.
  (``jax.grad`` through the JAX fitting kernels instead compiled for minutes per molecule:
  ``docs/decisions/fitted-forces.md``.)
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from .integral_sources import eri_plan
from .integrals.eri import device_tables, eri_s8, eri_shares
from .integrals.eri_gradient import eri_weights
from .packed import s8_size
from .prepare import fitting_moles
from .programs import usable_cores


def exact_two_electron_gradient(mol, basis: str, occupied: np.ndarray, exchange: float, dtype: str = "float64",
                                omega: float = 0.0) -> np.ndarray:  # fmt: skip
    """(natm, 3) the exact-ERI two-electron energy's derivative at the density of ``occupied`` (N, nocc)
    (``omega`` > 0: of the long-range erf(ω r)/r's exchange energy alone, ``exchange`` E_K^ω):
    ``jax.grad`` of the s8 ERIs' dot product with their weights (:func:`~.integrals.eri_gradient.eri_weights`,
    the device gradient's), computed in
    ``dtype`` (the SCF's precision: in float32 within a few 1e-6 Hartree/Bohr of float64, at half the
    time), the quartets shared out over one thread per core, each differentiating its share with the
    one program that serves them all (compiled here first, so that the threads do not each compile it)."""
    from concurrent.futures import ThreadPoolExecutor

    plan = eri_plan(basis, tuple(mol.elements), omega)
    workers = min(usable_cores(), 8)
    device_tables(plan, workers)  # before any trace: the caches may have let this plan's tables go
    shares = eri_shares(plan, workers)
    with jax.enable_x64(True):
        dm = 2.0 * occupied @ occupied.T
        coefficients = eri_weights(jnp.asarray(dm), 0.0 if omega else 1.0, exchange, s8_size(len(dm)), dtype)
        coords = jnp.asarray(mol.atom_coords(), dtype)
        gradient = _share_gradient(plan, jnp.dtype(dtype).name, coefficients.shape, coords.shape, workers)

        def share(k: int) -> np.ndarray:
            with jax.enable_x64(True):  # worker threads do not inherit the caller's context
                return np.asarray(gradient(coefficients, coords, shares[k]), np.float64)

        with ThreadPoolExecutor(workers) as pool:
            return sum(pool.map(share, range(workers)))


@lru_cache(maxsize=64)
def _share_gradient(plan, dtype: str, coefficients_shape: tuple[int], coords_shape: tuple[int, int], workers: int):
    """The compiled gradient, in the positions (``coords_shape``, in ``dtype``), of the dot product of
    the coefficients (``coefficients_shape``) with the s8 ERIs of one of ``workers`` shares of
    ``plan``'s quartets, the share's tables an argument (:func:`~pyscf_ipu.integrals.eri.eri_s8`): one
    program for every share. Its caller builds the plan's device tables first, in x64 mode."""

    def energy(coefficients, coords, share):
        return jnp.dot(coefficients, eri_s8(plan, coords[None], coefficients.dtype, share=share)[0])

    arguments = (jax.ShapeDtypeStruct(coefficients_shape, dtype), jax.ShapeDtypeStruct(coords_shape, dtype),
                 eri_shares(plan, workers)[0])  # fmt: skip
    return jax.jit(jax.grad(energy, argnums=1)).lower(*arguments).compile()


def fitted_two_electron_gradient(mol, basis: str, occupied: np.ndarray, exchange: float, expcutoff: float = 0.0,
                                 omega: float = 0.0) -> np.ndarray:  # fmt: skip
    """(natm, 3) the density-fitted two-electron energy's derivative at the density of ``occupied``
    (N, nocc), with PySCF's default fitting basis (what ``--jk df`` fits with), from libcint's integrals
    with the SCF's primitive screening ``expcutoff`` (:func:`~pyscf_ipu.prepare.screened`); ``omega`` > 0:
    of the long-range erf(ω r)/r's fitted exchange energy alone, ``exchange`` E_K^ω (every integral, the
    metric's too, of that operator, whose metric may be singular: :func:`metric_solver`).

    The fitted density and the exchange intermediates (:func:`fitted_intermediates`) give each fitting
    function P its weight matrix G_P = c_P D - 2 a_x C X_P C^T; G contracts the derivative integrals
    (nabla i j|P) a block of fitting shells at a time. The derivative on the fitting function comes from
    the same integrals: translation of all three centres together leaves (ij|P) unchanged, so
    (ij|nabla P) = -(nabla i j|P) - (i nabla j|P), and with G_P symmetric its sum is -2 sum_ij
    (nabla i j|P) G_P,ij. BLAS runs on every core this process may use, as in the SCF's fitting.
    """
    from pyscf import df
    from threadpoolctl import threadpool_limits

    orbitals, auxmol = fitting_moles(mol, basis, expcutoff, omega)
    n = len(occupied)
    dm = 2.0 * occupied @ occupied.T  # (N, N)
    by_ao = np.zeros((3, n))  # sum over j, P of (nabla i j|P) G_P,ij
    by_aux = np.zeros((3, auxmol.nao))  # sum over ij of (ij|nabla P) G_P,ij
    offsets = auxmol.ao_loc_nr()
    with threadpool_limits(usable_cores(), user_api="blas"):
        three = df.incore.aux_e2(orbitals, auxmol, intor="int3c2e", aosym="s2ij")  # (npair, Q), Fortran order
        fitted, x = fitted_intermediates(three, auxmol.intor("int2c2e"), occupied, dm, exchange, coulomb=not omega)
        del three
        for first, last in _shell_blocks(offsets, FITTED_BLOCK_FUNCTIONS):
            p0, p1 = offsets[first], offsets[last]
            weights = _weights(fitted[p0:p1], x[p0:p1], occupied, dm, exchange)  # (b, N, N) G_P, symmetric
            slices = (0, mol.nbas, 0, mol.nbas, first, last)
            bra = df.incore.aux_e2(orbitals, auxmol, intor="int3c2e_ip1", aosym="s1", comp=3, shls_slice=slices)
            bra = bra.transpose(0, 3, 2, 1)  # (3, b, N, N): (nabla i j|P) at [x, P, j, i], contiguous
            by_ao += np.einsum("xpji,pji->xi", bra, weights)
            by_aux[:, p0:p1] = -2.0 * np.einsum("xpji,pji->xp", bra, weights)
            del bra, weights
        metric_weights = -0.5 * np.outer(fitted, fitted)  # (Q, Q)
        if exchange:
            flat = x.reshape(len(x), -1)
            metric_weights += exchange * flat @ flat.T  # tr X_P X_Q (X symmetric)
        metric_derivative = auxmol.intor("int2c2e_ip1", comp=3)  # (3, Q, Q): (nabla P|Q)
        by_aux += 2.0 * np.einsum("xpq,pq->xp", metric_derivative, metric_weights)
    # d/dR_A of a function on A is minus its gradient in the electron's coordinate; i and j alike
    gradient = np.zeros((mol.natm, 3))
    np.add.at(gradient, function_atoms(mol), -2.0 * by_ao.T)
    np.add.at(gradient, function_atoms(auxmol), -by_aux.T)
    return gradient


def _weights(fitted: np.ndarray, x: np.ndarray, occupied: np.ndarray, dm: np.ndarray, exchange: float
             ) -> np.ndarray:  # fmt: skip
    """(b, N, N) G_P = c_P D - 2 a_x C X_P C^T for a block of fitting functions: ``fitted`` (b,),
    ``x`` (b, nocc, nocc), as two matrix products over the whole block."""
    weights = fitted[:, None, None] * dm
    if exchange:
        (b, nocc, _), n = x.shape, len(dm)
        cx = occupied @ x.transpose(1, 0, 2).reshape(nocc, b * nocc)  # (N, b nocc): C X_P side by side
        cx = cx.reshape(n, b, nocc).transpose(1, 0, 2).reshape(b * n, nocc)
        weights -= 2.0 * exchange * (cx @ occupied.T).reshape(b, n, n)
    return weights


def metric_solver(metric: np.ndarray):
    """x -> M^-1 x for the fitting metric M (Q, Q): by Cholesky, or where M is not positive definite
    (the long-range metric can be singular) by its eigenvectors above PySCF's linear-dependence
    threshold, the pseudo-inverse PySCF's density-fitted gradient and the SCF's factor take."""
    import scipy.linalg
    from pyscf.df.incore import LINEAR_DEP_THR

    try:
        factor = scipy.linalg.cho_factor(metric, lower=True)
        return lambda x: scipy.linalg.cho_solve(factor, x)
    except np.linalg.LinAlgError:
        w, v = scipy.linalg.eigh(metric)
        kept = w > LINEAR_DEP_THR
        inverse = (v[:, kept] / w[kept]) @ v[:, kept].T  # (Q, Q)
        return lambda x: inverse @ x


def fitted_intermediates(three: np.ndarray, metric: np.ndarray, occupied: np.ndarray, dm: np.ndarray,
                         exchange: float, coulomb: bool = True) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The fitted density c = M^-1 T D (Q,) (zero without ``coulomb``) and, for exact exchange,
    X_P = C^T (M^-1 T)_P C (Q, nocc, nocc) (empty without), from the 3-centre integrals ``three``
    (npair, Q) packed as libcint's ``s2ij`` packs them (pairs i >= j), the metric M (Q, Q), the
    occupied orbitals C (N, nocc) and their density D = 2 C C^T (N, N).

    X_P = sum_Q (M^-1)_PQ C^T T_Q C is formed from the small C^T T_Q C, so that M^-1 T, as large as
    T, is never made; T_Q is unpacked a block of fitting functions at a time."""
    from pyscf import lib

    n, nocc = occupied.shape
    i, j = np.tril_indices(n)
    solve = metric_solver(metric)
    fitted = solve(three.T @ (dm[i, j] * np.where(i == j, 1.0, 2.0))) if coulomb else np.zeros(three.shape[1])
    if not exchange:
        return fitted, np.zeros((len(fitted), 0, 0))
    projected = np.empty((len(fitted), nocc, nocc))  # C^T T_Q C
    for q0 in range(0, len(fitted), FITTED_BLOCK):
        rows = lib.unpack_tril(np.ascontiguousarray(three[:, q0 : q0 + FITTED_BLOCK].T))  # (b, N, N)
        b = len(rows)
        half = (rows.reshape(b * n, n) @ occupied).reshape(b, n, nocc).transpose(1, 0, 2)  # (N, b, nocc) T_Q C
        both = occupied.T @ half.reshape(n, b * nocc)  # (nocc, b nocc): one product for the block
        projected[q0 : q0 + b] = both.reshape(nocc, b, nocc).transpose(1, 0, 2)
    x = solve(projected.reshape(len(fitted), -1))
    return fitted, x.reshape(len(fitted), nocc, nocc)


def function_atoms(mol) -> np.ndarray:
    """(nao,) the atom of each of ``mol``'s basis functions."""
    slices = mol.aoslice_by_atom()  # (natm, 4): shells, then functions, [first, last)
    return np.repeat(np.arange(mol.natm), slices[:, 3] - slices[:, 2])


FITTED_BLOCK_FUNCTIONS = 256  # fitting functions whose derivative integrals (3 N^2 each) are held at once


def _shell_blocks(offsets: np.ndarray, most: int) -> list[tuple[int, int]]:
    """Consecutive shell ranges [first, last) of at most ``most`` functions each (one shell at least),
    from the shells' function offsets (S + 1,)."""
    blocks, first = [], 0
    for last in range(1, len(offsets)):
        if offsets[last] - offsets[first] > most and last - 1 > first:
            blocks.append((first, last - 1))
            first = last - 1
    blocks.append((first, len(offsets) - 1))
    return blocks


FITTED_BLOCK = 128  # fitting functions whose (N, N) matrices are unpacked at once
