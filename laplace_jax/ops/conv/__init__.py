"""The short convolution's one-token step for decode (``layers.common.ShortConv``).

The cache is [B, W * D]: the last W raw inputs, oldest first, flattened. One token x [B, D]:

    y = silu(sum_{w < W - 1} cache_{w + 1} * kernel_w + x * kernel_{W - 1}),   cache' = [cache_1 .. cache_{W-1}, x]

``conv_step`` is the XLA form (every backend; the reference), ``mosaic_conv_step`` the same step as
a Pallas TPU (Mosaic) kernel that reads the cache once, writes it once in place, and writes y
batch-minor, as the Mosaic GLA step wants its q, k and v; ``short_conv_step`` picks one.
"""

from __future__ import annotations

from laplace_jax.ops.conv.mosaic_step import mosaic_conv_step, short_conv_step
from laplace_jax.ops.conv.step import conv_step

__all__ = ["conv_step", "mosaic_conv_step", "short_conv_step"]
