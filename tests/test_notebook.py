"""notebooks/quickstart.ipynb runs top to bottom on a real Jupyter kernel against a fresh train.py run."""

import os

import jax
import nbformat
import pytest
from helpers import child_env, micro_config
from nbclient import NotebookClient

from laplace_jax.train.loop import run


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    run(micro_config(train=dict(steps=6)), str(tmp_path / "run"), devices=jax.devices()[:1], log=lambda *_: None)
    nb = nbformat.read("notebooks/quickstart.ipynb", as_version=4)
    monkeypatch.setenv("LAPLACE_WORKDIR", str(tmp_path / "run"))
    monkeypatch.setenv("XLA_FLAGS", child_env()["XLA_FLAGS"])
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.getcwd()}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "parameters" in outputs and "nats/token" in outputs
    assert any(o.get("output_type") == "display_data" for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_the_notebook_finds_the_run_from_its_own_folder_and_reads_only(tmp_path, monkeypatch):
    """Jupyter started in notebooks/ of a checkout whose runs/tiny holds a run, no LAPLACE_WORKDIR:
    the notebook finds ../runs/tiny, and executing it changes nothing in the run's directory."""
    import shutil

    repo = tmp_path / "repo"
    run(micro_config(train=dict(steps=6)), str(repo / "runs" / "tiny"), devices=jax.devices()[:1], log=lambda *_: None)
    (repo / "notebooks").mkdir()
    shutil.copy("notebooks/quickstart.ipynb", repo / "notebooks")
    before = sorted((p.relative_to(repo), p.stat().st_size) for p in (repo / "runs").rglob("*") if p.is_file())
    nb = nbformat.read(str(repo / "notebooks" / "quickstart.ipynb"), as_version=4)
    monkeypatch.delenv("LAPLACE_WORKDIR", raising=False)
    monkeypatch.setenv("XLA_FLAGS", child_env()["XLA_FLAGS"])
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(repo / "notebooks")}}
    ).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{repo / 'runs' / 'tiny'}: " in outputs and "nats/token" in outputs
    after = sorted((p.relative_to(repo), p.stat().st_size) for p in (repo / "runs").rglob("*") if p.is_file())
    assert after == before
