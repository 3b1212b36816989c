"""The one place a GLA kernel is chosen. The ops use the config's names: ``model.attn_impl`` is
"chunk" (``chunk_gla``, the XLA chunk kernel: every backend), "pallas" (``pallas_gla``: a
Triton-lowered GPU kernel, interpreted on CPU), "mosaic" (``mosaic_gla``: a Pallas TPU kernel,
interpreted on CPU), "recurrent" (``recurrent_gla``, the token scan) or "auto": the fastest kernel
that runs, chosen per compile target (``kernel_for``; ``platform.per_platform``): Mosaic in a
program compiled for TPU, Pallas for a GPU, the XLA kernel for CPU and Neuron. A program
AOT-compiled for TPU from a CPU host gets the TPU choice. ``gla_decode`` picks the one-token step
the same way: the Mosaic step kernel (``mosaic_step.py``) where "mosaic" or "auto" compiles for
TPU and the state's layout suits it, the XLA step (``gla_step``) otherwise."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from laplace_jax.ops.gla.chunk import chunk_gla
from laplace_jax.ops.gla.inputs import check_inputs
from laplace_jax.ops.gla.limits import IMPLS, chunk_size_problem
from laplace_jax.ops.gla.mosaic import chunk_refusal, compiled_on_tpu, mosaic_gla, mosaic_step_for
from laplace_jax.ops.gla.mosaic_step import mosaic_gla_step, takes
from laplace_jax.ops.gla.pallas import pallas_gla, pallas_interpret
from laplace_jax.ops.gla.recurrent import recurrent_gla
from laplace_jax.ops.gla.step import gla_step
from laplace_jax.platform import GPUS, per_platform

Array = jax.Array
log = logging.getLogger(__name__)
TARGETS = ("tpu", *GPUS, "neuron", "cpu")  # the compile targets "auto" chooses for
KERNEL_NAMES = {
    "chunk": "the XLA chunk kernel",
    "pallas": "the Pallas GPU (Triton) kernel",
    "mosaic": "the Pallas TPU (Mosaic) kernel",
    "recurrent": "the token scan",
}


def check_name(impl: str) -> None:
    """Raise unless ``impl`` is a ``model.attn_impl`` name."""
    if impl not in IMPLS:
        raise ValueError(f"the GLA kernel must be one of {', '.join(IMPLS)}; got {impl!r}")


def kernel_for(impl: str, platform_name: str, chunk_size: int) -> tuple[str, str]:
    """(kernel, why) for a sequence under ``model.attn_impl=impl`` in a program compiled for
    ``platform_name`` (a lowering platform, or ``jax.default_backend()``'s "gpu"): "auto" is
    "mosaic" on TPU, "pallas" on GPU, "chunk" elsewhere, or "chunk" where the faster kernel does not
    take ``chunk_size`` (``why`` says so)."""
    check_name(impl)
    if impl != "auto":
        return impl, f"model.attn_impl={impl!r}"
    fast = "mosaic" if platform_name == "tpu" else "pallas" if platform_name in (*GPUS, "gpu") else None
    if fast is None:
        return "chunk", f"auto: the XLA kernel on {platform_name}"
    problem = chunk_size_problem(fast, chunk_size)
    if fast == "mosaic" and problem is None and chunk_size % 128:
        problem = f"it compiles with chunk_size a multiple of 128; got {chunk_size}"
    if problem is not None:
        return "chunk", f"auto: the XLA kernel, not {KERNEL_NAMES[fast]} on {platform_name}: {problem}"
    return fast, f"auto: the fastest kernel on {platform_name}"


@functools.cache
def _say_once(reason: str) -> None:
    log.info("GLA kernel: %s", reason)


def _run(kernel: str, q, k, v, g, s0, *, scale: float, chunk_size: int, interpret: bool | None):
    """(o, final state) of one kernel; ``interpret`` None: as the compile target needs."""
    if kernel == "chunk":
        return chunk_gla(q, k, v, g, scale=scale, initial_state=s0, chunk_size=chunk_size)
    if kernel == "mosaic":
        mosaic = functools.partial(mosaic_gla, scale=scale, chunk_size=chunk_size)
        if interpret is None:  # chunks the TPU compiler rejects run interpreted only
            return compiled_on_tpu(mosaic, q, k, v, g, s0, refusal=chunk_refusal(chunk_size))
        return mosaic(q, k, v, g, s0, interpret=interpret)
    interpret = pallas_interpret() if interpret is None else interpret
    return pallas_gla(q, k, v, g, s0, scale=scale, chunk_size=chunk_size, interpret=interpret)


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
    in the Pallas interpreter (None: where the program is compiled for CPU)."""
    kernel, _ = kernel_for(impl, "cpu", chunk_size)
    if kernel == "recurrent":
        return recurrent_gla(q, k, v, g, scale=scale, initial_state=initial_state)
    check_inputs(q, k, v, g, initial_state)
    B, _, H, K = q.shape
    s0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
    scale = K**-0.5 if scale is None else float(scale)
    run = functools.partial(_run, scale=scale, chunk_size=chunk_size, interpret=interpret)
    if impl != "auto":
        return run(kernel, q, k, v, g, s0)
    branches = {}  # each is lowered only for its own platform, where its kernel compiles
    for target in TARGETS:
        chosen, why = kernel_for(impl, target, chunk_size)
        if chosen != "chunk":
            branches[target] = functools.partial(_run, chosen, scale=scale, chunk_size=chunk_size, interpret=False)
        elif target in ("tpu", *GPUS) and jax.default_backend() in ("tpu", "gpu"):
            _say_once(why)
    return per_platform(q, k, v, g, s0, default=functools.partial(run, "chunk"), **branches)


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
    (o [B, H, V], state'). The Mosaic step kernel runs where the TPU lays the state out
    batch-minor (``mosaic_step.takes``) under "mosaic" (interpreted on CPU) and, in a program
    compiled for TPU, under "auto"; the XLA step everywhere else."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    check_name(impl)
    xla = functools.partial(gla_step, scale=scale)
    if impl not in ("mosaic", "auto") or not takes(q.shape[0], v.shape[-1]):
        return xla(q, k, v, g, state)
    step = functools.partial(mosaic_gla_step, scale=scale)
    return mosaic_step_for(impl, step, xla, q, k, v, g, state, interpret=interpret)
