"""Suite-wide setup: eight fake CPU devices, XLA:CPU's quicker compiles, and JAX's compiled programs
released after each module."""

import gc
import os

import pytest

# Set before jax is imported anywhere, added to any XLA_FLAGS already set (a user's, or the one
# laplace_jax sets when a harness imported it first) unless that already sets them:
# - eight fake CPU devices for mesh tests;
# - LLVM at -O1 for XLA:CPU's kernels: compiling is most of this suite's time, and -O1 compiles
#   faster than XLA's default -O2 (three model tests: 52 s at -O2, 41 s at -O1). XLA's programs
#   (HLO, fusions, buffers) are the same, and so were the numbers where they were compared: the
#   micro model's logits in float32 and bf16 and three elementwise / reduction programs, bit for
#   bit against -O2. (-O0, 34 s, computed bf16 ops in excess precision: the exact mode's
#   jit-vs-eager test failed.) The processes tests start get these flags too
#   (``helpers.child_env``); benchmarks/ measures at XLA's defaults (its tests only run its code).
_SUITE_FLAGS = {"--xla_force_host_platform_device_count": "8", "--xla_backend_optimization_level": "1"}
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in _SUITE_FLAGS.items():
    if _name not in _flags:
        _flags = f"{_flags} {_name}={_value}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's caches of compiled programs. The whole suite runs in one
    process; without this every module's executables (and their memory mappings) stay alive, and
    two full runs crashed inside an XLA compile at 85%, most likely at the kernel's limit on
    memory mappings (vm.max_map_count, 65,530)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def every_platform(monkeypatch):
    """As on a host with every PJRT plugin installed (``platform.lowerable_platforms``): each
    ``per_platform`` branch is traced, so a program lowered from this CPU host for a TPU or a GPU
    (``lowering_platforms``) takes that platform's kernel, as a TPU or GPU host's AOT compile does."""
    from laplace_jax import platform
    from laplace_jax.ops.gla.dispatch import TARGETS

    monkeypatch.setattr(platform, "lowerable_platforms", lambda: frozenset(TARGETS))


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    """The suite's one persistent compilation cache folder, for the tests that opt in."""
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture
def compile_cache(compile_cache_dir):
    """JAX's persistent compilation cache on for this test (``helpers.persistent_compile_cache``):
    for tests that compile a program again (stop and resume), never for those that count compiles."""
    from helpers import persistent_compile_cache

    with persistent_compile_cache(compile_cache_dir):
        yield
