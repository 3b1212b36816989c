"""lm-evaluation-harness 0.4.13 against the server, as users run it: ``--model local-completions``
with ``tokenizer_backend=remote`` and ``--batch_size 4``, a multiple-choice task and a
generate_until task from local files. Its per-choice loglikelihoods must equal in-process scoring
(the model's full forward pass), and its generations the model's greedy text."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_helpers import CFG, PARAMS, TOK, reference_greedy

from laplace_jax.models.gla_lm import forward

MC = [
    {"question": "Colour of the sky:", "choices": [" blue", " green", " red"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "A cat says", "choices": [" meow", " woof", " moo", " quack"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
    {"question": "x", "choices": [" a", " bb", " ccc"], "answer": 2},
]
GEN = [{"question": q, "answer": "a"} for q in ("Hello", "Once upon a time", "1, 2, 3,", "The end")]


def task_files(tmp_path) -> str:
    for name, rows in (("mc", MC), ("gen", GEN)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "laplace_mc.yaml").write_text(
        f"""task: laplace_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    (tmp_path / "tasks" / "laplace_gen.yaml").write_text(
        f"""task: laplace_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
    )
    return str(tmp_path / "tasks")


def loglikelihood(context: str, continuation: str) -> float:
    ctx, cont = TOK.encode(context), TOK.encode(continuation)
    ids = ctx + cont
    lsm = jax.nn.log_softmax(forward(CFG, PARAMS, jnp.asarray([ids]))[0], axis=-1)
    return float(sum(lsm[i - 1, ids[i]] for i in range(len(ctx), len(ids))))


def samples(out_dir, task: str) -> list[dict]:
    (path,) = [os.path.join(r, f) for r, _, fs in os.walk(out_dir) for f in fs if f.startswith(f"samples_{task}")]
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_lm_eval_local_completions_runs_both_task_kinds_to_the_end(srv, tmp_path):
    args = (
        f"model=tiny,base_url={srv.url}/v1/completions,tokenizer_backend=remote,"
        "tokenized_requests=True,max_length=512,max_retries=1"
    )
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--tasks", "laplace_mc,laplace_gen", "--include_path", task_files(tmp_path), "--batch_size", "4",
           "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    mc = samples(tmp_path / "out", "laplace_mc")
    assert len(mc) == len(MC)
    for s in mc:
        args = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["doc"]["choices"]))]
        got = [float(r[0][0]) for r in s["resps"]]  # (loglikelihood, is_greedy) per choice
        want = [loglikelihood(a["arg_0"], a["arg_1"]) for a in args]  # context, delimiter + choice
        np.testing.assert_allclose(got, want, atol=1e-5 * 8)  # <= 8 tokens per choice, 1e-5 each
    gen = samples(tmp_path / "out", "laplace_gen")
    assert len(gen) == len(GEN)
    for s in gen:
        want = TOK.decode(reference_greedy(TOK.encode(s["doc"]["question"]), 8)).split("\n")[0]
        assert s["resps"][0][0] == want
