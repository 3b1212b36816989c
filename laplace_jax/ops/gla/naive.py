"""The float64 reference of GLA: the recurrence token by token in NumPy float64, written from the
equations and sharing no code with the kernels. The benchmarks measure every kernel's error
against it (the tests use the PyTorch one in ``tests/torch_gla.py``). Its vector-Jacobian
product is the reverse-time recurrence, also in float64, so gradient errors need no autodiff
framework either. ``random_gla_inputs`` draws the inputs those figures (and the tests) use;
``decay_sweep_inputs`` the decay sweep's (its benchmark and its test share them).

Per head, with s the scale: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T and o_t = S_t^T (s q_t).
"""

from __future__ import annotations

import numpy as np


def naive_gla(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    initial_state: np.ndarray | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] or None ->
    (o [B, T, H, V], final state [B, H, K, V]), both float64."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    S = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else np.array(initial_state, np.float64)
    o = np.empty(v.shape)
    for t in range(T):
        S = np.exp(g[:, t])[..., None] * S + k[:, t][..., None] * v[:, t][..., None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def naive_gla_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    initial_state: np.ndarray,
    do: np.ndarray,
    dS_final: np.ndarray,
    scale: float | None = None,
) -> tuple[np.ndarray, ...]:
    """Gradients (dq, dk, dv, dg, d initial_state), float64, of sum(o * do) + sum(S_T * dS_final).

    Backward in time: dS_t (the gradient on S_t) = dS_{t+1} * exp(g_{t+1}) + s q_t do_t^T, and
    dq_t = s S_t do_t, dk_t = dS_t v_t, dv_t = dS_t^T k_t, dg_t = rowsum(dS_t * exp(g_t) S_{t-1})."""
    q, k, v, g, do = (np.asarray(x, np.float64) for x in (q, k, v, g, do))
    T, K = q.shape[1], q.shape[3]
    scale = K**-0.5 if scale is None else scale
    states = [np.array(initial_state, np.float64)]
    for t in range(T):
        states.append(np.exp(g[:, t])[..., None] * states[-1] + k[:, t][..., None] * v[:, t][..., None, :])
    dq, dk, dv, dg = np.empty(q.shape), np.empty(k.shape), np.empty(v.shape), np.empty(g.shape)
    dS = np.array(dS_final, np.float64)
    for t in reversed(range(T)):
        dS = dS + scale * q[:, t][..., None] * do[:, t][..., None, :]
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", states[t + 1], do[:, t])
        dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
        dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, t])
        decayed = np.exp(g[:, t])[..., None] * states[t]
        dg[:, t] = np.sum(dS * decayed, axis=-1)
        dS = dS * np.exp(g[:, t])[..., None]
    return dq, dk, dv, dg, dS


def random_gla_inputs(
    T: int, decay: str, seed: int = 0, B: int = 2, H: int = 2, K: int = 16, V: int = 32, dtype=np.float32
) -> tuple[np.ndarray, ...]:
    """(q, k, v, g, s0): normal q, k, v and s0, and per-token log-decays g that are fla-like
    ("weak": logsigmoid(z) / 16) or "strong" (down to about -50 nats/token, some near 0)."""
    r = np.random.default_rng(seed)
    q, k = (r.standard_normal((B, T, H, K)).astype(dtype) for _ in range(2))
    v = r.standard_normal((B, T, H, V)).astype(dtype)
    if decay == "weak":
        g = np.log(1 / (1 + np.exp(-r.standard_normal((B, T, H, K))))) / 16
    else:
        z = r.standard_normal((B, T, H, K)) * 30 - 20
        g = -np.logaddexp(0, -z)
    s0 = r.standard_normal((B, H, K, V)).astype(np.float32)
    return q, k, v, g.astype(np.float32), s0


# The decay sweep: per-token log-decays from almost none to -16 nats/token, and "mixed" (each key
# channel at one of them), at B2 T150 H2 K32 V32 with chunk 64.
SWEEP_DECAYS = (-0.01, -0.1, -1.0, -4.0, -8.0, -16.0, "mixed")
SWEEP_SHAPE = {"B": 2, "T": 150, "H": 2, "K": 32, "V": 32, "chunk_size": 64}


def decay_sweep_inputs(decay: float | str, seed: int = 0) -> list[np.ndarray]:
    """(q, k, v, g, s0, w_o, w_s) in float64 for one of ``SWEEP_DECAYS``: g is the decay with 5%
    jitter per token and channel; w_o and w_s weigh the output and the final state in the loss."""
    B, T, H, K, V = (SWEEP_SHAPE[n] for n in "BTHKV")
    r = np.random.default_rng(seed)
    q, k = (r.standard_normal((B, T, H, K)) for _ in range(2))
    v, s0 = r.standard_normal((B, T, H, V)), r.standard_normal((B, H, K, V))
    levels = np.array([d for d in SWEEP_DECAYS if d != "mixed"])
    base = levels[r.integers(0, len(levels), (1, 1, H, K))] if decay == "mixed" else np.full((1, 1, H, K), decay)
    g = np.minimum(base * (1 + 0.05 * r.standard_normal((B, T, H, K))), 0.0)
    return [q, k, v, g, s0, r.standard_normal((B, T, H, V)), r.standard_normal((B, H, K, V))]


def rel_error(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref|, in float64."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))
