"""Backend facts: which platform JAX chose, per-device peak FLOP/s for MFU, device memory.

The platform is whatever JAX picks (``JAX_PLATFORMS`` overrides). Neuron appears as platform
"neuron" when the jax-neuronx PJRT plugin is installed; nothing here imports it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import statistics
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import psutil

from laplace_jax.errors import ConfigError

# Dense (no sparsity) bf16 peak per JAX device in TFLOP/s, matched by a substring of
# ``device_kind``, with where each figure comes from (docs/accelerators.md lists the same sources).
PEAK_BF16_TFLOPS: dict[str, tuple[float, str]] = {
    "H200": (989.0, "NVIDIA H200 product brief (SXM; 1,979 with sparsity)"),
    "H100": (989.0, "NVIDIA H100 datasheet (SXM; 1,979 with sparsity)"),
    "A100": (312.0, "NVIDIA A100 datasheet"),
    "L4": (121.0, "NVIDIA L4 datasheet (242 with sparsity)"),
    "TPU v4": (275.0, "Google Cloud TPU v4 documentation"),
    "TPU v5 lite": (197.0, "Google Cloud TPU v5e documentation"),
    "TPU v5p": (459.0, "Google Cloud TPU v5p documentation"),
    "TPU v6": (918.0, "Google Cloud TPU v6e (Trillium) documentation"),
    # 667 per chip over 4 logical NeuronCores (LNC=2, the trn2 default: 64 devices per trn2.48xlarge)
    "Trainium2": (667.0 / 4, "AWS Neuron docs, Trainium2 architecture (667 TFLOP/s bf16 per chip)"),
}


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def on_neuron() -> bool:
    """Whether JAX's default backend is AWS Neuron (the jax-neuronx PJRT plugin, platform "neuron")."""
    return jax.default_backend() == "neuron"


SYSTOLIC = ("tpu", "neuron")  # compilers for 128 x 128 matrix units: kernels keep 128-wide layouts there
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("compile_target", default=None)


def compile_target() -> str:
    """The platform programs traced now are built for: JAX's default backend, unless a deviceless
    compile for another one is under way (``compiling_for``, used by the TPU tools)."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform_name: str) -> Iterator[None]:
    """Trace programs for ``platform_name`` (e.g. "tpu" from a CPU machine) inside the block."""
    token = _TARGET.set(platform_name)
    try:
        yield
    finally:
        _TARGET.reset(token)


# Typed-key implementations a config or ``serve.py --prng-impl`` may name; "auto" picks per backend.
PRNG_IMPLS = ("auto", "threefry2x32", "rbg", "unsafe_rbg")


def prng_impl(name: str = "auto") -> str:
    """The PRNG implementation to use: ``name``, or for "auto" ``rbg`` on Neuron (its release notes
    call threefry "not completely supported" and advise rbg) and ``threefry2x32`` (JAX's default)
    elsewhere. Training and serving both take their keys from here."""
    if name not in PRNG_IMPLS:
        raise ConfigError(f"prng_impl must be one of {', '.join(PRNG_IMPLS)}; got {name!r}")
    if name == "auto":
        return "rbg" if on_neuron() else "threefry2x32"
    return name


def key_words(impl: str) -> int:
    """uint32 words of one key's data: 2 for threefry2x32, 4 for rbg and unsafe_rbg."""
    return 2 if impl == "threefry2x32" else 4


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` (outputs blocked on) over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(n: int = 2048, dtype=jnp.float32, repeats: int = 7) -> float:
    """Measured throughput of one n x n x n matmul on the default device (GFLOP/s)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    return 2 * n**3 / median_seconds(lambda: f(a, b), repeats) / 1e9


EXACT_XLA_FLAGS = (
    "--xla_allow_excess_precision=false",  # round every bf16/f16 op as written: compiled == op-by-op
    "--xla_cpu_enable_fast_math=false",
    "--xla_gpu_deterministic_ops=true",  # run-to-run identical reductions on GPU
)


def set_exact() -> None:
    """Reproducibility over speed for this process: the XLA flags above and 'highest' matmul
    precision (no TF32 / bf16 passes on GPU and TPU). Call before anything touches a device; the
    caller also computes in float32 (``dataclasses.replace(cfg, dtype="float32")``)."""
    from jax._src import xla_bridge  # private: imported only where the check needs it

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("set_exact() must run before JAX initializes its backends (XLA reads its flags once)")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *EXACT_XLA_FLAGS]).strip()
    jax.config.update("jax_default_matmul_precision", "highest")


def set_compile_cache(path: str) -> None:
    """JAX persistent compilation cache (and Neuron's, on Neuron) under ``path``; call before compiling."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    os.environ.setdefault("NEURON_COMPILE_CACHE_URL", os.path.join(path, "neuron"))


def peak_flops_per_device(override_tflops: float = 0.0) -> tuple[float, str]:
    """(FLOP/s, where the figure came from). CPU: an fp32 matmul measured now, split over devices."""
    if override_tflops > 0:
        return override_tflops * 1e12, "config train.peak_tflops"
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return matmul_gflops(1024) * 1e9 / len(jax.devices()), "measured fp32 matmul on this CPU"
    for key, (tflops, source) in PEAK_BF16_TFLOPS.items():
        if key.lower() in dev.device_kind.lower():
            return tflops * 1e12, f"dense bf16 peak of {key}: {source}"
    return 0.0, f"unknown device kind {dev.device_kind!r} (set train.peak_tflops)"


def device_memory_bytes(override_gib: float = 0.0) -> int:
    """Memory of one device: config override, the device's own limit, or host RAM / devices on CPU."""
    if override_gib > 0:
        return int(override_gib * 2**30)
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return int(psutil.virtual_memory().total // jax.local_device_count())
