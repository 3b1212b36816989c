"""The structured-output mask on the TPU compiler: serving's sampler for W sequences of the 3B
vocabulary, plain and with the grammar table's mask, for three layouts of the table.

    python -m benchmarks.bench_structured_tpu --out benchmarks/results/structured_tpu_layouts.json

Layouts: ``rows`` [R, V] (a sequence's row gathered as V entries), ``lanes`` [R, ceil(V / 128),
128], and ``tiles`` (``sampling.grammar_tiles_shape``: lanes with the middle dimension padded to
a multiple of 16, int16's packed tile), which serving uses. Each masked sampler is compiled with
every row's mask branch counted (the compiler's estimate sums both branches of a ``cond``; a batch
with no constrained row skips the mask when it runs). Times are the TPU compiler's estimate for
the named chip, not measurements; ``table_copies`` counts whole-table copies in the compiled
program (a layout the gather does not take).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import write_result
from laplace_jax.sampling import LANES, grammar_limit, grammar_next, grammar_tiles_shape, penalize, sample_rows
from laplace_jax.serve.slot_programs import GRAMMAR_DTYPE, row_template

VOCAB_3B = 50_304


def _rows_limit(pen, logits, table, g):
    """``grammar_limit`` for a [R, V] table (the layout before ``grammar_tiles``)."""

    def masked(pen):
        nxt = table[jnp.maximum(g, 0)]
        allowed = (g < 0)[:, None] | (nxt >= 0)
        out = jnp.where(allowed, pen, -jnp.inf)
        stuck = ~jnp.any(out > -jnp.inf, axis=-1, keepdims=True)
        return jnp.where(stuck, jnp.where(allowed, logits, -jnp.inf), out)

    return jax.lax.cond(jnp.any(g >= 0), masked, lambda p: p, pen)


def _rows_next(table, g, tok, valid):
    return jnp.where((g >= 0) & valid, table[jnp.maximum(g, 0), tok].astype(g.dtype), g)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5p:1x1x1")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--states", type=int, default=4096, help="grammar-table rows (--structured-states)")
    ap.add_argument("--vocab", type=int, default=VOCAB_3B)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from laplace_jax.tools.tpu_check import compile_for_tpu
    from laplace_jax.tpu import estimate, tpu_devices

    chip, devices = tpu_devices(a.topology)
    W, V, R = a.width, a.vocab, a.states
    rows = {k: jax.ShapeDtypeStruct((W, *s), d) for k, (s, d, _) in row_template("threefry2x32", V).items()}
    layouts = {
        "rows": ((R, V), _rows_limit, _rows_next),
        "lanes": ((R, -(-V // LANES), LANES), grammar_limit, grammar_next),
        "tiles": (grammar_tiles_shape(R, V), grammar_limit, grammar_next),
    }

    def seconds(limit, nxt, shape) -> tuple[float, int]:
        def sampler(logits, r, table):
            keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(r["key"], impl="threefry2x32"), r["count"])
            pen = penalize(logits, r) if limit is None else limit(penalize(logits, r), logits, table, r["gstate"])
            tok = sample_rows(pen, r["temperature"], r["top_k"], r["top_p"], keys, r["min_p"])
            return tok if limit is None else (tok, nxt(table, r["gstate"], tok, ~r["done"]))

        table = jax.ShapeDtypeStruct(shape, GRAMMAR_DTYPE)
        hlo = compile_for_tpu(sampler, (jax.ShapeDtypeStruct((W, V), jnp.float32), rows, table), devices).as_text()
        whole = ",".join(map(str, shape))
        copies = sum(1 for line in hlo.splitlines() if " copy(" in line and f"[{whole}]" in line.split("=", 1)[-1])
        return estimate(hlo, chip)["seconds"], copies

    plain, _ = seconds(None, None, layouts["tiles"][0])
    res = {"chip": chip.name, "width": W, "states": R, "vocab": V, "plain_sampler_s": plain, "layouts": {}}
    for name, (shape, limit, nxt) in layouts.items():
        s, copies = seconds(limit, nxt, shape)
        res["layouts"][name] = {"shape": list(shape), "masked_sampler_s": s, "over_plain_s": s - plain,
                                "table_copies": copies}  # fmt: skip
        print(name, shape, f"{s * 1e3:.3f} ms (+{(s - plain) * 1e3:.3f} ms), whole-table copies {copies}")
    write_result(res, "bench_structured_tpu", argv, a.out)


if __name__ == "__main__":
    main()
