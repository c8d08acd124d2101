r"""Two-electron repulsion integrals (ERIs) by McMurchie-Davidson, per shell-quartet class, in JAX.

For primitive Gaussians with product centres P (exponents a + b = p) and Q (c + d = q),

.. math::

    (ab|cd) = \frac{2\pi^{5/2}}{pq\sqrt{p+q}} \sum_{tuv} E^{ab}_{tuv}
              \sum_{\tau\nu\phi} (-1)^{\tau+\nu+\phi} E^{cd}_{\tau\nu\phi}\,
              R_{t+\tau,u+\nu,v+\phi}(\alpha, \mathbf{R}_{PQ}), \qquad \alpha = \frac{pq}{p+q},

with the Hermite expansion coefficients E (products of the per-axis E^{ij}_t of
:mod:`.one_electron`) and the Hermite Coulomb integrals R of :func:`.one_electron.hermite_coulomb`
(McMurchie and Davidson, J. Comput. Phys. 26, 218 (1978); Helgaker, Jorgensen and Olsen,
*Molecular Electronic-Structure Theory*, 9.9).

Organisation (the shape of the work is fixed by the basis, not by the geometry):

- **Shell pairs** (a >= b in PySCF's shell order, l_a >= l_b after swapping, which the packed
  symmetric output does not see) are grouped in classes (l_a, l_b). For each pair and primitive
  pair, the kernel forms the Hermite matrix E (spherical AO pair, t u v), with the contraction
  coefficients and the Cartesian-to-spherical transform folded in: (pairs, K2, S_a S_b, H).
- **Shell quartets** (bra pair >= ket pair) are grouped in classes (bra class, ket class), 21 for
  s, p and d shells, and each class runs one kernel vmapped over its quartets, in blocks of
  :data:`BLOCK` quartets (``lax.map``), so memory stays bounded and a block is the unit a tile of
  the simulated IPU would own.
- The spherical values go straight into PySCF's 8-fold packed layout (``mol.intor("int2e",
  aosym="s8")``), through destination indices built once per basis on the host; that is the layout
  the J-K backends take.
- **No screening yet:** every shell quartet and every primitive quartet is computed (the plan is
  fixed by the basis, so shapes stay fixed); ``RKSConfig.eri_threshold`` still applies its Schwarz
  screening to the finished s8 array on the host. Quartets with all four shells on one atom are
  not computed at all: their values are constants of the plan (see :func:`_one_centre`).

Geometry enters through differences: A - C between atoms from a float64 host table, and P - A =
-(b/p)(A - B), so a quartet on one atom sees exactly zero displacements in float32 as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from pyscf import gto

from .basis import cartesian_powers, contracted_shells
from .one_electron import PairFactors, _stack, hermite_coefficients, hermite_coulomb

BLOCK = 256  # shell quartets per kernel call


@lru_cache(maxsize=None)
def hermite_indices(order: int) -> tuple[tuple[int, int, int], ...]:
    """The Hermite indices (t, u, v) with t + u + v <= ``order``, in a fixed order."""
    return tuple((t, u, v) for total in range(order + 1) for t in range(total, -1, -1)
                 for u in range(total - t, -1, -1) for v in [total - t - u])  # fmt: skip


@lru_cache(maxsize=None)
def cartesian_to_spherical(l: int) -> np.ndarray:
    """(Cartesian, spherical) transform of one shell, with libcint's normalisation (s and p included)."""
    return np.asarray(gto.cart2sph(l))


@dataclass(frozen=True)
class Shells:
    """The basis as contracted shells (one row per shell and contraction), primitives padded to K."""

    l: np.ndarray  # (S,) angular momentum
    atom: np.ndarray  # (S,) atom index
    nprim: np.ndarray  # (S,) primitives
    exponents: np.ndarray  # (S, K); padding repeats the first exponent (its coefficient is 0)
    coefficients: np.ndarray  # (S, K) PySCF's (radially normalised) contraction coefficients; 0 on padding
    offset: np.ndarray  # (S,) first spherical AO of the shell


def shells_of(mol: gto.Mole) -> Shells:
    """``mol``'s shells, a general contraction split into one row per contracted function."""
    rows = []
    ao_loc = mol.ao_loc_nr()
    for shell, l, atom, exps, coeff in contracted_shells(mol):
        rows += [(l, atom, exps, coeff[c], ao_loc[shell] + c * (2 * l + 1)) for c in range(len(coeff))]
    k = max(len(r[2]) for r in rows)
    return Shells(
        l=np.array([r[0] for r in rows]),
        atom=np.array([r[1] for r in rows]),
        nprim=np.array([len(r[2]) for r in rows]),
        exponents=np.stack([np.pad(r[2], (0, k - len(r[2])), constant_values=r[2][0]) for r in rows]),
        coefficients=np.stack([np.pad(r[3], (0, k - len(r[3]))) for r in rows]),
        offset=np.array([r[4] for r in rows]),
    )


def _packed(i, j):
    """Index of (i, j) in a packed lower triangle (either order)."""
    hi, lo = np.maximum(i, j), np.minimum(i, j)
    return hi * (hi + 1) // 2 + lo


@dataclass(frozen=True)
class PairClass:
    """Shell pairs (a, b) with angular momenta (la, lb), la >= lb, primitives padded to (ka, kb)."""

    la: int
    lb: int
    ka: int
    kb: int
    first: np.ndarray  # (n,) shell a
    second: np.ndarray  # (n,) shell b


@dataclass(frozen=True)
class QuartetClass:
    """Shell quartets (bra pair | ket pair) of two pair classes, padded to whole blocks."""

    bra: int  # pair class of the bra
    ket: int  # pair class of the ket
    bra_pairs: np.ndarray  # (Q,) rows of the bra class (padding: 0)
    ket_pairs: np.ndarray  # (Q,) rows of the ket class
    destination: np.ndarray  # (Q, S_a S_b, S_c S_d) index into the s8 array; its size for nothing


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: device arrays are cached per plan
class EriPlan:
    """Which shell quartets each class kernel evaluates, and where their values go (built once per basis)."""

    shells: Shells
    pairs: tuple[PairClass, ...]
    quartets: tuple[QuartetClass, ...]
    nao: int
    size: int  # entries of the s8 array
    natm: int
    one_centre_index: np.ndarray  # (M,) s8 positions of the integrals with all four AOs on one atom
    one_centre_value: np.ndarray  # (M,) their values (float64, from libcint: they do not depend on geometry)


def plan_eri(mol: gto.Mole, block: int = BLOCK) -> EriPlan:
    """Group ``mol``'s shell pairs and quartets into classes and work out the s8 destinations."""
    shells = shells_of(mol)
    nao = mol.nao_nr()
    npair = nao * (nao + 1) // 2
    size = npair * (npair + 1) // 2
    if size >= 2**31:
        raise ValueError(f"{nao} AOs: the s8 ERI array ({size:,} entries) exceeds 32-bit indexing")
    by_class: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a in range(len(shells.l)):
        for b in range(a + 1):
            first, second = (a, b) if shells.l[a] >= shells.l[b] else (b, a)
            by_class.setdefault((int(shells.l[first]), int(shells.l[second])), []).append((first, second))
    keys = sorted(by_class)
    pairs = []
    for la, lb in keys:
        rows = np.array(by_class[(la, lb)])
        pairs.append(PairClass(la, lb, int(shells.nprim[rows[:, 0]].max()), int(shells.nprim[rows[:, 1]].max()),
                               rows[:, 0], rows[:, 1]))  # fmt: skip
    quartets = []
    for x in range(len(pairs)):
        for y in range(x + 1):
            bra, ket = np.meshgrid(np.arange(len(pairs[x].first)), np.arange(len(pairs[y].first)), indexing="ij")
            bra, ket = bra.ravel(), ket.ravel()
            keep = (bra >= ket) if x == y else np.ones(len(bra), bool)
            atoms = [shells.atom[c.first[rows]] for c, rows in ((pairs[x], bra), (pairs[y], ket))]
            atoms += [shells.atom[c.second[rows]] for c, rows in ((pairs[x], bra), (pairs[y], ket))]
            keep &= ~((atoms[0] == atoms[1]) & (atoms[0] == atoms[2]) & (atoms[0] == atoms[3]))  # one-centre
            bra, ket = bra[keep], ket[keep]
            if not len(bra):
                continue
            destination = _destinations(shells, pairs[x], pairs[y], bra, ket, x == y, size)
            pad = -len(bra) % block
            quartets.append(QuartetClass(
                x, y, np.pad(bra, (0, pad)), np.pad(ket, (0, pad)),
                np.pad(destination, ((0, pad), (0, 0), (0, 0)), constant_values=size)))  # fmt: skip
    index, value = _one_centre(mol)
    return EriPlan(shells, tuple(pairs), tuple(quartets), nao, size, mol.natm, index, value)


def _one_centre(mol: gto.Mole) -> tuple[np.ndarray, np.ndarray]:
    """The s8 positions and float64 values of every ERI with all four AOs on one atom.

    These do not depend on the geometry, so libcint evaluates them once per plan; they are also
    the largest ERIs (core orbitals, up to ~5 Hartree), where float32's last digit alone is 5e-7,
    and the device path could not meet 1e-6 on them after summing hundreds of primitive terms.
    """
    index, value = [], []
    for shell_start, shell_stop, ao_start, ao_stop in mol.aoslice_by_atom():
        if shell_stop == shell_start:
            continue
        block = mol.intor("int2e", shls_slice=(shell_start, shell_stop) * 4)  # (n, n, n, n)
        aos = np.arange(ao_start, ao_stop)
        mu, nu = np.tril_indices(len(aos))
        ij = _packed(aos[mu], aos[nu])
        left, right = np.tril_indices(len(ij))
        index.append(_packed(ij[left], ij[right]))
        value.append(block[mu[left], nu[left], mu[right], nu[right]])
    return np.concatenate(index).astype(np.int32), np.concatenate(value)


def _destinations(shells: Shells, bra: PairClass, ket: PairClass, bi, ki, same_class: bool, size: int) -> np.ndarray:
    """(Q, S_a S_b, S_c S_d) s8 index of every value of every quartet; ``size`` for the repeats."""
    def aos(pair: PairClass, rows):
        a, b = pair.first[rows], pair.second[rows]
        mu = shells.offset[a][:, None, None] + np.arange(2 * pair.la + 1)[None, :, None]  # (Q, S_a, 1)
        nu = shells.offset[b][:, None, None] + np.arange(2 * pair.lb + 1)[None, None, :]  # (Q, 1, S_b)
        mu, nu = np.broadcast_arrays(mu, nu)
        # a shell with itself: (mu, nu) and (nu, mu) are one value; keep mu >= nu
        repeat = (a == b)[:, None, None] & (mu < nu)
        return _packed(mu, nu).reshape(len(rows), -1), repeat.reshape(len(rows), -1)

    ij, repeat_bra = aos(bra, bi)
    kl, repeat_ket = aos(ket, ki)
    index = _packed(ij[:, :, None], kl[:, None, :])
    repeat = repeat_bra[:, :, None] | repeat_ket[:, None, :]
    if same_class:  # a pair with itself: (ij|kl) and (kl|ij) are one value; keep ij >= kl
        repeat |= (bi == ki)[:, None, None] & (ij[:, :, None] < kl[:, None, :])
    return np.where(repeat, size, index).astype(np.int32)  # plan_eri refuses sizes beyond int32


# ---------------------------------------------------------------------------------------------
# Device side


@lru_cache(maxsize=None)
def _hermite_gather(la: int, lb: int):
    """Index arrays (3 axes) of shape (C_a C_b, H) into a stacked E table (i, j, t), for the Hermite matrix."""
    hermite = hermite_indices(la + lb)
    rows = [(pa, pb) for pa in cartesian_powers(la) for pb in cartesian_powers(lb)]
    return tuple(
        (np.array([[pa[axis] for _ in hermite] for pa, _ in rows], np.int32),
         np.array([[pb[axis] for _ in hermite] for _, pb in rows], np.int32),
         np.array([[h[axis] for h in hermite] for _ in rows], np.int32))
        for axis in range(3)
    )  # fmt: skip


@lru_cache(maxsize=None)
def _coulomb_gather(bra_order: int, ket_order: int):
    """(H_bra, H_ket) index into the R list of order bra + ket, and the sign (-1)^(tau + nu + phi)."""
    position = {h: n for n, h in enumerate(hermite_indices(bra_order + ket_order))}
    bra, ket = hermite_indices(bra_order), hermite_indices(ket_order)
    index = np.array([[position[(h[0] + g[0], h[1] + g[1], h[2] + g[2])] for g in ket] for h in bra], np.int32)
    sign = np.array([[(-1.0) ** sum(g) for g in ket] for _ in bra])
    return index, sign


def _pair_factors(plan: EriPlan, c: PairClass):
    """Host float64 -> (PairFactors, p, c_a c_b / p), each (n, K2), for the primitive pairs of a class."""
    sh = plan.shells
    a, b = sh.exponents[c.first, : c.ka, None], sh.exponents[c.second, None, : c.kb]  # (n, ka, 1), (n, 1, kb)
    coef = sh.coefficients[c.first, : c.ka, None] * sh.coefficients[c.second, None, : c.kb]
    flat = lambda x: np.broadcast_to(x, coef.shape).reshape(len(c.first), -1)  # noqa: E731
    p = a + b
    return PairFactors(*(flat(x) for x in (0.5 / p, a / p, b / p, a * b / p))), flat(p), flat(coef / p)


def _pair_data(la, lb, factors: PairFactors, p, scale, ab):
    """Per shell pair and primitive pair: the Hermite matrix (n, K2, S_a S_b, H) with the coefficients,
    1/p and the spherical transform folded in; P - A (n, K2, 3)."""
    n, k2 = p.shape
    e = None
    for axis, (i, j, t) in enumerate(_hermite_gather(la, lb)):
        table = _stack(hermite_coefficients(la, lb, factors, ab[:, None, axis]), la, lb, la + lb)  # (n, K2, i, j, t)
        factor = table[:, :, i, j, t]  # (n, K2, C_a C_b, H)
        e = factor if e is None else e * factor
    e = e * scale[:, :, None, None]
    h = e.shape[-1]
    sa, sb = cartesian_to_spherical(la), cartesian_to_spherical(lb)
    e = e.reshape(n, k2, sa.shape[0], sb.shape[0], h)
    e = jnp.einsum("nkabh,as,bt->nksth", e, jnp.asarray(sa, e.dtype), jnp.asarray(sb, e.dtype))
    pa = -factors.b_frac[:, :, None] * ab[:, None, :]
    return e.reshape(n, k2, -1, h), pa


def _quartet_block(bra_order, ket_order, bra, ket, shifts, bi, ki):
    """(B, S_a S_b, S_c S_d) ERIs of the quartets (bra rows ``bi`` | ket rows ``ki``) of one class."""
    e_bra, p_bra, pa_bra, atom_bra = bra
    e_ket, p_ket, pa_ket, atom_ket = ket
    p, q = p_bra[bi][:, :, None], p_ket[ki][:, None, :]  # (B, K2b, 1), (B, 1, K2k)
    ac = shifts[atom_bra[bi], atom_ket[ki]]  # (B, 3): A - C from the host's float64 table
    pq = ac[:, None, None, :] + pa_bra[bi][:, :, None, :] - pa_ket[ki][:, None, :, :]  # (B, K2b, K2k, 3)
    alpha = p * q / (p + q)
    order = bra_order + ket_order
    shape = alpha.shape
    weight = 2.0 * math.pi**2.5 / jnp.sqrt(p + q)  # (B, K2b, K2k)
    r = hermite_coulomb(order, alpha.reshape(-1), pq.reshape(-1, 3))
    r = jnp.stack([jnp.broadcast_to(r[h], (alpha.size,)) for h in hermite_indices(order)], -1).reshape(*shape, -1)
    index, sign = _coulomb_gather(bra_order, ket_order)
    b, kb, kk = shape
    rmat = jnp.take(r * weight[..., None], index.ravel(), axis=-1) * jnp.asarray(sign.ravel(), r.dtype)  # R'[h, g]
    rmat = rmat.reshape(b, kb, kk, *index.shape).transpose(0, 1, 3, 2, 4).reshape(b, kb * index.shape[0], -1)
    eb = e_bra[bi]  # (B, K2b, X, Hb)
    ek = e_ket[ki]  # (B, K2k, Y, Hk)
    ek = ek.transpose(0, 1, 3, 2).reshape(b, -1, ek.shape[2])  # (B, K2k Hk, Y)
    eb = eb.transpose(0, 2, 1, 3).reshape(b, eb.shape[2], -1)  # (B, X, K2b Hb)
    return jnp.matmul(eb, jnp.matmul(rmat, ek))


def eri_s8(plan: EriPlan, coords, dtype=jnp.float32) -> jax.Array:
    """The ERIs of ``plan``'s basis packed as PySCF's s8: (size,) for atom positions ``coords`` (natm, 3)
    in Bohr, or (C, size) for C conformers (C, natm, 3), computed as one batch.

    Host (numpy) positions have their differences formed in float64 on the host: exact zeros within
    an atom, full precision between atoms. JAX positions are differenced on the device, so the
    result can be differentiated with respect to them (the forces do, in float64).
    """
    if coords.shape[-2:] != (plan.natm, 3) or coords.ndim not in (2, 3):
        raise ValueError(f"coords has shape {coords.shape}: expected ([conformers,] {plan.natm}, 3)")
    if isinstance(coords, jax.Array):
        shifts = (coords[..., :, None, :] - coords[..., None, :, :]).astype(dtype)
    else:
        coords = np.asarray(coords, np.float64)
        shifts = jnp.asarray(coords[..., :, None, :] - coords[..., None, :, :], dtype)  # ([C,] natm, natm, 3)
    kernel = _eri_s8 if coords.ndim == 2 else _eri_s8_batch
    return kernel(_static(plan), _arrays(plan, jnp.dtype(dtype).name), shifts)


def _static(plan: EriPlan):
    return (tuple((c.la, c.lb) for c in plan.pairs), tuple((q.bra, q.ket) for q in plan.quartets), plan.size)


@lru_cache(maxsize=2)  # the destinations of a 6-31G* plan alone are ~200 MB
def _arrays(plan: EriPlan, dtype):
    """The plan's device arrays in ``dtype``, built and transferred once per (plan, dtype)."""
    dtype = jnp.dtype(dtype)
    sh = plan.shells
    pairs = tuple(
        jax.tree.map(lambda x: jnp.asarray(x, dtype), _pair_factors(plan, c))
        + (jnp.asarray(sh.atom[c.first], jnp.int32), jnp.asarray(sh.atom[c.second], jnp.int32))
        for c in plan.pairs
    )
    quartets = tuple(
        (jnp.asarray(q.bra_pairs.reshape(-1, BLOCK), jnp.int32), jnp.asarray(q.ket_pairs.reshape(-1, BLOCK), jnp.int32),
         jnp.asarray(q.destination.reshape(-1)))
        for q in plan.quartets
    )  # fmt: skip
    return pairs, quartets, jnp.asarray(plan.one_centre_index), jnp.asarray(plan.one_centre_value, dtype)


def _eri_s8_unjitted(static, arrays, shifts):
    pair_l, quartet_classes, size = static
    pair_arrays, quartet_arrays, one_centre_index, one_centre_value = arrays
    data = []
    for (la, lb), (factors, p, scale, atom_a, atom_b) in zip(pair_l, pair_arrays):
        e, pa = _pair_data(la, lb, factors, p, scale, shifts[atom_a, atom_b])
        data.append((e, p, pa, atom_a))
    out = jnp.zeros(size, shifts.dtype).at[one_centre_index].set(one_centre_value.astype(shifts.dtype))
    for (x, y), (bra_rows, ket_rows, destination) in zip(quartet_classes, quartet_arrays):
        orders = sum(pair_l[x]), sum(pair_l[y])
        # checkpointed: a gradient recomputes each block instead of keeping every block's Boys values
        block = jax.checkpoint(lambda rows: _quartet_block(*orders, data[x], data[y], shifts, *rows))
        values = jax.lax.map(block, (bra_rows, ket_rows))
        out = out.at[destination].set(values.reshape(-1), mode="drop", unique_indices=True)
    return out


_eri_s8 = jax.jit(_eri_s8_unjitted, static_argnums=0)
_eri_s8_batch = jax.jit(jax.vmap(_eri_s8_unjitted, in_axes=(None, None, 0)), static_argnums=0)
