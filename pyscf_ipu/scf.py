r"""The jit-compiled SCF loop: Fock build, DIIS, generalized eigenproblem, density update.

One iteration, from the density matrix D of the previous one:

1. Fock build. ``J, K = backend.contract(D)`` and ``E_xc, V_xc = dE_xc/dD`` on the grid;
   :math:`F = H + J - \tfrac{a_x}{2} K + V_{xc}` and
   :math:`E = \mathrm{tr}(DH) + \tfrac12 \mathrm{tr}(DJ) - \tfrac{a_x}{4}\mathrm{tr}(DK) + E_{xc} + E_{nuc}`.
2. DIIS (Pulay 1980, CPL 73 393). The commutator :math:`FDS - SDF` is the error vector; a ring
   buffer holds the last ``diis_space`` Fock matrices and errors, and the extrapolated Fock matrix
   minimises the norm of the combined error. As in PySCF, DIIS starts at the second iteration.
3. Diagonalisation. :math:`FC = SCe` becomes an ordinary eigenproblem through the orthogonaliser X
   (:math:`X^T S X = 1`): :math:`C = X\,\mathrm{eigh}(X^T F X)`.
4. Density update. :math:`D = 2 C_{occ} C_{occ}^T`.

Convergence is judged the QM1B way: the standard deviation of the energy over the last 5
iterations, in eV, below 0.01 eV. The loop is a ``lax.while_loop`` over at most ``max_iterations``
steps; it stops early once that holds and the largest element of the DIIS commutator is below the
stop threshold as well, or has stalled within ten times of it (its float32 rounding floor, which
grows with the basis: diazepam at def2-SVP stalls near 3e-5).
Every array has a padded shape from :class:`~pyscf_ipu.problem.SCFProblem`, so one compiled loop
serves every molecule of a size bucket; settings that change the trace are in
:class:`~pyscf_ipu.method.LoopSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from .method import LoopSettings
from .numint import weighted_points, xc_energy_and_potential
from .problem import SCFProblem
from .units import HARTREE_TO_EV
from .programs import compiled, over_batch

QM1B_STD_WINDOW = 5
STALL_FACTOR = 10.0  # a stalled commutator ends the loop only below this times the stop threshold
STALL_ITERATIONS = 2  # ... after this many iterations above half its earlier best


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SCFTrace:
    """What the loop hands back to the host."""

    density: jax.Array  # (Np, Np)  from the last diagonalisation
    mo_energy: jax.Array  # (Np,)  in-loop orbital energies (the host recomputes them in float64)
    energies: jax.Array  # (max_iterations,)  E[D] of each iteration, Hartree; unused entries 0
    energy_changes: jax.Array  # (max_iterations,)  E_k - E_{k-1} by the trapezoid rule (0 first)
    commutators: jax.Array  # (max_iterations,)  max|FDS - SDF| of each iteration
    iterations: jax.Array  # ()  iterations run
    energy_std_ev: jax.Array  # ()  std of the last 5 energies, eV
    converged: jax.Array  # ()  QM1B's criterion, see :func:`converged`


def fock_matrix(hcore, vj, vk, vxc, hf_exchange: float):
    r""":math:`F = H + J - \tfrac{a_x}{2} K + V_{xc}` (numpy or JAX arrays alike: the loop's and the
    float64 finalisation's)."""
    return hcore + vj - (0.5 * hf_exchange) * vk + vxc


def energy_terms(dm, hcore, vj, exchange_trace, exc, hf_exchange: float, nuclear_repulsion) -> dict:
    r"""The total energy's terms, Hartree, in the order they are summed:
    :math:`\mathrm{tr}(DH) + \tfrac12 \mathrm{tr}(DJ) - \tfrac{a_x}{4}\mathrm{tr}(DK) + E_{xc} + E_{nuc}`,
    with ``exchange_trace`` = tr(D K) (numpy or JAX arrays alike)."""
    return {
        "one_electron": (dm * hcore).sum(),
        "coulomb": 0.5 * (dm * vj).sum(),
        "exact_exchange": -0.25 * hf_exchange * exchange_trace,
        "xc": exc,
        "nuclear_repulsion": nuclear_repulsion,
    }


def fock_and_energy(problem: SCFProblem, settings: LoopSettings, dm, weighted):
    """Step 1: (F, E) for the density ``dm``; the grid's points from ``weighted`` on have zero
    weight (see :func:`~pyscf_ipu.numint.xc_energy_and_potential`)."""
    ax = settings.functional.exchange_factor
    vj, vk = settings.backend.contract(problem.jk, dm)
    exc, vxc, _ = xc_energy_and_potential(settings.functional, problem.ao, problem.weights, dm, weighted)
    terms = energy_terms(dm, problem.hcore, vj, jnp.sum(dm * vk), exc, ax, problem.nuclear_repulsion)
    return fock_matrix(problem.hcore, vj, vk, vxc, ax), sum(terms.values())


def diis_extrapolate(focks, errors, count):
    """Step 2: the DIIS Fock matrix from the first ``count`` slots of the ring buffers (m, N, N).

    Minimises |sum_i c_i e_i|^2 subject to sum_i c_i = 1: the bordered system
    [[B, s], [s, 0]] [c', l] = [0, 1] in the diagonally scaled unknowns c_i = s_i c'_i, with
    B_ij = s_i s_j <e_i, e_j> and s_i = 1 / |e_i| (unused slots masked to decouple, c = 0). A
    pseudo-inverse drops the directions that have become numerically singular once the errors reach
    float round-off.

    The scaling gives B a unit diagonal. Unscaled, B spans the squared range of the buffered errors
    (1e-1 early, 1e-4 late: 1e6), and in float32 the pseudo-inverse's cutoff (100 eps of the
    largest singular value) would drop the newest, smallest errors' directions and stall the loop
    for a few iterations (``docs/decisions/stop-threshold.md``).
    """
    m = focks.shape[0]
    used = jnp.arange(m) < count
    b = jnp.einsum("iab,jab->ij", errors, errors)
    scale = jnp.where(used, jax.lax.rsqrt(jnp.maximum(jnp.diag(b), jnp.finfo(b.dtype).tiny)), 0.0)  # (m,) 1/|e_i|
    b = jnp.where(used[:, None] & used[None, :], b * scale[:, None] * scale[None, :], 0.0)
    b = b + jnp.diag(jnp.where(used, 0.0, 1.0))
    border = scale / jnp.max(scale)  # the constraint's direction; its length only rescales c'
    system = jnp.block([[b, border[:, None]], [border[None, :], jnp.zeros((1, 1), b.dtype)]])
    rhs = jnp.zeros(m + 1, b.dtype).at[m].set(1.0)
    rtol = 100 * jnp.finfo(b.dtype).eps
    coef = scale * (jnp.linalg.pinv(system, rtol=rtol, hermitian=True) @ rhs)[:m]
    coef = coef / jnp.sum(coef)  # sum c_i = 1 exactly, whatever the border's length
    return jnp.einsum("i,iab->ab", coef, focks)


def diagonalise(problem: SCFProblem, fock):
    """Step 3: orbital energies (Np,) and coefficients (Np, Np) of F C = S C e."""
    x = problem.orthogonaliser
    fock_orth = x.T @ fock @ x + jnp.diag(problem.virtual_shift)
    mo_energy, vectors = jnp.linalg.eigh(fock_orth)
    return mo_energy, x @ vectors


def density_matrix(coefficients, occupation):
    """Step 4: D = sum_i n_i C_i C_i^T."""
    return (coefficients * occupation) @ coefficients.T


def commutator(fock, dm, overlap):
    """F D S - S D F (N, N), the DIIS error vector: zero at self-consistency."""
    sdf = overlap @ dm @ fock
    return sdf.T - sdf


def energy_std_ev(changes, iterations):
    """Std (eV) of the energies of the last min(5, iterations) iterations, from their changes.

    ``changes[k]`` is E_k - E_{k-1}; the window's energies relative to any common offset are
    cumulative sums of its changes, which is all a standard deviation needs.
    """
    idx = jnp.arange(changes.shape[0])
    mask = (idx < iterations) & (idx > iterations - QM1B_STD_WINDOW)  # the window's first energy is the offset
    relative = jnp.cumsum(jnp.where(mask, changes, 0.0))
    in_window = (idx < iterations) & (idx >= iterations - QM1B_STD_WINDOW)
    count = jnp.maximum(jnp.sum(in_window), 1)
    mean = jnp.sum(jnp.where(in_window, relative, 0.0)) / count
    var = jnp.sum(jnp.where(in_window, (relative - mean) ** 2, 0.0)) / count
    return jnp.sqrt(var) * HARTREE_TO_EV


def stalled(commutators, it, settings: LoopSettings):
    """True once the commutator, below ``STALL_FACTOR`` times the stop threshold, has not fallen below
    half its earlier best for ``STALL_ITERATIONS`` iterations: it has reached the float32 rounding
    floor of F D S - S D F, which grows with the basis, and further iterations only scatter around it
    (each new chance low by a few percent would otherwise keep the loop going)."""
    index = jnp.arange(commutators.shape[0])
    earlier = jnp.where(index < it + 1 - STALL_ITERATIONS, commutators, jnp.inf)
    recent = jnp.where((index <= it) & (index > it - STALL_ITERATIONS), commutators, jnp.inf)
    return (commutators[it] < STALL_FACTOR * settings.stop_threshold) & (jnp.min(recent) >= 0.5 * jnp.min(earlier))


def converged(changes, iterations, settings: LoopSettings):
    """QM1B's criterion: at least 5 iterations, and the last 5 energies' std below the threshold."""
    std = energy_std_ev(changes, iterations)
    return (iterations >= QM1B_STD_WINDOW) & (std < settings.convergence_std_ev)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoopState:
    """What one SCF iteration hands the next (the ``lax.while_loop`` carry)."""

    iteration: jax.Array  # ()  iterations done
    density: jax.Array  # (Np, Np)  D from the last diagonalisation
    previous_density: jax.Array  # (Np, Np)  the D before it
    previous_fock: jax.Array  # (Np, Np)  F[previous_density]
    mo_energy: jax.Array  # (Np,)  of the last diagonalisation
    energies: jax.Array  # (max_iterations,)  E[D] per iteration
    energy_changes: jax.Array  # (max_iterations,)  E_k - E_{k-1} by the trapezoid rule
    commutators: jax.Array  # (max_iterations,)  max|FDS - SDF| per iteration
    focks: jax.Array  # (diis_space, Np, Np)  DIIS ring buffer of Fock matrices
    errors: jax.Array  # (diis_space, Np, Np)  and of their commutators
    done: jax.Array  # ()  the stop criterion held


def scf_loop(problem: SCFProblem, settings: LoopSettings, weighted) -> SCFTrace:
    """The SCF iterations of one conformer's ``problem`` (the kernel :data:`scf_program` batches).

    ``weighted``: the grid's points from this index on have zero weight (the batch's largest count).
    """
    dm0 = problem.density_guess
    n = dm0.shape[0]
    dtype = dm0.dtype
    m, iters = settings.diis_space, settings.max_iterations
    s = problem.overlap

    def step(state: LoopState) -> LoopState:
        it, dm = state.iteration, state.density
        fock, energy = fock_and_energy(problem, settings, dm, weighted)
        # E_k - E_{k-1} by the trapezoid rule: exact for the quadratic (one-electron, Coulomb,
        # exchange) part of E[D], third order in the step for E_xc. Unlike the difference of two
        # float32 totals of ~1e3 Hartree, it keeps the meV-scale convergence visible.
        change = jnp.where(it > 0, 0.5 * jnp.sum((dm - state.previous_density) * (fock + state.previous_fock)), 0.0)
        error = commutator(fock, dm, s)
        largest = jnp.max(jnp.abs(error))
        # PySCF's diis_start_cycle = 1: the guess's Fock matrix does not enter DIIS.
        slot = jnp.maximum(it - 1, 0) % m
        keep = it >= 1
        focks = jnp.where(keep, state.focks.at[slot].set(fock), state.focks)
        errors = jnp.where(keep, state.errors.at[slot].set(error), state.errors)
        fock_used = jnp.where(keep, diis_extrapolate(focks, errors, jnp.minimum(it, m)), fock)
        mo_energy, coefficients = diagonalise(problem, fock_used)
        changes = state.energy_changes.at[it].set(change)
        commutators = state.commutators.at[it].set(largest)
        return LoopState(
            iteration=it + 1,
            density=density_matrix(coefficients, problem.occupation),
            previous_density=dm,
            previous_fock=fock,
            mo_energy=mo_energy,
            energies=state.energies.at[it].set(energy),
            energy_changes=changes,
            commutators=commutators,
            focks=focks,
            errors=errors,
            done=((largest < settings.stop_threshold) | stalled(commutators, it, settings))
            & converged(changes, it + 1, settings),
        )

    def keep_going(state: LoopState):
        return (state.iteration < iters) & ~state.done

    zeros_nn = jnp.zeros((n, n), dtype)
    history = jnp.zeros(iters, dtype)
    init = LoopState(
        iteration=jnp.zeros((), jnp.int32),
        density=dm0,
        previous_density=zeros_nn,
        previous_fock=zeros_nn,
        mo_energy=jnp.zeros(n, dtype),
        energies=history,
        energy_changes=history,
        commutators=history,
        focks=jnp.zeros((m, n, n), dtype),
        errors=jnp.zeros((m, n, n), dtype),
        done=jnp.zeros((), bool),
    )
    final = jax.lax.while_loop(keep_going, step, init)
    it, changes = final.iteration, final.energy_changes
    return SCFTrace(final.density, final.mo_energy, final.energies, changes, final.commutators, it,
                    energy_std_ev(changes, it), converged(changes, it, settings))  # fmt: skip


@partial(compiled, static_argnums=1)
def scf_program(problems: SCFProblem, settings: LoopSettings) -> SCFTrace:
    """:func:`scf_loop` over a batch of conformers (a leading axis; see ``problem.build_problem``), as
    one compiled program per (settings, padded shapes, dtype).

    The batched while-loop runs until every member has stopped; members that stopped earlier keep
    their state (JAX's batched while_loop selects per member), so results equal unbatched runs.
    A batch of one runs the kernel itself, whose products XLA runs faster than their batched forms
    (:func:`~pyscf_ipu.programs.over_batch`).
    Batches run one at a time: two loops at once, from two threads, can deadlock XLA's CPU thread
    pool on a batched ``eigh`` (``docs/decisions/one-loop-at-a-time.md``).
    """
    weighted = jnp.max(weighted_points(problems.weights))  # one, unbatched: see xc_energy_and_potential
    return over_batch(lambda problem: scf_loop(problem, settings, weighted))(problems)
