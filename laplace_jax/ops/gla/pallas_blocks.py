"""In-kernel building blocks of the Pallas GLA kernels (``ops/gla/pallas.py``): loads of 16-row
sub-blocks, 2-D dots, and the exact decay algebra of one sub-block.

Every helper works on values already loaded from refs (or on refs, for loads) inside a Pallas
kernel and respects what Pallas' Triton lowering accepts: 2-D dots with every side >= 16 and one
operand dtype, power-of-two array sizes, forward-only cumulative sums, no value slicing (a row
or a column is a masked sum).

Shapes: a sub-block is ``SUB`` = 16 rows; ``BK`` key columns (a key tile), ``BV`` value columns.
Decays are fp32 log-decays (<= 0); every exponent is a direct sum of them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from laplace_jax.ops.gla.limits import SUB_BLOCK

Array = jax.Array

SUB = SUB_BLOCK  # sub-block rows: the smallest side a Triton dot accepts
f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
ROWS = 64  # rows per block where whole-chunk scores meet values (gla_out, gla_dv)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static sizes of one launch: chunk C rows (n sub-blocks), key tiles of BK (nk of them),
    value tiles of BV (nv), the score scale and the dot operand dtype (the input dtype: bf16
    operands run on tensor cores; fp32 ones at ``HIGHEST``, IEEE)."""

    C: int
    BK: int
    nk: int
    BV: int
    nv: int
    scale: float
    dtype: jnp.dtype

    @property
    def n(self) -> int:
        return self.C // SUB

    @property
    def NP(self) -> int:
        """Rows of the per-sub-block gate-gradient part: n padded to a power of two."""
        return 1 << (self.n - 1).bit_length()

    @property
    def R(self) -> int:
        """Rows per block of the output and value-gradient kernels (their dots' M and K)."""
        return min(self.C, ROWS)


def mm(a: Array, b: Array, contract: tuple[int, int] = (1, 0), dtype=f32) -> Array:
    """2-D dot with fp32 accumulation; operands cast to ``dtype`` (fp32 runs at HIGHEST: IEEE, no TF32)."""
    precision = HIGHEST if dtype == f32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=f32)


def load(ref, r0, col: int = 0, width: int | None = None, rows: int = SUB) -> Array:
    """Rows r0 .. r0 + rows of columns col .. col + width of a 2-D ref, as fp32."""
    width = ref.shape[1] if width is None else width
    return ref[pl.ds(r0, rows), pl.ds(col, width)].astype(f32)


def key_tiles(ref, r0, t: Tiling, rows: int = SUB) -> list[Array]:
    """The ``nk`` key tiles [rows, BK] of rows r0 .. of a [C, nk * BK] ref, fp32."""
    return [load(ref, r0, kt * t.BK, t.BK, rows) for kt in range(t.nk)]


def value_tiles(ref, r0, t: Tiling) -> list[Array]:
    """The ``nv`` value tiles [16, BV] of rows r0 .. of a [C, nv * BV] ref, in the ref's dtype."""
    return [ref[pl.ds(r0, SUB), pl.ds(vt * t.BV, t.BV)] for vt in range(t.nv)]


def last_row(ref, r0, t: Tiling) -> list[Array]:
    """Row r0 + 15 (a sub-block's last) of a [C, nk * BK] ref as ``nk`` tiles [1, BK]: of the
    in-sub-block prefix sums, the sub-block's total log-decay."""
    return key_tiles(ref, r0 + SUB - 1, t, rows=1)


def iota(axis: int) -> Array:
    return jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), axis)


def ones(mask: Array) -> Array:
    return jnp.where(mask, 1.0, 0.0)


def rev_sum(x: Array) -> Array:
    """sum_{r >= t} x[r] for each row t of a [16, D] block (a 0/1 fp32 dot: a direct sum)."""
    return mm(ones(iota(1) >= iota(0)), x)


def excl_sum(x: Array) -> Array:
    """sum_{s < t} x[s] for each row t of a [16, D] block."""
    return mm(ones(iota(1) < iota(0)), x)


def pair_decay(g: Array, s) -> Array:
    """e^{sum_{s < t <= r} g_t} for key row s and every query row r of one sub-block g [16, BK]."""
    return jnp.exp(mm(ones((iota(1) > s) & (iota(1) <= iota(0))), g))


def row(x: Array, s) -> Array:
    """Row s of a [16, D] block as [1, D] (a masked sum: no dynamic register indexing)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == s, x, 0.0), axis=0, keepdims=True)


def col(x: Array, s) -> Array:
    """Column s of a [16, 16] block as [16, 1]."""
    return jnp.sum(jnp.where(iota(1) == s, x, 0.0), axis=1, keepdims=True)


def off_scores(qh: list[Array], kd: list[Array], t: Tiling) -> Array:
    """scale * sum over key tiles of qh kd^T: scores [16, 16] of a query sub-block (q scaled from
    its sub-block start) against an earlier key sub-block (k scaled to that start)."""
    return t.scale * sum(mm(a, b, (1, 1), t.dtype) for a, b in zip(qh, kd, strict=True))


def diag_scores(q: list[Array], k: list[Array], g: list[Array], t: Tiling) -> Array:
    """Causal scores of one sub-block against itself [16, 16] fp32 (zero above the diagonal), the
    decay of each pair an exact pairwise sum."""

    def column(s, A):
        terms = (a * row(b, s) * pair_decay(d, s) for a, b, d in zip(q, k, g, strict=True))
        c = sum(jnp.sum(x, axis=1, keepdims=True) for x in terms)
        return jnp.where((iota(1) == s) & (iota(0) >= s), c, A)

    return t.scale * jax.lax.fori_loop(0, SUB, column, jnp.zeros((SUB, SUB), f32))


def diag_dq_dg(dA: Array, q: Array, k: Array, g: Array) -> tuple[Array, Array]:
    """A diagonal sub-block's share of dq and dg for one key tile (before ``scale``). dq row t sums
    dA[t, s] k[s] e^{b_t - b_s} over s <= t; dg row t sums the pair terms q[r] dA[r, s] k[s]
    e^{b_r - b_s} over s < t <= r. dA: [16, 16] lower-triangular; q, k, g: [16, BK]."""
    rows = jax.lax.broadcasted_iota(jnp.int32, q.shape, 0)

    def add(s, carry):
        dq, dg = carry
        part = col(dA, s) * row(k, s) * pair_decay(g, s)
        return dq + part, dg + jnp.where(rows > s, rev_sum(q * part), 0.0)

    zero = jnp.zeros(q.shape, f32)
    return jax.lax.fori_loop(0, SUB, add, (zero, zero))


def diag_dk(dA: Array, q: Array, g: Array) -> Array:
    """A diagonal sub-block's share of dk for one key tile (before ``scale``): row s sums
    dA[t, s] q[t] e^{b_t - b_s} over t >= s."""

    def add(s, dk):
        r = jnp.sum(col(dA, s) * q * pair_decay(g, s), axis=0, keepdims=True)
        return dk + jnp.where(jax.lax.broadcasted_iota(jnp.int32, dk.shape, 0) == s, r, 0.0)

    return jax.lax.fori_loop(0, SUB, add, jnp.zeros(q.shape, f32))
