"""What each GLA kernel accepts, stated once: the kernels check their inputs with it and the
model config asks it; and the Mosaic kernels' names, which the TPU estimator looks for. It imports
nothing of the package, so the base layer (the config, ``tpu``) may."""

from __future__ import annotations

IMPLS = ("chunk", "pallas", "mosaic", "recurrent", "auto")  # model.attn_impl; "auto": dispatch.kernel_for
BLOCK_KERNELS = {"pallas": "the Pallas GPU kernel", "mosaic": "the Pallas TPU (Mosaic) kernel"}
MOSAIC_KERNELS = ("gla_mosaic_fwd", "gla_mosaic_bwd")  # the Mosaic kernels' names, as compiled HLO shows them
MOSAIC_STEP_KERNEL = "gla_mosaic_step"  # the Mosaic decode-step kernels' names
MOSAIC_CONV_KERNEL = "short_conv_mosaic_step"
MOSAIC_MATMUL_KERNEL = "matmul_mosaic_rows"  # ops/matmul/mosaic.py: few-row products (decode, short prefill)
MOSAIC_PROJECTIONS_KERNEL = "projections_mosaic_rows"  # ops/matmul/mosaic.py: several products of the same rows
MOSAIC_GATE_KERNEL = "log_decay_mosaic_rows"  # ops/matmul/log_decay.py: GLA's low-rank log-decay gate, few rows
PLAIN, RESIDUAL, GATED = 0, 1, 2  # its forms: x w; r + x w; silu(x w) (x u) (SwiGLU's hidden layer)


def matmul_form(operand_shapes: list[tuple[int, ...]]) -> int:
    """The form of a compiled matmul call from its operands' shapes: x [M, I], w [I, O] (, r [M, O] or u [I, O])."""
    if len(operand_shapes) == 2:
        return PLAIN
    return GATED if tuple(operand_shapes[2]) == tuple(operand_shapes[1]) else RESIDUAL


# ops/norm/mosaic.py: RMSNorm forward, backward, and the same after a residual add
MOSAIC_NORM_KERNELS = (
    "rms_norm_mosaic_fwd",
    "rms_norm_mosaic_bwd",
    "rms_norm_residual_mosaic_fwd",
    "rms_norm_residual_mosaic_bwd",
)
MOSAIC_SWIGLU_KERNELS = ("swiglu_mosaic_fwd", "swiglu_mosaic_bwd")  # ops/swiglu/mosaic.py: silu(gate) * up
# the kernels profiled whole, at each call's own sizes
MOSAIC_DECODE_KERNELS = (
    MOSAIC_STEP_KERNEL,
    MOSAIC_CONV_KERNEL,
    MOSAIC_MATMUL_KERNEL,
    MOSAIC_PROJECTIONS_KERNEL,
    MOSAIC_GATE_KERNEL,
    *MOSAIC_NORM_KERNELS,
    *MOSAIC_SWIGLU_KERNELS,
)
# the XLA kernels' named scopes, as compiled HLO's op names show them (hlo_stats.gla_kernels)
XLA_SCORES_SCOPE = "gla_scores_{layout}"  # the chunk kernel's intra-chunk scores ("full" or "blocks")
XLA_STEP_SCOPE = "gla_step_xla"
XLA_CONV_SCOPE = "short_conv_step_xla"
SUB_BLOCK = 16  # rows of the GLA kernels' exact-decay sub-blocks (the smallest side a Triton dot takes)


def pallas_chunk_ok(chunk_size: int) -> bool:
    """Whether the Pallas GLA kernels take this chunk size: a power of two >= 16 (Triton blocks
    must have power-of-two sizes, and a chunk is a whole number of 16-row sub-blocks; the Mosaic
    kernel's levels halve the chunk down to single rows, and bf16 rows tile by 16)."""
    return chunk_size >= SUB_BLOCK and chunk_size & (chunk_size - 1) == 0


def chunk_size_problem(impl: str, chunk_size: int) -> str | None:
    """Why kernel ``impl`` ("chunk", "pallas" or "mosaic") cannot run ``chunk_size``-token chunks, or None."""
    if impl in BLOCK_KERNELS and not pallas_chunk_ok(chunk_size):
        return f"{BLOCK_KERNELS[impl]} needs chunk_size a power of two, at least {SUB_BLOCK}; got {chunk_size}"
    if chunk_size <= 0 or (chunk_size % SUB_BLOCK and SUB_BLOCK % chunk_size):
        return (
            f"chunk_size must be a positive multiple of {SUB_BLOCK} (the chunk kernel also takes 1, 2, 4, 8); "
            f"got {chunk_size}"
        )
    return None
