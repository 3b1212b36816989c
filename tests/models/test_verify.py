"""A speculative verify (``verify`` + ``commit``): N tokens in one pass give the logits of N decode
steps, and the committed state after the first e of them is the state of e decode steps, for both
traces (the layers' inputs replayed, or every position's state kept), in GLA and hybrid models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import ModelConfig, decode_step, init_params, prefill
from laplace_jax.layers.common import TRACES
from laplace_jax.models.gla_lm import commit, verify

N = 5
GLA = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, n_kv_heads=1, init_std=0.1)
HYBRID = ModelConfig(  # a window shorter than N + 1: the verify's keys overwrite ring slots a rollback needs
    vocab_size=61,
    d_model=64,
    n_layers=3,
    n_heads=2,
    use_short_conv=True,
    chunk_size=8,
    max_seq_len=64,
    init_std=0.1,
    attn=dict(layers=[1], num_heads=4, num_kv_heads=2, window_size=4),
)


@pytest.mark.parametrize("keep", TRACES)
@pytest.mark.parametrize("cfg", [GLA, HYBRID], ids=["gla", "hybrid"])
def test_verify_is_n_decode_steps_and_commit_rolls_back_to_any_of_them(cfg, keep):
    params = init_params(cfg, jax.random.key(0))
    B = 4
    prompt = jax.random.randint(jax.random.key(1), (B, 9), 0, cfg.vocab_size)
    fed = jax.random.randint(jax.random.key(2), (B, N), 0, cfg.vocab_size)
    _, state = prefill(cfg, params, prompt)
    live = jnp.array([True, True, True, False])
    logits, trace = jax.jit(verify, static_argnums=(0, 5))(cfg, params, fed, state, live, keep)

    step = jax.jit(decode_step, static_argnums=0)
    states, s = [state], state
    for t in range(N):  # the reference: one token at a time
        out, s = step(cfg, params, fed[:, t], s, live)
        np.testing.assert_allclose(logits[:3, t], out[:3], atol=2e-5 * float(jnp.abs(out).max()))
        states.append(s)

    emitted = jnp.array([1, 3, N, 0])
    got = jax.jit(commit, static_argnums=0)(cfg, state, trace, emitted)
    for b, e in enumerate(np.asarray(emitted)):
        want = jax.tree.map(lambda x, b=b: x[b], states[e])
        have = jax.tree.map(lambda x, b=b: x[b], got)
        for (path, w), h in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(have), strict=True):
            tol = 2e-5 * float(np.abs(w).max())  # the verify's forward and the steps' differ in fp32 rounding
            np.testing.assert_allclose(h, w, rtol=0, atol=tol, err_msg=f"row {b}, {e} emitted, {path}")
    # a row that was not live, or emitted nothing, keeps its state bit for bit
    for w, h in zip(jax.tree.leaves(state), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(h[3], w[3])


def test_a_bad_trace_name_is_refused():
    params = init_params(GLA, jax.random.key(0))
    _, state = prefill(GLA, params, jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="keep must be one of"):
        verify(GLA, params, jnp.zeros((1, N), jnp.int32), state, jnp.array([True]), "states")
