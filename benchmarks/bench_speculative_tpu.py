"""The TPU compiler's estimate of serving's speculative verify step against K + 1 plain decode
steps, for a model config (the 3B model by default), without a TPU.

    JAX_PLATFORMS=cpu python -m benchmarks.bench_speculative_tpu --out benchmarks/results/speculative_tpu.json

Per decode width W (the rows of one chip), compiled for ``--topology`` with bf16 weights placed as
serving places them there (``serve.programs.placed_weights``: per layer on a two-core TPU):

- ``plain``: serving's decode program with K + 1 steps per call (K + 1 tokens per row);
- ``verify``: one speculative step (``slot_programs._verify_step``: K + 1 tokens through the model,
  acceptance, the state committed over the emitted tokens), once per way to roll the state back
  (``models.gla_lm.verify``'s traces): each GLA layer's inputs replayed (``verify_inputs``) or
  its state after every position kept (``verify_states``); its time and its temporaries;
- ``model_replay``: the rollback the commit replaced, a second pass of the K + 1 tokens through
  the model (prefill with per-row lengths), for comparison.

Every time and size is the compiler's estimate (its cost model, its buffer assignment), never a
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from benchmarks.common import write_result
from laplace_jax.config import load_run_config
from laplace_jax.layers.common import TRACES
from laplace_jax.models.gla_lm import abstract_params, prefill
from laplace_jax.serve import slot_programs
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.programs import placed_weights, serving_programs
from laplace_jax.tools.tpu_check import _serving_cfg, compile_for_tpu
from laplace_jax.tpu import estimate, tpu_devices


def _seconds(compiled, chip) -> float:
    return estimate(compiled.as_text(), chip)["seconds"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/3b.py")
    ap.add_argument("--topology", default="v5p:1x1x1")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument(
        "--verify-impl", default=slot_programs.VERIFY_IMPL, help="the verify's GLA kernel (a model.attn_impl name)"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    slot_programs.VERIFY_IMPL = a.verify_impl  # read when the verify is traced
    keep_default = slot_programs.VERIFY_KEEP
    chip, devices = tpu_devices(a.topology)
    cfg = _serving_cfg(load_run_config(a.config))
    spec = ServeConfig(speculative_config=f'{{"method": "ngram", "num_speculative_tokens": {a.k}}}').speculation()
    mesh = Mesh(np.asarray(devices[:1]), ("data",))
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), abstract_params(cfg))
    params = jax.eval_shape(lambda p: placed_weights(cfg, p, devices[0]), bf16)  # as serving places them
    N = a.k + 1
    res = {"config": a.config, "topology": a.topology, "k": a.k, "label": "TPU compiler estimate", "widths": {}}
    res["verify_impl"] = a.verify_impl
    res["serving_keeps"] = keep_default
    for W in a.widths:
        plain_lay = slot_programs.SlotLayout(cfg, mesh, "threefry2x32", N, 64)
        *_, plain_fn, plain_args, donate = serving_programs(plain_lay, params, W, 64, [W])[-1]
        plain_s = _seconds(compile_for_tpu(plain_fn, plain_args, donate=donate), chip)
        lay = slot_programs.SlotLayout(cfg, mesh, "threefry2x32", 1, 64, spec, cfg.max_seq_len)
        *_, args, _ = serving_programs(lay, params, W, 64, [W])[-1]
        p_args, slots, table, _ = args  # the last: decode's steps per call, which the verify does not take
        draft = jax.ShapeDtypeStruct((W, a.k), jnp.int32, sharding=slots["rows"]["token"].sharding)

        def verify(p, sub, g, d, lay=lay):
            valid = jnp.ones(sub["rows"]["token"].shape, bool)
            return slot_programs._verify_step(lay, p, g, sub, valid=valid, draft=d, looked=valid)

        def model_replay(p, sub, lengths, lay=lay):
            vcfg = dataclasses.replace(lay.cfg, attn_impl=slot_programs.VERIFY_IMPL)
            fed = jnp.zeros((lengths.shape[0], N), jnp.int32)
            return prefill(vcfg, p, fed, sub["model"], lengths)[1]

        row = {"plain_k1_steps_s": plain_s}
        for keep in TRACES:
            slot_programs.VERIFY_KEEP = keep  # read when the verify is traced
            traced = functools.partial(verify)  # a function of its own: jit's cache would keep the first trace
            compiled = compile_for_tpu(traced, (p_args, slots, table, draft))
            verify_s = _seconds(compiled, chip)
            row[keep] = {
                "verify_s": verify_s,
                "temporaries_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                "speedup_all_accepted": plain_s / verify_s,
                "break_even_tokens": verify_s / (plain_s / N),
            }
        slot_programs.VERIFY_KEEP = keep_default
        lengths = jax.ShapeDtypeStruct((W,), jnp.int32, sharding=slots["rows"]["token"].sharding)
        row["model_replay_s"] = _seconds(compile_for_tpu(model_replay, (p_args, slots, lengths)), chip)
        res["widths"][str(W)] = row
        print(W, row, flush=True)
    write_result(res, "bench_speculative_tpu", argv, a.out)


if __name__ == "__main__":
    main()
