"""The one place a GLA kernel is chosen. The ops use the config's names: ``model.attn_impl`` is
"chunk" (``chunk_gla``, the XLA chunk kernel: every backend), "pallas" (``pallas_gla``: a
Triton-lowered GPU kernel, interpreted on CPU), "mosaic" (``mosaic_gla``: a Pallas TPU kernel,
interpreted on CPU), "recurrent" (``recurrent_gla``, the token scan) or "auto" ("pallas" on GPU,
"chunk" elsewhere). ``gla_decode`` picks the one-token step the same way: "mosaic" takes the
Mosaic step kernel (``mosaic_step.py``) where the state's layout suits it, every other name the XLA
step (``gla_step``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.ops.gla.chunk import chunk_gla
from laplace_jax.ops.gla.inputs import check_inputs
from laplace_jax.ops.gla.limits import IMPLS
from laplace_jax.ops.gla.mosaic import mosaic_gla, mosaic_interpret
from laplace_jax.ops.gla.mosaic_step import mosaic_gla_step, takes
from laplace_jax.ops.gla.pallas import pallas_gla, pallas_interpret
from laplace_jax.ops.gla.recurrent import recurrent_gla
from laplace_jax.ops.gla.step import gla_step
from laplace_jax.platform import on_gpu

Array = jax.Array


def resolve(impl: str) -> str:
    """ "chunk", "pallas" or "recurrent" for a ``model.attn_impl`` on this backend."""
    if impl not in IMPLS:
        raise ValueError(f"the GLA kernel must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "auto":
        return "pallas" if on_gpu() else "chunk"
    return impl


def gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    *,
    impl: str = "chunk",
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 128,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """GLA over a sequence with kernel ``impl``: (o [B, T, H, V], final state [B, H, K, V] fp32).
    Every kernel has the same numerics contract and gradients. ``chunk_size``: the chunk and
    Pallas kernels' chunk (``limits.chunk_size_problem``); ``interpret`` runs a Pallas kernel
    in the Pallas interpreter (None: on CPU only)."""
    impl = resolve(impl)
    if impl == "recurrent":
        return recurrent_gla(q, k, v, g, scale=scale, initial_state=initial_state)
    if impl == "chunk":
        return chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    check_inputs(q, k, v, g, initial_state)
    B, _, H, K = q.shape
    s0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
    scale = K**-0.5 if scale is None else float(scale)
    if impl == "mosaic":
        interpret = mosaic_interpret() if interpret is None else interpret
        return mosaic_gla(q, k, v, g, s0, scale=scale, chunk_size=chunk_size, interpret=interpret)
    interpret = pallas_interpret() if interpret is None else interpret
    return pallas_gla(q, k, v, g, s0, scale=scale, chunk_size=chunk_size, interpret=interpret)


def gla_decode(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    state: Array,
    *,
    impl: str = "chunk",
    scale: float | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """One token with kernel ``impl``: q, k, g [B, H, K]; v [B, H, V]; state [B, H, K, V] fp32 ->
    (o [B, H, V], state'). "mosaic" runs the Mosaic step kernel where the TPU lays the state out
    batch-minor (``mosaic_step.takes``), the XLA step otherwise; every other kernel the XLA step."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if resolve(impl) == "mosaic" and takes(q.shape[0], v.shape[-1]):
        interpret = mosaic_interpret() if interpret is None else interpret
        return mosaic_gla_step(q, k, v, g, state, scale=scale, interpret=interpret)
    return gla_step(q, k, v, g, state, scale=scale)
