"""The typed config: every block is checked at load, a typo names its field, overrides still work."""

import dataclasses
import json
import subprocess
import sys

import pytest

from laplace_jax.config import ModelConfig, RunConfig, load_run_config
from laplace_jax.defaults import base_config
from laplace_jax.errors import ConfigError

# (block, a misspelt key, the suggestion, a bad value for a real field, the message it gets)
TYPOS = [
    ("model", "d_modle", "d_model", ("attn_impl", "xla"), r"model\.attn_impl must be one of 'chunk', "),
    ("data", "seqlen", "seq_len", ("global_batch", 0), r"data\.global_batch must be >= 1; got 0"),
    ("data.mqar", "max_pair", "max_pairs", ("min_pairs", 30), r"data\.mqar needs 1 <= min_pairs <= max_pairs"),
    ("opt", "learning_rat", None, ("schedule", "linear"), r"opt\.schedule must be one of 'cosine', 'wsd'"),
    ("train", "stepz", "steps", ("prng_impl", "philox"), r"train\.prng_impl must be one of 'auto', "),
    ("mesh", "fdsp", "fsdp", ("fsdp", 0), r"mesh\.fsdp must be a positive size or -1"),
    ("plan", "peak_tflops", "peak_tflops_per_device", ("devices_per_instance", "64"), r"must be int; got '64'"),
]


def _block(cfg: dict, dotted: str) -> dict:
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.parametrize("block,typo,near,bad,message", TYPOS, ids=[t[0] for t in TYPOS])
def test_a_typo_or_a_bad_value_in_any_block_names_the_field(block, typo, near, bad, message):
    cfg = base_config().to_dict()
    _block(cfg, block)[typo] = 1  # what c.<block>.update(<typo>=1) does in a config file
    with pytest.raises(ConfigError, match=rf"unknown config key {block}\.{typo}\.") as e:
        RunConfig.from_mapping(cfg)
    assert (f"Did you mean {block}.{near}?" in str(e.value)) == (near is not None), str(e.value)
    cfg = base_config().to_dict()
    _block(cfg, block)[bad[0]] = bad[1]
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(cfg)


def test_types_are_checked_and_ints_read_as_floats():
    with pytest.raises(ConfigError, match=r"^model\.use_short_conv must be bool; got 1 \(int\)$"):
        ModelConfig(use_short_conv=1)
    with pytest.raises(ConfigError, match=r"^model\.n_kv_heads must be int or None; got 2\.0 \(float\)$"):
        ModelConfig(n_kv_heads=2.0)
    run = RunConfig.from_mapping({"model": {"hidden_ratio": 4}, "opt": {"lr": 1}})
    assert type(run.model.hidden_ratio) is float and type(run.opt.lr) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.opt.lr = 2.0  # frozen: dataclasses.replace makes a changed copy, checked again


def test_every_config_file_loads_typed_and_round_trips_through_json():
    """What a checkpoint records (the config as JSON) builds the same RunConfig again."""
    for name in ("tiny", "small_100m", "gla_340m", "gla_1b3", "3b", "recall_tiny"):
        run = load_run_config(f"configs/{name}.py")
        again = RunConfig.from_mapping(json.loads(json.dumps(run.to_dict())))
        assert again == run, name


def test_base_config_holds_the_typed_defaults():
    """One place per default: the ConfigDict a config file starts from is built from the dataclasses."""
    assert RunConfig.from_mapping(base_config()) == RunConfig()


@pytest.mark.parametrize(
    "override,message",
    [
        ("--config.train.stepz=5", "bad config override"),  # absl / ml_collections: unknown field
        ("--config.data.source=txt", "data.source must be one of 'text', 'mqar'; got 'txt'"),
        ("--config.opt.comm_dtype=fp8", "opt.comm_dtype must be one of 'float32', 'bfloat16'; got 'fp8'"),
    ],
)
def test_train_py_refuses_a_bad_override_in_one_line_before_compiling(override, message):
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.py", override, "--workdir", "/nonexistent/never"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "compiling" not in proc.stdout + proc.stderr


def test_a_config_file_with_a_typo_fails_at_load(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text(
        "from laplace_jax.defaults import base_config\n\n\ndef get_config():\n"
        "    c = base_config()\n    c.train.update(eval_evry=10)\n    return c\n"
    )
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", str(path), "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "unknown config key train.eval_evry. Did you mean train.eval_every?" in proc.stderr
    assert not (tmp_path / "w").exists()
