"""The device-side SCF problem: host arrays padded to shared shapes and cast to the run's precision.

Padding rules (so that one compiled SCF loop serves every molecule in a shape bucket):

- grid points beyond G carry zero weight and zero AO values;
- AOs beyond N have zero integrals, zero AO values and unit overlap;
- columns of the orthogonaliser X beyond its M kept columns (padded AOs and projected-out linear
  dependencies alike) are zero, and the Fock matrix in the orthogonal basis gets
  :data:`VIRTUAL_SHIFT` on their diagonal. They become exactly decoupled empty orbitals far above
  the LUMO. The value is moderate on purpose: a float32 eigensolver's absolute error grows with the
  largest eigenvalue, so a huge shift (1e6) would ruin the real orbital energies.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .host import HostProblem
from .jk import JKBackend
from .padding import aligned_empty, bucket, pad_to

VIRTUAL_SHIFT = 10.0  # Hartree; above any real orbital energy of the supported bases


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
        """(Np, Gp): the key under which compiled code is shared."""
        return self.hcore.shape[0], self.weights.shape[0]


def padded_sizes(host: HostProblem) -> tuple[int, int]:
    """(Np, Gp): the bucketed AO count (a multiple of 8 at least) and grid size.

    AOs are bucketed finely (at most 1/8 more) since ERI memory and work grow as N^4.
    """
    return bucket(host.nao, minimum=8), bucket(host.grid_points, minimum=256)


def build_problem(host: HostProblem, backend: JKBackend, dtype, sizes: tuple[int, int] | None = None) -> SCFProblem:
    """Pad ``host`` to ``sizes`` (default :func:`padded_sizes`) and cast to ``dtype``.

    The host-side fields stay numpy arrays (a jitted call transfers them; :func:`stack_problems`
    stacks a batch on the host first, so it crosses to the device once); the J-K backend's arrays
    are whatever its ``prepare`` made, device arrays for ``ipu``.
    """
    n, g = host.nao, host.grid_points
    npad, gpad = sizes or padded_sizes(host)
    if npad < n or gpad < g:
        raise ValueError(f"padded sizes {(npad, gpad)} are smaller than the problem's {(n, g)}")
    m = host.orthogonaliser.shape[1]
    overlap = pad_to(host.overlap, (npad, npad))
    overlap[n:, n:] = np.eye(npad - n)
    shift = np.where(np.arange(npad) < m, 0.0, VIRTUAL_SHIFT)
    occupation = np.where(np.arange(npad) < host.nocc, 2.0, 0.0)
    arrays = dict(
        hcore=pad_to(host.hcore, (npad, npad)),
        overlap=overlap,
        orthogonaliser=pad_to(host.orthogonaliser, (npad, npad)),
        virtual_shift=shift,
        density_guess=pad_to(host.density_guess, (npad, npad)),
        occupation=occupation,
        nuclear_repulsion=np.asarray(host.nuclear_repulsion),
        ao=pad_to(host.ao, (4, gpad, npad), dtype),  # the largest array: cast while padding
        weights=pad_to(host.grid_weights, (gpad,)),
    )
    jk = backend.prepare(host.eri_s8, n, npad, dtype)
    return SCFProblem(**{k: np.asarray(v, dtype) for k, v in arrays.items()}, jk=jk)


def stack_problems(problems: list[SCFProblem], batch_size: int | None = None) -> SCFProblem:
    """Stack problems of equal padded shapes along a new leading axis, for a vmapped loop.

    The J-K backends' arrays may differ in size between conformers (e.g. the number of unique
    integrals); they are zero-padded to the largest, which every backend treats as no work (zero
    integrals, zero rows). ``batch_size`` pads the batch itself by repeating the last problem, so a
    short final batch reuses the compiled loop; callers drop those extra results.
    """
    shapes = {p.shapes for p in problems}
    if len(shapes) != 1:
        raise ValueError(f"a batch needs one padded shape; got {sorted(shapes)}")
    if len({tuple(sorted(p.jk)) for p in problems}) != 1:
        raise ValueError("a batch needs one J-K layout (the tile plans chose different strategies)")
    problems = list(problems) + [problems[-1]] * max(0, (batch_size or 0) - len(problems))

    def stack(*leaves):
        shape = tuple(int(s) for s in np.max([np.shape(leaf) for leaf in leaves], axis=0)) if np.ndim(leaves[0]) else ()
        if all(isinstance(leaf, np.ndarray) for leaf in leaves):
            return host_stack(leaves, shape)
        return jnp.stack([pad_leaf(jnp.asarray(leaf), shape) for leaf in leaves])

    return jax.tree.map(stack, *problems)


def pad_leaf(array, shape: tuple[int, ...]):
    """``array`` (numpy or JAX) zero-padded at the end of each axis to ``shape``."""
    if array.shape == shape:
        return array
    xp = np if isinstance(array, np.ndarray) else jnp
    return xp.pad(array, [(0, s - d) for s, d in zip(shape, array.shape)])


def host_stack(arrays, shape: tuple[int, ...]) -> jax.Array:
    """Stack host arrays (zero-padded to ``shape``) into one device array, without a second copy.

    The stack is written into a 64-byte-aligned buffer that the CPU device adopts as is
    (``may_alias``): for a batch of 8 conformers of a 9-heavy-atom molecule the AO values alone are
    110 MB, and copying them into device memory took longer than the rest of the batch's transfer.
    The buffer is new for every call and never written again, so the alias is safe.
    """
    out = aligned_empty((len(arrays),) + shape, arrays[0].dtype)
    for i, array in enumerate(arrays):
        out[i] = pad_leaf(array, shape)
    return jax.device_put(out, may_alias=True)
