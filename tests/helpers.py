"""Small configs for training tests (seconds per run on CPU), and the sharded loss and gradients."""

import contextlib
import functools
import os

import flax.linen as nn
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import MeshConfig, ModelConfig, RunConfig
from laplace_jax.defaults import base_config
from laplace_jax.loss import loss_fn
from laplace_jax.platform import set_compile_cache
from laplace_jax.sharding import BATCH_AXES, make_mesh, param_shardings, param_specs
from laplace_jax.train.step import fsdp_value_and_grad

TESTS = os.path.dirname(os.path.abspath(__file__))  # the shared helpers and references live here
ROOT = os.path.dirname(TESTS)  # the repository
_CACHE_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def persistent_compile_cache(path):
    """JAX's persistent compilation cache under ``path`` while the block runs, as ``train.py
    --compile_cache_dir`` sets it: a run of a program this process compiled before (a resume after
    a stop, the same config in another test) loads it instead of compiling it again. The settings
    before it are restored after, and the cache is closed, so tests outside it compile as before."""
    from jax.experimental.compilation_cache import compilation_cache

    before = {k: getattr(jax.config, k) for k in _CACHE_SETTINGS}
    neuron = os.environ.get("NEURON_COMPILE_CACHE_URL")
    set_compile_cache(str(path))
    compilation_cache.reset_cache()  # the next compile opens the cache at path
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        if neuron is None:
            os.environ.pop("NEURON_COMPILE_CACHE_URL", None)
        compilation_cache.reset_cache()


def child_env(devices: int = 1) -> dict[str, str]:
    """The environment for a process a test starts: this one's, with the suite's XLA flags
    (``conftest``) except the fake device count, which becomes ``devices`` CPU devices (1: none
    faked, as a user's process has)."""
    device_flag = "--xla_force_host_platform_device_count"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(device_flag)]
    if devices > 1:
        flags.append(f"{device_flag}={devices}")
    return {**os.environ, "XLA_FLAGS": " ".join(flags)}


def micro_config(**sections):
    """The typed config of a 2-layer d=64 byte model on a slice of the embedded corpus; ``sections``
    update config blocks (dicts, as a config file would)."""
    c = base_config()
    c.model.update(
        vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, max_seq_len=64
    )
    c.data.update(seq_len=64, global_batch=8, eval_batches=2, embedded_max_chars=300_000)
    c.opt.update(lr=3e-3, warmup_steps=5)
    c.train.update(steps=20, log_every=1, eval_every=0, ckpt_every=5, peak_tflops=1.0)
    for name, values in sections.items():
        getattr(c, name).update(values)
    return RunConfig.from_mapping(c)


@functools.cache
def reference_value_and_grad(model: ModelConfig):
    """One device's jitted (loss, gradients) of ``loss_fn``: one compile per model config and
    module (the suite releases compiled programs after each module)."""
    return jax.jit(jax.value_and_grad(functools.partial(loss_fn, model)))


@functools.cache
def _sharded_fn(model: ModelConfig, mesh_cfg: MeshConfig, n_devices: int):
    mesh = make_mesh(mesh_cfg, jax.devices()[:n_devices])
    return mesh, jax.jit(fsdp_value_and_grad(model, mesh, param_specs(model, mesh_cfg.rules)))


def sharded_value_and_grad(cfg: RunConfig, n_devices: int, params, batch):
    """The train step's (loss, gradients, compiled HLO text) for ``batch`` on the first
    ``n_devices`` devices, meshed and sharded as ``cfg`` says (compiled once per model, mesh and
    device count)."""
    model, rules = cfg.model, cfg.mesh.rules
    mesh, fn = _sharded_fn(model, cfg.mesh, n_devices)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        sharded = jax.device_put(params, param_shardings(model, mesh, rules))
        placed = jax.device_put(batch, NamedSharding(mesh, P(BATCH_AXES)))
        loss, grads = fn(sharded, placed)
        return loss, grads, fn.lower(sharded, placed).compile().as_text()
