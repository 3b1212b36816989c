"""notebooks/quickstart.ipynb runs top to bottom on a real Jupyter kernel against a fresh train.py run."""

import os

import jax
import nbformat
import pytest
from nbclient import NotebookClient

from laplace_jax.train.loop import run
from tests.helpers import micro_config


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    run(micro_config(train=dict(steps=6)), str(tmp_path / "run"), devices=jax.devices()[:1], log=lambda *_: None)
    nb = nbformat.read("notebooks/quickstart.ipynb", as_version=4)
    monkeypatch.setenv("LAPLACE_WORKDIR", str(tmp_path / "run"))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.getcwd()}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "parameters" in outputs and "nats/token" in outputs
    assert any(o.get("output_type") == "display_data" for c in nb.cells for o in c.get("outputs", []))
