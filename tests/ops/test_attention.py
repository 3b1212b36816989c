"""The blocked softmax attention kernel vs references: the float64 NumPy definition (outputs)
and PyTorch float64 autograd (gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from laplace_jax.ops.attention import Prefix, chunk_attention, naive_attention

# (T, chunk, window, kv heads): partial last blocks, windows shorter than, equal to and longer
# than a block, a window of 1 (each token itself), windows past T, GQA 4:1 and 2:1, MQA.
CASES = [(37, 8, None, 4), (37, 8, 5, 2), (64, 16, 16, 1), (64, 16, 40, 4), (5, 16, 3, 2), (100, 32, 1, 2),
         (50, 16, 200, 1)]  # fmt: skip


def inputs(T, N, seed=0, H=4, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, T, H, d)).astype(np.float32)
    k = rng.standard_normal((2, T, N, d)).astype(np.float32)
    v = rng.standard_normal((2, T, N, d)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("T,chunk,window,N", CASES)
def test_outputs_equal_the_float64_definition(T, chunk, window, N):
    q, k, v = inputs(T, N)
    got = chunk_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window=window, chunk_size=chunk)
    want = naive_attention(q, k, v, window=window)
    assert np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max()


def torch_attention(q, k, v, window):
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & ((j > i - window) if window is not None else True)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), v)


@pytest.mark.parametrize("T,chunk,window,N", CASES[:4])
def test_gradients_equal_torch_float64(T, chunk, window, N):
    q, k, v = inputs(T, N, seed=1)
    w = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    loss = lambda q, k, v: jnp.sum(chunk_attention(q, k, v, window=window, chunk_size=chunk) * w)  # noqa: E731
    got = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    (torch_attention(tq, tk, tv, window) * torch.tensor(w, dtype=torch.float64)).sum().backward()
    for g, t in zip(got, (tq, tk, tv), strict=True):
        ref = t.grad.numpy()
        assert np.abs(np.asarray(g) - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_prefix_of_earlier_keys_equals_attending_the_whole_sequence():
    """Queries 20..36 with keys 0..19 as a Prefix (in shuffled slots, two of them invalid) see what
    the same queries see in the whole 37-token sequence."""
    q, k, v = inputs(37, 2, seed=3)
    whole = naive_attention(q, k, v, window=9)[:, 20:]
    order = np.random.default_rng(4).permutation(22)  # 20 real slots and 2 empty ones
    pk = np.concatenate([k[:, :20], np.full((2, 2, 2, 8), 99.0, np.float32)], axis=1)[:, order]
    pv = np.concatenate([v[:, :20], np.full((2, 2, 2, 8), 99.0, np.float32)], axis=1)[:, order]
    pos = np.concatenate([np.arange(20), [-1, -1]])[order]
    prefix = Prefix(
        jnp.asarray(pk), jnp.asarray(pv), jnp.asarray(np.tile(pos, (2, 1))), jnp.asarray(np.tile(pos >= 0, (2, 1)))
    )
    got = chunk_attention(
        jnp.asarray(q[:, 20:]), jnp.asarray(k[:, 20:]), jnp.asarray(v[:, 20:]),
        window=9, chunk_size=8, start=jnp.array([20, 20]), prefix=prefix,
    )  # fmt: skip
    assert np.abs(np.asarray(got) - whole).max() <= 1e-5 * np.abs(whole).max()


def test_bf16_inputs_keep_fp32_statistics():
    q, k, v = inputs(64, 2, seed=5)
    got = chunk_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), window=24, chunk_size=16)
    want = naive_attention(q, k, v, window=24)
    assert got.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got, np.float32) - want).max() <= 3e-2 * np.abs(want).max()


def test_backward_keeps_no_score_matrix():
    """The backward recomputes each block's scores: no [T, T] buffer in the compiled gradient."""
    T = 512
    q, k, v = (jnp.zeros((1, T, 2, 16)) for _ in range(3))
    grad = jax.jit(jax.grad(lambda q: jnp.sum(chunk_attention(q, k, v, window=64, chunk_size=64))))
    hlo = grad.lower(q).compile().as_text()
    assert f"{T},{T}]" not in hlo and f"{T}, {T}]" not in hlo
