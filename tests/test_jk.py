"""J-K backends agree with each other and with PySCF's float64 contraction of the same integrals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pyscf import scf

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.prepare import prepare
from pyscf_ipu.packed import batch_eris, degeneracy_weights, unique_quartets
from pyscf_ipu.jk import JK_BACKENDS, ExactERIs
from pyscf_ipu.molecule import from_name


# the backends of the exact ERIs (density fitting has its own tests: tests/test_fitting.py)
EXACT = sorted(name for name, make in JK_BACKENDS.items() if isinstance(make(RKSConfig()), ExactERIs))


def member(stacked: dict) -> dict:
    """The J-K arrays of the first (only) conformer of a prepared batch."""
    return jax.tree.map(lambda a: a[0], stacked)


def random_density(n, rng):
    c = rng.normal(size=(n, n // 2))
    return c @ c.T / n  # symmetric, positive semi-definite, like a density matrix


@pytest.fixture(scope="module", params=[("benzene", "sto-3g"), ("water", "6-31g*")], ids=lambda p: "-".join(p))
def case(request):
    name, basis = request.param
    host = prepare([from_name(name)], resolve(RKSConfig(basis=basis, xc="hf")))[0]
    dm = random_density(host.nao, np.random.default_rng(1))
    vj, vk = scf.hf.dot_eri_dm(host.eri_s8, dm, hermi=1)  # float64 reference
    return host, dm, vj, vk


def relative_error(a, b):
    return np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b))


@pytest.mark.parametrize("name", EXACT)
def test_backend_float64_matches_pyscf(case, name):
    host, dm, vj, vk = case
    backend = resolve(RKSConfig(jk=name)).backend
    npad = host.nao + 3  # padding must not change the result
    with jax.enable_x64(True):
        data = member(backend.prepare(batch_eris([host.eri_s8], npad, np.float64), npad, np.float64))
        dm_pad = np.zeros((npad, npad))
        dm_pad[: host.nao, : host.nao] = dm
        j, k = jax.jit(backend.contract)(data, jnp.asarray(dm_pad))
    n = host.nao
    assert np.all(np.asarray(j)[n:] == 0) and np.all(np.asarray(k)[:, n:] == 0)
    # float64 round-off only
    assert relative_error(j[:n, :n], vj) < 1e-12
    assert relative_error(k[:n, :n], vk) < 1e-12


def test_float32_backends_agree_within_1e5(case):
    """The acceptance tolerance: s8 equals the dense reference within 1e-5 relative in float32."""
    host, dm, vj, vk = case
    results = {}
    for name in EXACT:
        backend = resolve(RKSConfig(jk=name)).backend
        data = member(backend.prepare(batch_eris([host.eri_s8], host.nao, np.float32), host.nao, np.float32))
        results[name] = jax.jit(backend.contract)(data, jnp.asarray(dm, jnp.float32))
        assert results[name][0].dtype == jnp.float32
    j_dense, k_dense = (np.asarray(a, np.float64) for a in results["dense"])
    for name, (j, k) in results.items():
        assert relative_error(j, j_dense) < 1e-5, name
        assert relative_error(k, k_dense) < 1e-5, name
        # and both are float32-close to the float64 truth
        assert relative_error(j, vj) < 1e-5 and relative_error(k, vk) < 1e-5


def test_degeneracy_weights_count_every_element_once():
    """Expanding unique quartets over their 8 permutations with these weights rebuilds the full tensor."""
    host = prepare([from_name("water")], resolve(RKSConfig(xc="hf")))[0]
    n = host.nao
    values, index = unique_quartets(host.eri_s8, n)
    weights = degeneracy_weights(index)
    full = np.zeros((n,) * 4)
    i, j, k, l = index.T.astype(int)
    for a, b, c, d in [(i, j, k, l), (j, i, k, l), (i, j, l, k), (j, i, l, k),
                       (k, l, i, j), (l, k, i, j), (k, l, j, i), (l, k, j, i)]:  # fmt: skip
        np.add.at(full, (a, b, c, d), values * weights)
    from pyscf import ao2mo

    np.testing.assert_allclose(full, ao2mo.restore(1, host.eri_s8, n), atol=1e-14)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown J-K backend 'gpu-magic': choose one of dense, df, ipu, s8"):
        resolve(RKSConfig(jk="gpu-magic"))
