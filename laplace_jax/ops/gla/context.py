"""Context-parallel GLA: one sequence split into P consecutive slices, one per device along a mesh
axis, with one all-gather of fixed-size states per layer whatever the sequence length.

Called inside a ``shard_map`` in which ``axis`` is manual; q, k, v, g are this device's slice
[B, T/P, H, .] of the sequence (slice p holds tokens p T/P .. (p+1) T/P - 1).

Forward. Per (batch, head), GLA's output is linear in the state a slice starts from: with b_t the
inclusive cumulative log-decay from the start of slice p to token t (a direct sum of g, <= 0),

    o_t = o_t^local + s (q_t * e^{b_t})^T S_in(p),

where o^local is the slice run from a zero state (``dispatch.gla``, any kernel). What slice p
needs from the slices before it is S_in(p), and that is a sum over them: with S_j the final state
slice j reaches from a zero state and G_j = sum of g over slice j (per key channel, <= 0),

    S_in(p) = sum_{j < p} e^{D(j, p)} * S_j  +  e^{D(-1, p)} * S_0^init,    D(j, p) = sum_{j < m < p} G_m,

each D a direct sum of the gathered G_m (a product with a 0/1 matrix at HIGHEST precision), never
the difference of two cumulative sums: nothing overflows or cancels at any decay. So each device
computes (S_p, G_p) from its slice, one all-gather along ``axis`` moves them ([B, H, K, V + 1]
fp32: the state with G as one more column; each device receives P - 1 of them), each device folds
the earlier ones into S_in(p), and corrects its outputs with one matmul (no re-run of the slice).
The sequence's final state is the same sum taken to the end, D(j, P) = sum_{m > j} G_m, so every
device returns it.

Backward (what autodiff of the above computes, every term again a product of direct-sum decays).
With dO the output gradient of slice p and dS_T that of the final state:

- dS_in(p) = sum_t s (q_t e^{b_t}) dO_t^T, and the local kernel's backward runs from dS_p below;
- the all-gather's transpose is a reduce-scatter: slice j receives, from every later slice p,
  dS_j = sum_{p > j} e^{D(j, p)} dS_in(p) + e^{D(j, P)} dS_T, i.e. the state gradient flows from
  later slices to earlier ones, P - 1 states per device again;
- dq_t gets s e^{b_t} (S_in dO_t); dg_t for t in slice p collects the pairs (u before the slice,
  r >= t in it) through b_r: sum_{r >= t} q_r dq_r^in, and the pairs (u before, r after slice p)
  through every D(j, p') with j < p < p': e^{D} rowsum(S_j * dS_in(p')). Both are sums of wanted
  pairs only, as in the chunk kernel's gate gradient (``chunk.py``).

Communication per layer and device: one all-gather of P x [B, H, K, V + 1] fp32 forward, and
its transpose backward (a reduce-scatter on XLA:CPU; the TPU compiler emits an all-reduce of the
stack instead); nothing activation-sized crosses ``axis``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.ops.gla.dispatch import gla
from laplace_jax.ops.gla.levels import HIGHEST, dot, level_matrices, sums

Array = jax.Array
f32 = jnp.float32


def _spans(P: int) -> np.ndarray:
    """0/1 [P + 1, P + 1, P]: spans[i, p, m] = 1 where m lies strictly between slices i - 1 and p
    (i = 0 is the initial state, before slice 0; p = P is the end of the sequence)."""
    i, p, m = (np.arange(P + 1)[:, None, None], np.arange(P + 1)[None, :, None], np.arange(P)[None, None, :])
    return ((m > i - 1) & (m < p)).astype(np.float32)


def _from_slice_start(g: Array, C: int) -> Array:
    """[B, T, H, K] fp32 log-decays -> b, the inclusive sums from the slice's first token: within
    each chunk a product with a 0/1 matrix, plus the earlier chunks' totals summed over chunks.
    (Not ``jnp.cumsum`` over T: the TPU compiler lowers that to a reduce-window as long as the
    slice.)"""
    B, T, H, K = g.shape
    chunks = g.reshape(B, T // C, C, H, K)
    within = sums(level_matrices(C)["incl"], "rt,bnthk->bnrhk", chunks)
    before = jnp.cumsum(jnp.concatenate([jnp.zeros_like(within[:, :1, -1]), within[:, :-1, -1]], axis=1), axis=1)
    return (within + before[:, :, None]).reshape(B, T, H, K)


def context_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    *,
    axis: str,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 128,
    impl: str = "chunk",
) -> tuple[Array, Array]:
    """GLA over a sequence split along mesh axis ``axis``: (o [B, T/P, H, V] of this slice, the
    whole sequence's final state [B, H, K, V] fp32, the same on every device of ``axis``).

    ``initial_state``: the state before slice 0 (the same on every device), or zeros. ``chunk_size``
    and ``impl`` go to ``dispatch.gla`` for each slice; T/P must be a multiple of ``chunk_size``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T % chunk_size:
        raise ValueError(f"each device's slice ({T} tokens) must be a multiple of chunk_size {chunk_size}")
    scale = K**-0.5 if scale is None else float(scale)
    P = jax.lax.axis_size(axis)
    p = jax.lax.axis_index(axis)
    o, s_local = gla(q, k, v, g, impl=impl, scale=scale, chunk_size=chunk_size)
    g32 = g.astype(f32)
    G = jnp.sum(g32, axis=1)  # [B, H, K]: the slice's total log-decay
    with jax.named_scope("context_states"):  # the name ``hlo_stats.source_of`` files it under
        packed = jax.lax.all_gather(jnp.concatenate([s_local, G[..., None]], axis=-1), axis)  # [P, B, H, K, V+1]
    S_all, G_all = packed[..., :V], packed[..., V]
    s0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    states = jnp.concatenate([s0[None], S_all], axis=0)  # [P + 1, ...]: the initial state, then the slices
    spans = jnp.asarray(_spans(P))

    def fold(end):
        """sum_i [i - 1 < end] e^{D(i - 1, end)} * states[i], the state reaching slice ``end``."""
        D = jnp.einsum("im,mbhk->ibhk", jnp.take(spans, end, axis=1), G_all, precision=HIGHEST)
        before = (jnp.arange(P + 1) <= end)[:, None, None, None, None]
        return jnp.sum(jnp.where(before, jnp.exp(D)[..., None] * states, 0.0), axis=0)

    s_in, s_final = fold(p), fold(P)
    b = _from_slice_start(g32, chunk_size)
    o_in = dot("bthk,bhkv->bthv", q.astype(f32) * (scale * jnp.exp(b)), s_in, q.dtype)
    return (o.astype(f32) + o_in).astype(v.dtype), s_final
