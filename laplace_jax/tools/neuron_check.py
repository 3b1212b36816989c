"""Check the programs a Neuron user runs against JAX NeuronX's known issues (on any machine).

    python -m laplace_jax.tools.neuron_check --config configs/3b.py [--devices 64] [--json]

Traces, as a Neuron host does (``platform.only_for("neuron")``: ``model.attn_impl=auto`` is the XLA
kernel in the systolic layout, no per-platform branch), from abstract inputs (nothing
allocated, nothing compiled), the FSDP train step with
Muon on a fake CPU mesh of ``--devices`` devices, parameter init, forward, prefill, the decode
step (bf16 weights, as serving places them off CPU) and the serving sampler, all with the PRNG
implementation Neuron gets ("auto" -> rbg). Every equation of every (nested) jaxpr is checked
against the JAX NeuronX release notes' known issues:
- ``lax.cond`` is not supported; only static loops (``lax.scan``; any ``while`` is reported);
- no host callbacks (pure_callback, io_callback, debug.callback / debug.print);
- threefry PRNG "not completely supported" (any threefry key or ``threefry2x32``);
- no ``reduce_precision``; ``lax.sort`` only with plain comparators (JAX sorts floats with a
  total-order comparator, so every float sort is reported); no complex dtypes;
- Pallas kernels (Triton) do not run on Neuron.
Exit status 1 if anything is found, with each finding's program, primitive and source line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from laplace_jax.config import RunConfig

CALLBACKS = {"pure_callback", "io_callback", "debug_callback", "debug_print", "callback"}
RNG = {"random_bits", "random_split", "random_fold_in", "random_seed", "random_wrap", "random_unwrap"}


def _issue(eqn: Any) -> str | None:
    """What Neuron's known-issues list says about this equation, or None."""
    name = eqn.primitive.name
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")]
    if name == "cond":
        return "lax.cond is not supported (compute both branches and select)"
    if name == "while":
        return "while_loop: Neuron runs only static loops (use lax.scan with a static length)"
    if name in CALLBACKS:
        return "host callbacks are not supported"
    if name == "reduce_precision":
        return "reduce_precision is not supported"
    if name == "sort":
        return "lax.sort: only LE/GE/LT/GT comparators are supported (float sorts use a total order)"
    if name == "threefry2x32" or (name in RNG and any("fry" in str(getattr(a, "dtype", "")) for a in avals)):
        return "threefry PRNG is not completely supported (use rbg: config train.prng_impl / serve.py --prng-impl)"
    if any(str(getattr(a, "dtype", "")).startswith("complex") for a in avals):
        return "complex dtypes are not supported"
    if name == "pallas_call":
        return "Pallas kernels (Triton or Mosaic) do not run on Neuron (use model.attn_impl='chunk')"
    return None


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    from jax.extend import core

    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _sub_jaxprs(v)


def findings(jaxpr: Any, program: str) -> list[dict[str, str]]:
    """Every equation of ``jaxpr`` and its sub-jaxprs that hits a known issue."""
    from jax._src import source_info_util  # private: only for readable source lines

    out = []
    for eqn in jaxpr.eqns:
        issue = _issue(eqn)
        if issue:
            where = source_info_util.summarize(eqn.source_info).replace(os.getcwd() + os.sep, "") or "(inside jax)"
            out.append({"program": program, "primitive": eqn.primitive.name, "issue": issue, "where": where})
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                out += findings(sub, program)
    return out


def programs(config: RunConfig, prng: str) -> dict[str, Any]:
    """name -> jaxpr of each program a Neuron user runs (abstract inputs)."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.models.gla_lm import abstract_params, decode_step, forward, init_params, init_state
    from laplace_jax.models.gla_lm import prefill as prefill_fn
    from laplace_jax.platform import key_words
    from laplace_jax.sampling import sample_rows
    from laplace_jax.train.trainer import Trainer

    trainer = Trainer(dataclasses.replace(config, train=dataclasses.replace(config.train, prng_impl=prng)))
    with jax.set_mesh(trainer.mesh):
        train = trainer.step_fn.trace(trainer.abstract_state, trainer.abstract_batch).jaxpr.jaxpr
    cfg = config.model
    serving = dataclasses.replace(cfg, dtype="bfloat16")
    params = abstract_params(cfg)
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)  # as serving places them there
    W, P, V = 8, cfg.chunk_size, cfg.vocab_size
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    state = jax.eval_shape(lambda: init_state(serving, W))

    def sample(logits, temperature, top_k, top_p, key_data, count):
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data, impl=prng), count)
        return sample_rows(logits, temperature, top_k, top_p, keys)

    key = jax.eval_shape(lambda: jax.random.key(0, impl=prng))
    key_data = jax.ShapeDtypeStruct((W, key_words(prng)), jnp.uint32)
    jaxpr = lambda f, *a: jax.make_jaxpr(f)(*a).jaxpr  # noqa: E731
    return {
        "train_step": train,
        "init": jaxpr(lambda k: init_params(cfg, k), key),
        "forward": jaxpr(lambda p, t: forward(cfg, p, t), params, ints(1, P)),
        "prefill": jaxpr(lambda p, t, s, n: prefill_fn(serving, p, t, s, n), bf16, ints(W, P), state, ints(W)),
        "decode": jaxpr(lambda p, t, s: decode_step(serving, p, t, s), bf16, ints(W), state),
        "sampling": jaxpr(sample, f32(W, V), f32(W), ints(W), f32(W), key_data, ints(W)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.tools.neuron_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="an ml_collections config file, e.g. configs/3b.py")
    ap.add_argument("--devices", type=int, default=64, help="fake CPU devices for the train step's mesh")
    ap.add_argument("--prng-impl", default="rbg", help="the PRNG implementation to check (Neuron's default: rbg)")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    a = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    with contextlib.suppress(RuntimeError):  # backends already started (a test): the mesh takes what there is
        jax.config.update("jax_num_cpu_devices", a.devices)
    from laplace_jax.config import RunConfig, load_config_file
    from laplace_jax.errors import UserError
    from laplace_jax.platform import only_for

    try:
        config = load_config_file(a.config)
        config.mesh.data, config.mesh.fsdp = 1, -1  # the FSDP step over all --devices
        config = RunConfig.from_mapping(config)
        with only_for("neuron"):  # what a Neuron host traces: model.attn_impl=auto is the XLA kernel, no branch
            found = {name: findings(j, name) for name, j in programs(config, a.prng_impl).items()}
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(found, indent=2))
    else:
        for name, items in found.items():
            print(f"{name}: {len(items)} finding(s)")
            for f in items:
                print(f"  {f['primitive']}: {f['issue']}\n    at {f['where']}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
