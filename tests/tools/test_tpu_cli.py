"""The TPU tools where libtpu is absent (the main test environment): clear errors. The compiles
themselves are in tests/test_tpu.py; the docs' generated tables in tests/benchmarks/test_tables.py."""

import importlib.util
import subprocess
import sys

import pytest

from laplace_jax.errors import UserError
from laplace_jax.tpu import parse_topology


def test_topology_names_are_checked_before_libtpu_is_needed():
    chip, dims = parse_topology("v5p:2x2x4")
    assert chip.name == "v5p" and dims == (2, 2, 4)
    with pytest.raises(UserError, match=r"unknown TPU 'tpu7'.*known: v5e, v5p, v6e"):
        parse_topology("tpu7:2x2")
    with pytest.raises(UserError, match=r"e\.g\. v5e:2x2"):
        parse_topology("v5e:two")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_without_libtpu_the_tool_says_how_to_install_it():
    out = subprocess.run(
        [sys.executable, "-m", "laplace_jax.tools.tpu_check", "--kernel", "--shape", "small"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "needs libtpu" in out.stderr and 'pip install -e ".[tpu]"' in out.stderr


def test_topology_without_plan_is_refused_in_one_line():
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--topology", "v5e:2x2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "error: --topology goes with --plan" in out.stderr


@pytest.mark.parametrize(
    ("data", "fsdp", "want"),
    [(-1, 1, (-1, 1)), (1, -1, (1, -1)), (2, 8, (2, 2)), (3, -1, (1, 4)), (-1, 3, (1, 4)), (4, 1, (4, 1))],
)
def test_the_plans_mesh_is_sized_to_the_chips(data, fsdp, want):
    """-1 takes the chips the other axis leaves (data=-1, fsdp=1 on 4 chips is pure data
    parallelism, not fsdp over 4); sizes that do not multiply to the chips are resized."""
    import dataclasses

    from laplace_jax.config import load_run_config
    from laplace_jax.train.tpu_plan import sized_mesh

    config = load_run_config("configs/tiny.py")
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, data=data, fsdp=fsdp))
    sized, note = sized_mesh(config, 4)
    assert (sized.mesh.data, sized.mesh.fsdp) == want
    assert bool(note) == (want != (data, fsdp))


@pytest.mark.parametrize(("fsdp", "context", "want"), [(-1, 2, (1, -1, 2)), (4, 2, (1, 2, 2)), (2, 4, (1, 1, 4))])
def test_the_plans_mesh_keeps_the_context_split_where_it_divides(fsdp, context, want):
    """On 4 chips: the context size is kept and data x fsdp share the chips it leaves (the note
    says when a size changed)."""
    import dataclasses

    from laplace_jax.config import load_run_config
    from laplace_jax.train.tpu_plan import sized_mesh

    config = load_run_config("configs/tiny.py")
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, data=1, fsdp=fsdp, context=context))
    sized, note = sized_mesh(config, 4)
    assert (sized.mesh.data, sized.mesh.fsdp, sized.mesh.context) == want
    assert bool(note) == (want != (1, fsdp, context))
