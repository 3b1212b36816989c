"""Building blocks shared by the GLA layers: Linear (and Weight, a projection's weight alone),
RMSNorm, gated RMSNorm, short conv, SwiGLU MLP.

Parameters are float32 and carry logical axis names (no mesh names); compute happens in the
module's ``dtype`` and norms in float32, as in flash-linear-attention. How a parameter is
sharded and gathered for use is ``laplace_jax.parallel``'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from laplace_jax.ops import matmul as mosaic_matmul
from laplace_jax.ops import norm as ops_norm
from laplace_jax.ops import swiglu as ops_swiglu
from laplace_jax.ops.conv import short_conv_step
from laplace_jax.parallel import context_axis, from_previous_slice, gathered, local_shape
from laplace_jax.platform import compile_target, per_platform, two_core_tpu

Array = jax.Array


VERIFY_INPUTS = "verify_inputs"  # a speculative verify's trace: what each layer's state update took
VERIFY_STATES = "verify_states"  # the same, but a GLA layer keeps its state after every position
TRACES = (VERIFY_INPUTS, VERIFY_STATES)  # ``models.gla_lm.verify`` makes one mutable, ``commit`` reads it


def trace_of(module: nn.Module) -> str | None:
    """The trace collection a speculative verify asked of ``module`` (None: not a verify)."""
    return next((c for c in TRACES if module.is_mutable_collection(c)), None)


def sharded_param(module: nn.Module, name: str, init: Any, shape: tuple[int, ...], axes: tuple[str, ...]) -> Array:
    """``module.param`` (float32, logical ``axes``) with its shape per ``local_shape``."""
    return module.param(name, nn.with_logical_partitioning(init, axes), local_shape(shape, axes), jnp.float32)


class Embedding(nn.Module):
    """The token table [vocab, features] (fp32 parameter ``embedding``), returned in ``dtype``."""

    vocab: int
    features: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self) -> Array:
        init = nn.initializers.normal(self.init_std)
        table = sharded_param(self, "embedding", init, (self.vocab, self.features), ("vocab", "embed"))
        return gathered(table, ("vocab", "embed"), self.dtype)


def _kernel_param(module: nn.Module, shape: tuple[int, int], axes: tuple[str, str], init_std: float, dtype) -> Array:
    """A projection's weight [in, out] (fp32 parameter ``kernel``), gathered for use in ``dtype``."""
    kernel = sharded_param(module, "kernel", nn.initializers.normal(init_std), shape, axes)
    return gathered(kernel, axes, dtype)


class Linear(nn.Module):
    """y = x @ kernel (+ bias) (+ residual). kernel: [in, out] fp32; ``fp32_out`` keeps the product
    in float32. A residual like y is added last, inside the product's kernel where ``matmul``
    runs one (a pre-norm block's add after its last projection)."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype = jnp.float32
    use_bias: bool = False
    init_std: float = 0.02
    fp32_out: bool = False

    @nn.compact
    def __call__(self, x: Array, residual: Array | None = None) -> Array:
        shape = (x.shape[-1], self.features)  # activations keep their full width on every device
        out_dtype = jnp.float32 if self.fp32_out else self.dtype
        w = _kernel_param(self, shape, self.axes, self.init_std, self.dtype)
        if not self.use_bias:
            return matmul(x.astype(self.dtype), w, out_dtype, residual)
        bias = sharded_param(self, "bias", nn.initializers.zeros, (self.features,), self.axes[1:])
        y = matmul(x.astype(self.dtype), w, out_dtype) + gathered(bias, self.axes[1:], jnp.float32).astype(out_dtype)
        return y if residual is None else residual + y


class Weight(nn.Module):
    """A projection's weight alone (a ``Linear``'s parameter ``kernel`` [in, out], same name and
    init), gathered in ``dtype``: for a product whose kernel takes two weights (``gated_matmul``)."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, in_features: int) -> Array:
        return _kernel_param(self, (in_features, self.features), self.axes, self.init_std, self.dtype)


class WeightAndBias(nn.Module):
    """A biased projection's parameters alone (a ``Linear`` with ``use_bias``: ``kernel`` [in, out]
    gathered in ``dtype``, ``bias`` [out] as stored; same names and inits), for a product whose
    kernel takes them (``log_decay``)."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, in_features: int) -> tuple[Array, Array]:
        w = _kernel_param(self, (in_features, self.features), self.axes, self.init_std, self.dtype)
        bias = sharded_param(self, "bias", nn.initializers.zeros, (self.features,), self.axes[1:])
        return w, gathered(bias, self.axes[1:], bias.dtype)


_OWN_BUFFERS: contextvars.ContextVar[bool] = contextvars.ContextVar("weights_in_own_buffers", default=False)


@contextlib.contextmanager
def weights_in_own_buffers() -> Iterator[None]:
    """Trace layers whose weights are each their own buffer (``models.gla_lm.unstack_weights``), not
    slices of a layer stack: ``matmul`` may then hand them to a Mosaic kernel, which reads its
    operands in place (a slice of a stack would first be copied out: a 3B decode step's weights,
    4.6 ms on v5p by the compiler's estimate, where the XLA dot reads the slice in place)."""
    token = _OWN_BUFFERS.set(True)
    try:
        yield
    finally:
        _OWN_BUFFERS.reset(token)


def _few_row_target(w: Array) -> bool:
    """Whether the Mosaic few-row kernels may read weight ``w``: inside ``weights_in_own_buffers``,
    in a program compiled for a TPU with two TensorCores per chip (v4, v5p). Each caller checks
    its own kernel's sizes beside it."""
    return _OWN_BUFFERS.get() and two_core_tpu(compile_target(w))


def _rows_kernel(x: Array, w_IxO: Array) -> bool:
    """Whether x [.., I] @ w takes the Mosaic few-row kernels: ``_few_row_target``, rows and widths
    ``ops.matmul.takes``."""
    rows = math.prod(x.shape[:-1])
    return mosaic_matmul.takes(rows, *w_IxO.shape, x.dtype, w_IxO.dtype) and _few_row_target(w_IxO)


def _as_rows(kernel: Any, residual: bool = False) -> Any:
    """``kernel(x, w, *extra)`` on x [.., I] flattened to rows, and ``extra`` with it where it is a
    ``residual`` [.., O] (a second weight stays as it is); the result [.., O]."""

    def call(x, w, *extra):
        rows = [a.reshape(-1, a.shape[-1]) for a in extra] if residual else extra
        return kernel(x.reshape(-1, x.shape[-1]), w, *rows).reshape(*x.shape[:-1], -1)

    return call


def matmul(x: Array, w_IxO: Array, out_dtype: Any, residual: Array | None = None) -> Array:
    """x [.., I] @ w [I, O] with ``out_dtype`` accumulation (plus ``residual``, added last). Inside
    ``weights_in_own_buffers``, in a program compiled for a TPU with two TensorCores per chip (v4,
    v5p), a product of at most 512 rows (decode, short prefill) is the Mosaic kernel
    ``ops.matmul.rows_matmul``, which splits the weight's columns over the cores (the compiler's dot
    splits the rows: 3B MLP product at 256 rows on v5p, estimated 42.9 us against the kernel's
    31.6), with a residual of ``out_dtype`` added in its epilogue (``residual_rows_matmul``).
    Otherwise on a TPU one row (a one-sequence decode step) is padded to two, because the compiler
    lowers a one-row product as an elementwise multiply and reduce over the whole weight (3B decode
    step at W=1 on v5p, estimated: 7.90 ms, against 5.09 ms for two rows). Other backends take the
    product as it is."""
    dot = functools.partial(mosaic_matmul.reference, out_dtype=out_dtype)
    if _rows_kernel(x, w_IxO):
        if residual is not None and residual.dtype == jnp.dtype(out_dtype) and residual.shape[:-1] == x.shape[:-1]:
            fused = _as_rows(mosaic_matmul.residual_rows_matmul, residual=True)
            return per_platform(x, w_IxO, residual, default=mosaic_matmul.residual_reference, tpu=fused)
        kernel = _as_rows(lambda a, b: mosaic_matmul.rows_matmul(a, b, out_dtype))
        y = per_platform(x, w_IxO, default=dot, tpu=kernel)
    elif math.prod(x.shape[:-1]) != 1:
        y = dot(x, w_IxO)
    else:

        def two_rows(a, b):
            row = a.reshape(1, a.shape[-1])
            return dot(jnp.concatenate([row, jnp.zeros_like(row)]), b)[:1].reshape(*a.shape[:-1], b.shape[-1])

        y = per_platform(x, w_IxO, default=dot, tpu=two_rows)
    return y if residual is None else residual + y


def projections(x: Array, ws: tuple[Array, ...]) -> tuple[Array, ...]:
    """(x [.., I] @ w for w in ws), each in x's dtype: several projections of the same rows. Where
    ``matmul`` runs the Mosaic few-row kernel and the widths split evenly (``ops.matmul.
    projections_take``), one call takes a column block of every weight per grid step
    (``ops.matmul.rows_projections``: GLA's q, k, v and g in the 3B decode step at 256 rows on v5p,
    35.2 us against 40.7 as four calls); otherwise ``matmul`` each."""
    rows, I = math.prod(x.shape[:-1]), x.shape[-1]
    widths = tuple(w.shape[1] for w in ws)
    same = all(w.dtype == ws[0].dtype for w in ws)
    if same and mosaic_matmul.projections_take(rows, I, widths, x.dtype, ws[0].dtype) and _few_row_target(ws[0]):

        def kernel(x, *ws):
            ys = mosaic_matmul.rows_projections(x.reshape(rows, I), ws)
            return tuple(y.reshape(*x.shape[:-1], -1) for y in ys)

        def xla(x, *ws):
            return tuple(mosaic_matmul.reference(x, w, x.dtype) for w in ws)

        return per_platform(x, *ws, default=xla, tpu=kernel)
    return tuple(matmul(x, w, x.dtype) for w in ws)


def gated_matmul(x: Array, w_gate: Array, w_up: Array) -> Array:
    """SwiGLU's hidden layer, silu(x @ w_gate) (x @ w_up), in x's dtype: where ``matmul`` runs the
    Mosaic few-row kernel, both products and the gate as one (``ops.matmul.gated_rows_matmul``;
    the 3B decode step's SwiGLU gate kernel, 0.15 ms of 12.6 on v5p, is gone); otherwise the two
    products and ``swiglu``."""
    if _rows_kernel(x, w_gate):
        fused = _as_rows(mosaic_matmul.gated_rows_matmul)
        return per_platform(x, w_gate, w_up, default=mosaic_matmul.gated_reference, tpu=fused)
    return swiglu(matmul(x, w_gate, x.dtype), matmul(x, w_up, x.dtype))


def log_decay(
    x: Array, w0: Array, w1: Array, bias: Array, normalizer: float, clamp: float | None, valid: Array | None = None
) -> Array:
    """GLA's log-decay gate of x [.., D], fp32 [.., N]: max(log_sigmoid((x w0) w1 + bias) /
    normalizer, clamp), the first product in x's dtype and the second in fp32 (``matmul``'s), and 0
    where ``valid`` [..] is false (padding positions), as one Mosaic kernel where ``matmul`` runs
    the few-row product kernel and the widths fit (``ops.matmul.rows_log_decay``: the 3B decode
    step's two gate products and log-sigmoid, 0.21 ms of its estimate at 256 rows on v5p, in one
    call), the XLA ops otherwise."""

    def xla(x, w0, w1, bias, *valid):
        g = matmul(matmul(x, w0, x.dtype), w1, jnp.float32) + bias.astype(jnp.float32)
        d = mosaic_matmul.log_decay_gate(g, normalizer, clamp)
        return jnp.where(valid[0][..., None], d, 0.0) if valid else d

    masks = () if valid is None else (valid,)
    rows, (D, r), N = math.prod(x.shape[:-1]), w0.shape, w1.shape[1]
    same_dtype = x.dtype == w0.dtype == w1.dtype
    if same_dtype and mosaic_matmul.log_decay_takes(rows, D, r, N) and _few_row_target(w0):

        def kernel(x, w0, w1, bias, *valid):
            flat = valid[0].reshape(rows) if valid else None
            d = mosaic_matmul.rows_log_decay(x.reshape(rows, D), w0, w1, bias, flat, normalizer, clamp)
            return d.reshape(*x.shape[:-1], N)

        return per_platform(x, w0, w1, bias, *masks, default=xla, tpu=kernel)
    return xla(x, w0, w1, bias, *masks)


_TARGET: contextvars.ContextVar[Any] = contextvars.ContextVar("model_target", default=None)


@contextlib.contextmanager
def model_target(inputs: Array) -> Iterator[None]:
    """Trace a model whose ``inputs`` (its tokens: a program argument) name the compile target:
    ``row_kernels`` decides by it, since an activation that left a Mosaic call carries no device
    of its own (``platform.compile_target`` would fall back to this host's)."""
    token = _TARGET.set(compile_target(inputs))
    try:
        yield
    finally:
        _TARGET.reset(token)


def two_core_target(x: Array) -> bool:
    """Whether the program x is traced in is compiled for a TPU with two TensorCores per chip
    (``platform.two_core_tpu``; the target as ``model_target`` set it, else x's)."""
    return two_core_tpu(_TARGET.get() or compile_target(x))


def row_kernels(x: Array, takes: Any) -> bool:
    """Whether the Mosaic row kernels (``ops.norm``, ``ops.swiglu``) run on x [.., D]: in a program
    compiled for a TPU with two TensorCores per chip (v4, v5p: ``two_core_target``), rows they
    take. There the compiler's estimates favour them (the 3B train step on v5p:2x2x4 2.93 ->
    2.76 s, the 340M one on v5p:2x2x1 147.7 -> 140.3 ms); on v5e, a one-core chip, XLA's fused
    norms estimate faster (340M on v5e:2x2: 282.9 ms without them, 309.8 with)."""
    return takes(math.prod(x.shape[:-1]), x.shape[-1]) and two_core_target(x)


def rms_norm(x: Array, gain_D: Array, eps: float, out_dtype: Any, gate: Array | None = None) -> Array:
    """RMSNorm of x [.., D] with a float32 gain (times swish(gate) with a gate like x), returned
    in ``out_dtype``; a gain narrower than D normalises each run of its width on its own (heads).
    ``ops.norm.mosaic.rms_norm`` (the Mosaic kernels, forward and backward; the cost model puts
    XLA's norm far above its bytes) where ``row_kernels`` says, plain JAX otherwise."""
    if not row_kernels(x, ops_norm.takes):
        return ops_norm.rms_norm(x, gain_D, eps, out_dtype, gate)
    return ops_norm.mosaic_rms_norm(x, gain_D, eps, out_dtype, gate)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a float32 gain (init 1); output in ``dtype``. Called with
    a residual h, it returns (x + h, the norm of that), as one kernel where ``row_kernels`` says
    (``ops.norm.residual_rms_norm``): a pre-norm block's add and the next norm."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, h: Array | None = None) -> Array | tuple[Array, Array]:
        w = sharded_param(self, "weight", nn.initializers.ones, (x.shape[-1],), ("norm",))
        w = gathered(w, ("norm",), w.dtype)  # as stored: the norms compute in float32 from it
        if h is None:
            return rms_norm(x, w, self.eps, self.dtype)
        if not row_kernels(x, ops_norm.takes):
            return ops_norm.residual_rms_norm(x, h, w, self.eps, self.dtype)
        return ops_norm.mosaic_residual_rms_norm(x, h, w, self.eps, self.dtype)


class GatedRMSNorm(nn.Module):
    """fla's FusedRMSNormGated with swish: rmsnorm(o) * weight * g * sigmoid(g), all in float32.

    o, g: [..., n * width] (n heads side by side, or n = 1), each run of ``width`` features
    normalised on its own; one weight vector of size ``width`` shared by every head.
    """

    width: int
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, o: Array, g: Array) -> Array:
        w = sharded_param(self, "weight", nn.initializers.ones, (self.width,), ("norm",))
        return rms_norm(o, gathered(w, ("norm",), w.dtype), self.eps, self.dtype, gate=g)


class ShortConv(nn.Module):
    """Depthwise causal convolution of width W followed by SiLU (fla ``ShortConvolution``).

    kernel: [W, D]; kernel[W - 1] multiplies the current token. ``cache``: [B, W * D], the last W
    raw inputs, oldest first, flattened (zeros for a fresh sequence): flat, every tap is a slice
    of the minor axis at a multiple of D, which the one-token step (``ops.conv``) reads and shifts
    without the [.., W, D] tiles' relayouts (on the TPU compiler, 24 layers' v convolutions at the
    3B config, W=256: 1.29 ms -> 0.48 ms estimated). ``lengths_B``: only the first lengths[b] inputs of row b
    are real (the new cache ends at the last real one) and y is 0 at the others. Returns (y, new cache).
    """

    width: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02
    impl: str = "chunk"  # model.attn_impl: "mosaic" takes the Mosaic decode step where it runs

    @nn.compact
    def __call__(self, x_BxTxD: Array, cache_BxWD: Array | None, lengths_B: Array | None = None) -> tuple[Array, Array]:
        B, T, D = x_BxTxD.shape
        W = self.width
        kernel = sharded_param(self, "kernel", nn.initializers.normal(self.init_std), (W, D), ("conv", "heads"))
        k = gathered(kernel, ("conv", "heads"), self.dtype)
        if cache_BxWD is None and (axis := context_axis()) is not None:  # the slice before ours
            cache_BxWD = from_previous_slice(x_BxTxD[:, -W:].astype(self.dtype).reshape(B, W * D), axis)
        elif cache_BxWD is None:  # a fresh sequence
            cache_BxWD = jnp.zeros((B, W * D), self.dtype)
        cache_BxWD = cache_BxWD.astype(self.dtype)
        if T == 1:  # the decode step (ops.conv): a padding token leaves the cache as it was
            x_BxD = x_BxTxD[:, 0].astype(self.dtype)
            two_cores = two_core_target(x_BxTxD)  # the kernel's row blocks
            y, new = short_conv_step(x_BxD, cache_BxWD, k, lengths_B, impl=self.impl, two_cores=two_cores)
            return y[:, None], new
        if (trace := trace_of(self)) is not None:
            self.sow(trace, "inputs", x_BxTxD.astype(self.dtype))
        full = _inputs(cache_BxWD, x_BxTxD)  # [B, W+T, D]
        y = sum(full[:, 1 + w : 1 + w + T] * k[w] for w in range(W))
        if lengths_B is None:
            return jax.nn.silu(y), full[:, -W:].reshape(B, W * D)
        valid = jnp.arange(T)[None, :, None] < lengths_B[:, None, None]
        return jnp.where(valid, jax.nn.silu(y), 0), _window(full, lengths_B, W)


def _inputs(cache_BxWD: Array, x_BxTxD: Array) -> Array:
    """[B, W + T, D]: the cache's W inputs, then x's T, in the cache's dtype."""
    B, _, D = x_BxTxD.shape
    return jnp.concatenate([cache_BxWD.reshape(B, -1, D), x_BxTxD.astype(cache_BxWD.dtype)], axis=1)


def _window(full_BxLxD: Array, lengths_B: Array, W: int) -> Array:
    """The flat cache [B, W * D] of the W inputs ending at the lengths[b]-th new one."""
    B, _, D = full_BxLxD.shape
    return jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, W, axis=0))(full_BxLxD, lengths_B).reshape(B, W * D)


def conv_cache(cache_BxWD: Array, x_BxTxD: Array, lengths_B: Array) -> Array:
    """The cache after the first lengths[b] inputs of x (the W real inputs ending there)."""
    return _window(_inputs(cache_BxWD, x_BxTxD), lengths_B, cache_BxWD.shape[1] // x_BxTxD.shape[-1])


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (+ residual); fla ``GatedMLP`` with swish."""

    hidden: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: Array, residual: Array | None = None) -> Array:
        d = x.shape[-1]
        lin = dict(dtype=self.dtype, init_std=self.init_std)
        w_gate = Weight(self.hidden, ("embed", "mlp"), name="gate_proj", **lin)(d)
        w_up = Weight(self.hidden, ("embed", "mlp"), name="up_proj", **lin)(d)
        hidden = gated_matmul(x.astype(self.dtype), w_gate, w_up)
        return Linear(d, ("mlp", "embed"), name="down_proj", **lin)(hidden, residual)


def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up: ``ops.swiglu.mosaic.swiglu`` (the Mosaic kernels, forward and backward)
    where ``row_kernels`` says, plain JAX otherwise."""
    if gate.dtype != up.dtype or not row_kernels(gate, ops_swiglu.takes):
        return ops_swiglu.swiglu(gate, up)
    return ops_swiglu.mosaic_swiglu(gate, up)
