"""A trained run goes to Hugging Face in one command: `convert to-fla RUN OUT` writes a directory
that transformers' AutoTokenizer and AutoModelForCausalLM (trust_remote_code, fla's own classes,
whose Triton kernels run here as PyTorch through fla_on_cpu) load, with the JAX model's logits
and greedy text, and a tokenizer that round-trips every byte.

transformers, fla and triton run in a child process: triton's LLVM must not share a process with
XLA's (the rest of the suite compiles with XLA in this one)."""

import json
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, TESTS, micro_config

from laplace_jax.convert import load_fla, main
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.generate import sample
from laplace_jax.loading import load_for_inference
from laplace_jax.models.gla_lm import forward
from laplace_jax.train.loop import run

CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from fla_on_cpu import fla_on_cpu
hf, job = sys.argv[1], json.loads(sys.argv[2])
t = transformers.AutoTokenizer.from_pretrained(hf)
out = {
    "ids": [t.eos_token_id, t.pad_token_id],
    "encoded": [t.encode(s, add_special_tokens=False) for s in job["texts"]],
    "decoded": [t.decode(ids) for ids in job["byte_ids"]],
    "decoded_eos": t.decode([104, 105, 0], skip_special_tokens=True),
}
m = transformers.AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
with fla_on_cpu(), torch.no_grad():
    x = torch.tensor([job["prompt"]])
    out["logits"] = m(x).logits[0].tolist()
    out["greedy"] = m.generate(x, max_new_tokens=12, do_sample=False, use_cache=False)[0, x.shape[1]:].tolist()
print("RESULT " + json.dumps(out))
"""


def random_job(seed: int = 0) -> dict:
    rng = random.Random(seed)

    def char():
        return chr(rng.choice([rng.randint(1, 0x7F), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))

    texts = ["".join(char() for _ in range(rng.randint(0, 12))) for _ in range(300)]
    byte_ids = [[rng.randint(1, 255) for _ in range(rng.randint(1, 12))] for _ in range(300)]  # invalid UTF-8 too
    return {"texts": texts, "byte_ids": byte_ids, "prompt": ByteTokenizer().encode("the quick brown fox")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    run(
        micro_config(train=dict(steps=6, ckpt_every=3)),
        str(base / "run"),
        devices=jax.devices()[:1],
        log=lambda *_: None,
    )
    assert main(["to-fla", str(base / "run"), str(base / "hf"), "--step", "6"]) == 0
    job = random_job()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(base / "hf"), json.dumps(job)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = child.stdout.split("RESULT ")[-1]  # libraries may print before it, without a newline
    return base / "run", base / "hf", job, json.loads(result)


def test_export_has_the_files_and_ids_transformers_needs(exported):
    _, hf, _, _ = exported
    config = json.loads((hf / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (0, 0, 0)
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_laplace_gla.GLAForCausalLM"
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "modeling_laplace_gla.py", "model.safetensors"):
        assert (hf / name).is_file(), name


def test_export_round_trip_is_value_exact(exported):
    run_dir, hf, _, _ = exported
    cfg, params, _, _ = load_for_inference(str(run_dir))
    cfg2, params2 = load_fla(str(hf))
    assert cfg2.n_layers == cfg.n_layers and cfg2.vocab_size == cfg.vocab_size
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), b)


def test_tokenizer_round_trips_every_byte_and_invalid_utf8(exported):
    _, _, job, got = exported
    ours = ByteTokenizer()
    assert got["ids"] == [ours.eos_id, ours.eos_id]
    assert got["encoded"] == [ours.encode(s) for s in job["texts"]]
    assert got["decoded"] == [ours.decode(ids) for ids in job["byte_ids"]]
    assert got["decoded_eos"] == ours.decode([104, 105, 0]) == "hi"


def test_transformers_loads_the_export_with_the_jax_models_logits_and_greedy_text(exported):
    run_dir, _, job, got = exported
    cfg, params, _, _ = load_for_inference(str(run_dir))
    want = np.asarray(forward(cfg, params, jnp.asarray([job["prompt"]]))[0])
    np.testing.assert_allclose(np.asarray(got["logits"]), want, atol=1e-5, rtol=0)
    assert got["greedy"] == sample(cfg, params, job["prompt"], 12, temperature=0.0)
