"""Suite-wide setup: eight fake CPU devices, and JAX's compiled programs released after each module."""

import gc
import os

import pytest

# Fake CPU devices for mesh tests; must be set before jax is imported anywhere. Added to any
# XLA_FLAGS already set (a user's, or the one laplace_jax sets when a harness imported it first)
# unless that already fixes the device count.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
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
