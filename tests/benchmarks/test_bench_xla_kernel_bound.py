"""benchmarks.bench_xla_kernel_bound: each stand-in removes what it names from the XLA kernel's
program, and the kernel is itself again afterwards."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bench_xla_kernel_bound import STANDINS, standin
from laplace_jax.ops.gla.chunk import chunk_gla

B, T, H, K, V = 1, 256, 2, 16, 32


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k = (jax.random.normal(x, (B, T, H, K)) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, K)))
    return q, k, v, g


def _loss(q, k, v, g):
    return chunk_gla(q, k, v, g, layout="full")[0].sum()


def _highest_dots(fn, *args) -> int:
    """dot_generals at HIGHEST precision in the jaxpr of ``fn``: the 0/1-matrix direct sums."""
    stack, n = list(jax.make_jaxpr(fn)(*args).jaxpr.eqns), 0
    while stack:
        e = stack.pop()
        if e.primitive.name == "dot_general" and "HIGHEST" in str(e.params.get("precision")):
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            stack.extend(sub.eqns)
    return n


def test_the_standins_remove_the_level_sums_and_are_undone():
    args = _inputs()
    grad = jax.grad(_loss, argnums=(0, 1, 2, 3))
    exact_dots = _highest_dots(grad, *args)
    want = jax.jit(grad)(*args)
    with standin("exponents_free"):
        free_dots = _highest_dots(grad, *args)
    with standin("one_matmul_scores"):
        got = jax.jit(grad)(*args)
    # the state path's sums stay in every variant; the levels' go with the exponents stand-in
    assert 0 < free_dots < exact_dots
    assert not all(np.allclose(a, b) for a, b in zip(got, want, strict=True))  # a stand-in: other numbers
    again = jax.jit(grad)(*args)
    for a, b in zip(again, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("variant", list(STANDINS))
def test_every_standin_compiles_the_whole_kernel(variant):
    args = _inputs()
    with standin(variant):
        o = jax.jit(lambda *a: chunk_gla(*a, layout="full")[0])(*args)
    assert o.shape == (B, T, H, V) and bool(jnp.all(jnp.isfinite(o)))
