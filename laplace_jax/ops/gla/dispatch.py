"""Which GLA kernel a model's ``attn_impl`` runs on this backend: the one place that maps the
config's names ("chunk", "pallas", "recurrent", "auto") to the ops' (``chunk_gla``'s "xla" and
"pallas" kernels, or ``recurrent_gla``)."""

from __future__ import annotations

from laplace_jax.platform import on_gpu


def kernel_for(attn_impl: str) -> str:
    """ "recurrent", "xla" or "pallas" for a ``model.attn_impl``; "auto" is "pallas" on GPU and
    "xla" elsewhere."""
    if attn_impl == "auto":
        attn_impl = "pallas" if on_gpu() else "chunk"
    return {"chunk": "xla", "pallas": "pallas", "recurrent": "recurrent"}[attn_impl]
