"""GLA's low-rank log-decay gate as a Mosaic kernel (interpreted on CPU) against a float64
computation over the decay sweep (-0.01 to -16 nats per token), against the XLA form it replaces,
its gradient against that form's, and where ``log_decay_takes`` sends it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.matmul import log_decay_reference, log_decay_takes, rows_log_decay

NORMALIZER = 16.0


def _inputs(M, D, r, N, seed):
    """bf16 x, w0, w1 and a bias whose logits put the decays across the sweep: log_sigmoid(z) / 16
    from -0.01 (z = 1.75) to -16 (z = -256) nats per token, spread over the N columns."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, D)), jnp.bfloat16)
    w0 = jnp.asarray(rng.standard_normal((D, r)) / np.sqrt(D), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((r, N)) / np.sqrt(r), jnp.bfloat16)
    targets = -np.geomspace(0.01, 16.0, N)  # nats per token
    z = -np.log(np.expm1(-targets * NORMALIZER))  # log_sigmoid(z) = -log(1 + e^-z) = 16 * target
    return x, w0, w1, jnp.asarray(rng.permutation(z), jnp.bfloat16)


def _float64(x, w0, w1, bias, clamp):
    """The gate in float64, from x w0 rounded to bf16 as the contract says (the one rounding
    inside), with the bound of that rounding's effect: |w1| times half a bf16 ulp of h."""
    x64, w0_64, w1_64 = (np.asarray(a, np.float64) for a in (x, w0, w1))
    h64 = x64 @ w0_64
    h = np.asarray(jnp.asarray(h64, jnp.bfloat16), np.float64)
    g = h @ w1_64 + np.asarray(bias, np.float64)
    d = -np.logaddexp(0.0, -g) / NORMALIZER
    d = d if clamp is None else np.maximum(d, clamp)
    slack = 2.0**-8 * (np.abs(h64) @ np.abs(w1_64)) + 2.0**-20 * (1 + np.abs(g))
    return d, slack / NORMALIZER


@pytest.mark.parametrize("M, D, r, N", [(8, 256, 16, 256), (256, 384, 16, 768), (1, 128, 8, 512)])
@pytest.mark.parametrize("clamp", [None, -5.0])
def test_the_kernel_is_the_float64_gate_over_the_decay_sweep(M, D, r, N, clamp):
    """fp32 [M, N]: within the bf16 rounding of x w0 carried through w1 (log_sigmoid is
    1-Lipschitz), fp32 roundings and a 2^-21 relative error of the fp32 log-sigmoid of the
    float64 gate, as the XLA form on this backend is; and equal to that form within 1e-6 (relative)
    for all but the few entries where an fp32 sum in another order rounds x w0 to the other bf16."""
    x, w0, w1, bias = _inputs(M, D, r, N, seed=M + N)
    got = np.asarray(jax.jit(lambda *a: rows_log_decay(*a, None, NORMALIZER, clamp, True))(x, w0, w1, bias), np.float64)
    want, slack = _float64(x, w0, w1, bias, clamp)
    assert got.shape == (M, N)
    low = -10 if clamp is None else clamp  # the sweep reaches both ends (the clamp holds the low one)
    assert want.min() <= low and want.max() > -0.05 and (clamp is None or np.mean(want == clamp) > 0.1)
    assert np.all(np.abs(got - want) <= slack + 2.0**-21 * np.abs(want))
    xla = np.asarray(log_decay_reference(x, w0, w1, bias, NORMALIZER, clamp), np.float64)
    assert np.all(np.abs(xla - want) <= slack + 2.0**-21 * np.abs(want))  # the bound holds for XLA too
    # the same fp32 steps: equal but where an fp32 sum in another order rounds x w0 to the other bf16
    assert np.mean(np.isclose(got, xla, rtol=1e-6, atol=1e-7)) > 0.99


def test_the_gradient_is_the_xla_forms():
    """fp32 operands, a row mask: the custom VJP's gradients against jax.grad of the XLA form."""
    x, w0, w1, bias = (a.astype(jnp.float32) for a in _inputs(16, 256, 16, 256, seed=3))
    ct = jnp.asarray(np.random.default_rng(4).standard_normal((16, 256)), jnp.float32)
    args, valid, which = (x, w0, w1, bias), jnp.arange(16) % 3 > 0, (0, 1, 2, 3)
    ours = jax.grad(lambda *a: jnp.sum(rows_log_decay(*a, valid, NORMALIZER, None, True) * ct), argnums=which)(*args)
    xla = jax.grad(lambda *a: jnp.sum(log_decay_reference(*a, NORMALIZER, None, valid) * ct), argnums=which)(*args)
    for a, b in zip(ours, xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_takes_few_rows_lane_tiles_and_two_column_blocks():
    assert log_decay_takes(256, 3072, 16, 1536)  # the 3B decode step
    assert log_decay_takes(512, 1024, 16, 512)
    assert not log_decay_takes(513, 3072, 16, 1536)  # beyond the few-row kernels' rows
    assert not log_decay_takes(256, 3000, 16, 1536)  # D not whole lane tiles
    assert not log_decay_takes(256, 3072, 16, 384)  # N not two blocks of lane tiles
    assert not log_decay_takes(256, 3072, 256, 1536)  # a rank wider than one lane tile


def test_rows_not_valid_are_zero_and_the_rest_unchanged():
    """A row mask (serving's padding rows): 0 there, bit for bit the unmasked kernel elsewhere,
    as the XLA form's select."""
    x, w0, w1, bias = _inputs(256, 256, 16, 256, seed=9)
    valid = jnp.asarray(np.random.default_rng(9).random(256) < 0.7)
    run = jax.jit(lambda v, *a: rows_log_decay(*a, v, NORMALIZER, None, True))
    masked, plain = np.asarray(run(valid, x, w0, w1, bias)), np.asarray(run(None, x, w0, w1, bias))
    keep = np.asarray(valid)
    assert np.all(masked[~keep] == 0.0) and np.array_equal(masked[keep], plain[keep])
    xla = np.asarray(log_decay_reference(x, w0, w1, bias, NORMALIZER, None, valid))
    assert np.all(xla[~keep] == 0.0)
