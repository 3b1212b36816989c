"""Backend facts: which platform JAX chose, per-device peak FLOP/s for MFU, device memory.

The platform is whatever JAX picks (``JAX_PLATFORMS`` overrides). Neuron appears as platform
"neuron" when the jax-neuronx PJRT plugin is installed; nothing here imports it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import pkgutil
import statistics
import time
from collections.abc import Callable, Iterator

import jax
import jax.extend
import jax.numpy as jnp
import psutil
from jax.interpreters import mlir

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
GPUS = ("cuda", "rocm")  # the platform names a program is lowered for on a GPU


_ONLY: contextvars.ContextVar[str | None] = contextvars.ContextVar("only_platform", default=None)


def per_platform(*args, default: Callable, **branches: Callable):
    """``branches[p](*args)`` in a program compiled for platform ``p`` ("tpu", "cuda", "rocm",
    "neuron", "cpu"), ``default(*args)`` for any other: the choice follows the compile target
    (``jax.lax.platform_dependent``: JAX lowers only the branch of the platform it compiles for), so a
    program AOT-compiled for a TPU from a CPU host (``jax.jit(f).lower`` on TPU devices, or
    ``.trace(...).lower(lowering_platforms=("tpu",))``) gets the TPU branch. Every branch this host
    can compile for (``lowerable_platforms``) is traced; all must return the same shapes. On a
    Neuron host, inside ``only_for``, or called eagerly (outside any trace: it runs now, where its
    arrays are), the one branch is called directly: no conditional reaches the program (Neuron's
    compiler takes no ``lax.cond``)."""
    only = _ONLY.get() or ("neuron" if jax.default_backend() == "neuron" else None) or _running_on(args)
    if only is not None:
        return branches.get(only, default)(*args)
    targets = lowerable_platforms()
    branches = {p: fn for p, fn in branches.items() if fn is not default and p in targets}
    if not branches:
        return default(*args)
    return jax.lax.platform_dependent(*args, default=default, **branches)


OPTIONAL_SCOPE = "skip_unless"  # the name scope of skip_unless's conditionals: optional work, as tpu.estimate reads it


def skip_unless(pred: jax.Array, fn: Callable, otherwise: Callable, *args):
    """``fn(*args)`` where the scalar ``pred`` holds, else ``otherwise(*args)`` (same shapes): a
    ``lax.cond`` that skips work no row of a batch needs, under the name scope ``OPTIONAL_SCOPE``
    (so a reader of the compiled program can tell optional work from other branches:
    ``tpu.estimate``). In a program for Neuron, whose compiler takes no ``lax.cond``, ``fn`` always
    runs, so ``fn`` must give what ``otherwise`` gives wherever ``pred`` is false (or what is
    returned there must go unread)."""

    def cond(*a):
        with jax.named_scope(OPTIONAL_SCOPE):
            return jax.lax.cond(pred, fn, otherwise, *a)

    return per_platform(*args, default=cond, neuron=fn)


# PJRT plugins by the module names their packages install (jax[tpu]'s libtpu, jax[cuda*]'s plugin
# and its jax_plugins.xla_cuda* module, ROCm's likewise, jax-neuronx's libneuronxla).
_PLUGIN_MODULES = {
    "tpu": ("libtpu",),
    "cuda": ("jax_cuda", "xla_cuda"),
    "rocm": ("jax_rocm", "xla_rocm"),
    "neuron": ("libneuronxla", "jax_neuronx"),
}


@functools.cache
def lowerable_platforms() -> frozenset[str]:
    """Platforms this process can compile for: CPU, the default backend's, and each whose PJRT
    plugin is installed. ``per_platform`` traces no branch for the others: nothing here could
    compile it (on a CPU-only host, ``auto`` traces a model as fast as the XLA kernel alone). To
    ``jax.export`` for a platform whose plugin this host lacks, trace inside ``only_for`` it."""
    names = {m.name for m in pkgutil.iter_modules()}
    with contextlib.suppress(ImportError):
        import jax_plugins  # the namespace package JAX discovers plugins in

        names |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    found = {"cpu", jax.default_backend()}
    found |= {p for p, prefixes in _PLUGIN_MODULES.items() if any(n.startswith(prefixes) for n in names)}
    return frozenset(found)


_refused_p = jax.extend.core.Primitive("refused_when_lowered")  # the identity; lowering it raises
_refused_p.def_abstract_eval(lambda x, *, message: x)


def _refuse(ctx, x, *, message):
    raise ValueError(message)


mlir.register_lowering(_refused_p, _refuse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _refused(message: str, x: jax.Array) -> jax.Array:
    return _refused_p.bind(x, message=message)


def _refused_fwd(message, x):
    return _refused(message, x), None


def _refused_bwd(message, _, ct):
    return (_refused_p.bind(ct, message=message),)  # a gradient program raises too


_refused.defvjp(_refused_fwd, _refused_bwd)


def refused_when_lowered(message: str, tree):
    """``tree`` (a pytree of arrays) in a program never lowered; lowering it, or its gradient,
    raises ``ValueError(message)``. The ``per_platform`` branch of a kernel that cannot compile for
    that branch's platform: every branch is traced, so the refusal waits until a program is lowered
    for that platform; programs for the others never see it."""
    return jax.tree.map(functools.partial(_refused, message), tree)


def _running_on(args) -> str | None:
    """Where a call outside any trace runs now: the platform of its arrays' device (as lowering
    names it), or None under a trace (the compile target is not known until lowering)."""
    leaves = jax.tree.leaves(args)
    if not leaves or any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves):
        return None
    device = next(iter(leaves[0].devices()))
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in getattr(device.client, "platform_version", "").lower() else "cuda"


def compile_target(x: jax.Array):
    """The device a traced array's program is compiled for, as far as tracing knows it: the
    (abstract) device its sharding names (a deviceless compile from a CPU host names its TPU
    devices there), else this host's first device."""
    device = getattr(getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None), "abstract_device", None)
    return device if device is not None else jax.devices()[0]


def two_core_tpu(device) -> bool:
    """Whether ``device`` (a device or an abstract one) is a TPU with two TensorCores per chip
    (v4, v5p: megacore), where few-row products take the Mosaic matmul (``layers.common.matmul``).
    JAX 0.10.0's abstract device (the Neuron floor) names no platform, only a kind ("cpu",
    "TPU v5p", ...), so the kind says whether it is a TPU there."""
    name = getattr(device, "platform", None) or device.device_kind
    return name.lower().startswith("tpu") and (getattr(device, "num_cores", None) or 1) >= 2


@contextlib.contextmanager
def only_for(platform_name: str) -> Iterator[None]:
    """Trace programs that will only ever compile for ``platform_name``: ``per_platform`` calls its
    branch directly (``tools/neuron_check`` traces what a Neuron host traces this way). JAX caches
    a function's trace without this context: use it on functions not traced before."""
    token = _ONLY.set(platform_name)
    try:
        yield
    finally:
        _ONLY.reset(token)


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
