"""What each GLA kernel accepts, stated once: the kernels check their inputs with it and the
model config asks it. It imports nothing of the package, so the config (the base layer) may."""

from __future__ import annotations

IMPLS = ("chunk", "pallas", "recurrent", "auto")  # model.attn_impl; "auto": pallas on GPU, chunk elsewhere
SUB_BLOCK = 16  # rows of the GLA kernels' exact-decay sub-blocks (the smallest side a Triton dot takes)


def pallas_chunk_ok(chunk_size: int) -> bool:
    """Whether the Pallas GLA kernel takes this chunk size: a power of two >= 16 (Triton blocks
    must have power-of-two sizes, and a chunk is a whole number of 16-row sub-blocks)."""
    return chunk_size >= SUB_BLOCK and chunk_size & (chunk_size - 1) == 0


def chunk_size_problem(impl: str, chunk_size: int) -> str | None:
    """Why kernel ``impl`` ("chunk" or "pallas") cannot run ``chunk_size``-token chunks, or None."""
    if impl == "pallas" and not pallas_chunk_ok(chunk_size):
        return f"the Pallas kernel needs chunk_size a power of two, at least {SUB_BLOCK}; got {chunk_size}"
    if chunk_size <= 0 or (chunk_size % SUB_BLOCK and SUB_BLOCK % chunk_size):
        return (
            f"chunk_size must be a positive multiple of {SUB_BLOCK} (the chunk kernel also takes 1, 2, 4, 8); "
            f"got {chunk_size}"
        )
    return None
