"""The TPU compiler's estimate of serving's speculative verify step against K + 1 plain decode
steps, for a model config (the 3B model by default), without a TPU.

    JAX_PLATFORMS=cpu python -m benchmarks.bench_speculative_tpu --out benchmarks/results/speculative_tpu.json

Per decode width W (the rows of one chip), compiled for ``--topology`` with bf16 weights:

- ``plain``: serving's decode program with K + 1 steps per call (K + 1 tokens per row);
- ``verify``: one speculative step (``slot_programs._verify_step``): K + 1 tokens through the model,
  acceptance, and the replay of a partial acceptance (a conditional; the estimate sums both of
  its branches, so this is a step whose draft was cut short);
- ``replay``: prefill of K + 1 tokens from the slots' states with per-row lengths (the replay
  branch alone), so ``verify - replay`` is a step whose every row accepted its whole draft.

Every time is the compiler's estimate (its cost model), never a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from benchmarks.common import write_result
from laplace_jax.config import load_run_config
from laplace_jax.models.gla_lm import abstract_params, prefill
from laplace_jax.serve import slot_programs
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.programs import serving_programs
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
    chip, devices = tpu_devices(a.topology)
    cfg = _serving_cfg(load_run_config(a.config))
    spec = ServeConfig(speculative_config=f'{{"method": "ngram", "num_speculative_tokens": {a.k}}}').speculation()
    mesh = Mesh(np.asarray(devices[:1]), ("data",))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), abstract_params(cfg))
    N = a.k + 1
    res = {"config": a.config, "topology": a.topology, "k": a.k, "label": "TPU compiler estimate", "widths": {}}
    res["verify_impl"] = a.verify_impl
    for W in a.widths:
        plain_lay = slot_programs.SlotLayout(cfg, mesh, "threefry2x32", N, 64)
        *_, plain_fn, plain_args, donate = serving_programs(plain_lay, params, W, 64, [W])[-1]
        plain_s = _seconds(compile_for_tpu(plain_fn, plain_args, donate=donate), chip)
        lay = slot_programs.SlotLayout(cfg, mesh, "threefry2x32", 1, 64, spec, cfg.max_seq_len)
        *_, args, _ = serving_programs(lay, params, W, 64, [W])[-1]
        p_args, slots, table = args
        draft = jax.ShapeDtypeStruct((W, a.k), jnp.int32, sharding=slots["rows"]["token"].sharding)

        def verify(p, sub, g, d, lay=lay):
            valid = jnp.ones(sub["rows"]["token"].shape, bool)
            return slot_programs._verify_step(lay, p, g, sub, valid=valid, draft=d)

        def replay(p, sub, lengths, lay=lay):
            vcfg = dataclasses.replace(lay.cfg, attn_impl=slot_programs.VERIFY_IMPL)
            fed = jnp.zeros((lengths.shape[0], N), jnp.int32)
            return prefill(vcfg, p, fed, sub["model"], lengths)[1]

        verify_s = _seconds(compile_for_tpu(verify, (p_args, slots, table, draft)), chip)
        lengths = jax.ShapeDtypeStruct((W,), jnp.int32, sharding=slots["rows"]["token"].sharding)
        replay_s = _seconds(compile_for_tpu(replay, (p_args, slots, lengths)), chip)
        full_s = verify_s - replay_s
        row = {
            "plain_k1_steps_s": plain_s,
            "verify_with_replay_s": verify_s,
            "replay_s": replay_s,
            "verify_full_acceptance_s": full_s,
            "speedup_full_acceptance": plain_s / full_s,
            "break_even_tokens_with_replay": verify_s / (plain_s / N),
        }
        res["widths"][str(W)] = row
        print(W, row, flush=True)
    write_result(res, "bench_speculative_tpu", argv, a.out)


if __name__ == "__main__":
    main()
