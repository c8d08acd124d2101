"""The device-side SCF problem: a batch's integrals as the loop and the float64 finalisation read them.

From :class:`~pyscf_ipu.assembly.BatchIntegrals` (padded, on the device, from either integral source)
one program makes the loop's :class:`SCFProblem`, in the run's precision, and the finalisation's
:class:`FinalInputs`, in float64: the orthogonaliser from the overlap's eigenvectors, the occupations,
the casts. Padding rules (so that one compiled SCF loop serves every molecule of a size bucket):

- grid points that are padding carry zero weight and zero AO values;
- padded AOs have zero integrals, zero AO values and unit overlap;
- the orthogonaliser X keeps the overlap's eigenvectors above :data:`LINEAR_DEPENDENCE_THRESHOLD`
  (padded AOs and linear dependencies fall below it) and is zero in the others' columns, where the
  Fock matrix in the orthogonal basis gets :data:`VIRTUAL_SHIFT` on its diagonal. They become
  exactly decoupled empty orbitals far above the LUMO. The loop's value is moderate on purpose: a
  float32 eigensolver's absolute error grows with the largest eigenvalue, so a huge shift (1e6)
  would ruin the real orbital energies; the float64 finalisation takes :data:`FINAL_SHIFT`, above
  any orbital of any basis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .assembly import BatchIntegrals, BatchMember
from .buckets import SizeBucket
from .method import Method
from .molecule import Molecule
from .prepare import LINEAR_DEPENDENCE_THRESHOLD
from .programs import compiled, precision_scope

VIRTUAL_SHIFT = 10.0  # Hartree; above any real orbital energy of the supported bases
FINAL_SHIFT = 1e4  # Hartree; the float64 finalisation's


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SCFProblem:
    """Everything the jitted SCF loop reads, as arrays of padded shape (Np AOs, Gp grid points)."""

    hcore: jax.Array  # (Np, Np)
    overlap: jax.Array  # (Np, Np)
    orthogonaliser: jax.Array  # (Np, Np)  X, zero beyond the kept columns
    virtual_shift: jax.Array  # (Np,)  added to diag(X^T F X)
    density_guess: jax.Array  # (Np, Np)
    occupation: jax.Array  # (Np,)  2 for the nocc lowest orbitals, else 0
    nuclear_repulsion: jax.Array  # ()
    ao: jax.Array  # (4, Gp, Np)
    weights: jax.Array  # (Gp,)
    jk: dict  # the backend's arrays

    @property
    def shapes(self) -> tuple[int, int]:
        """(Np, Gp): the key under which compiled code is shared (of one conformer or of a batch)."""
        return self.hcore.shape[-1], self.weights.shape[-1]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FinalInputs:
    """What the float64 finalisation reads besides the loop's own arrays, at the padded shapes."""

    overlap: jax.Array  # (Np, Np)  unit diagonal on padded AOs
    hcore: jax.Array  # (Np, Np)
    orthogonaliser: jax.Array  # (Np, Np)  X, zero beyond the kept columns
    kept: jax.Array  # (Np,) bool  X's kept columns
    weights: jax.Array  # (Gp,)
    nuclear_repulsion: jax.Array  # ()
    occupied: jax.Array  # () int32  doubly occupied orbitals
    # (s8 size of Np,) the ERIs as computed where the finalisation contracts them (the loop's are rounded), else (0,)
    eris: jax.Array


def orthogonaliser(overlap) -> tuple[jax.Array, jax.Array]:
    """(X, kept): canonical orthogonalisation X = U s^-1/2 over the eigenvalues s of S above
    :data:`LINEAR_DEPENDENCE_THRESHOLD`, zero in the other columns (padded AOs, whose rows and
    columns of S are zero, and linear dependencies)."""
    s, u = jnp.linalg.eigh(overlap)
    kept = s > LINEAR_DEPENDENCE_THRESHOLD
    return jnp.where(kept, u * jax.lax.rsqrt(jnp.where(kept, s, 1.0)), 0.0), kept


def _problem(integrals: BatchIntegrals, dtype: str) -> tuple[SCFProblem, FinalInputs]:
    """One conformer's problem (the kernel of :data:`problem_program`), from its float64 integrals; the
    AO values are left out (None), for :func:`build_problem` to add."""
    n = integrals.overlap.shape[0]
    real = integrals.real
    overlap = jnp.where(real[:, None] & real[None, :], integrals.overlap, 0.0)
    x, kept = orthogonaliser(overlap)
    overlap = overlap + jnp.diag(jnp.where(real, 0.0, 1.0))  # unit overlap on padded AOs
    occupation = jnp.where(jnp.arange(n) < integrals.occupied, 2.0, 0.0)
    cast = lambda a: a.astype(dtype)  # noqa: E731
    problem = SCFProblem(cast(integrals.hcore), cast(overlap), cast(x), cast(jnp.where(kept, 0.0, VIRTUAL_SHIFT)),
                         cast(integrals.guess), cast(occupation), cast(integrals.nuclear_repulsion),
                         None, cast(integrals.weights), {})  # fmt: skip
    final = FinalInputs(overlap, integrals.hcore, x, kept, integrals.weights, integrals.nuclear_repulsion,
                        integrals.occupied, jnp.zeros(0, integrals.overlap.dtype))  # fmt: skip
    return problem, final


problem_program = compiled(
    lambda integrals, dtype: jax.vmap(lambda member: _problem(member, dtype))(integrals), static_argnums=1,
    name="problem", quick_compile=True)


cast_program = compiled(lambda a, dtype: a.astype(dtype), static_argnums=1, name="cast")


def build_problem(integrals: BatchIntegrals, method: Method) -> tuple[SCFProblem, FinalInputs]:
    """The batch's :class:`SCFProblem` in ``method``'s precision, its J-K arrays laid out by its
    backend from its ERIs in that precision, and its :class:`FinalInputs` in float64, which hold the
    ERIs as computed where the finalisation contracts them (the backend's ``keeps_final_eris``);
    dispatched, not waited for."""
    dtype, backend = np.dtype(method.dtype), method.backend
    eris, ao = integrals.eris, integrals.ao
    with jax.enable_x64(True):  # the float64 inputs stay float64
        # the AO values, the largest array at a fine grid, pass through no program that would copy them
        ao = ao if ao.dtype == dtype else cast_program(ao, dtype.name)
        problem, final = problem_program(replace(integrals, eris=None, ao=None), dtype.name)
        problem = replace(problem, ao=ao)
        if backend.keeps_final_eris(method):  # computed more precisely than the loop reads them
            final = replace(final, eris=eris)
    jk = backend.prepare(eris, integrals.overlap.shape[-1], dtype)  # rounds them to dtype in its own program
    devices = {device for leaf in jax.tree.leaves(jk) for device in leaf.sharding.device_set}
    if len(devices) > 1:  # the backend spread its arrays over devices (simulated IPUs): the rest goes beside, whole
        mesh = Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("devices",))
        problem, final = jax.device_put((problem, final), NamedSharding(mesh, PartitionSpec()))
    return replace(problem, jk=jk), final


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    """Conformers of one size bucket, ready for the loop: their problem and the finalisation's inputs
    on the device (possibly still being computed), and the members as the host keeps them."""

    members: list[BatchMember]
    bucket: SizeBucket
    problem: SCFProblem
    final: FinalInputs
    timings: dict[str, float]  # the host's seconds per conformer, by stage

    @property
    def shapes(self) -> tuple[int, int]:
        return self.problem.shapes


def prepare_batch(molecules: list[Molecule], method: Method, shapes: tuple[int, int] | None = None) -> PreparedBatch:
    """The :class:`PreparedBatch` of conformers ``molecules`` (of molecules of one size bucket) under
    ``method``: their integrals from the run's integral source, the problem built and laid out for
    its J-K backend; dispatched, not waited for. ``shapes`` (Np, Gp) pads further than the bucket
    where the integral source can (the host's). A :class:`~pyscf_ipu.molecule.MoleculeError` names an
    element the basis or the dispersion correction cannot take."""
    method.check_elements({symbol for molecule in molecules for symbol in molecule.symbols})
    bucket = method.same_bucket(molecules)
    return batch_of(*method.integrals.integrals(molecules, bucket, method, shapes), bucket, method)


def batch_of(integrals: BatchIntegrals, members: list[BatchMember], timings: dict[str, float], bucket: SizeBucket,
             method: Method) -> PreparedBatch:  # fmt: skip
    """The :class:`PreparedBatch` of a batch's integrals (an integral source's output): the problem
    built and laid out for the run's J-K backend."""
    start = time.perf_counter()
    with precision_scope(method.config.precision):
        problem, final = build_problem(integrals, method)
    timings = {**timings, "layout": (time.perf_counter() - start) / len(members)}
    return PreparedBatch(members, bucket, problem, final, timings)
