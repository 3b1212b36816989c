"""``ServeConfig``: the one home of every serving setting; serve.py's flags are generated from it."""

import dataclasses

import pytest

from laplace_jax.serve import cli
from laplace_jax.serve.config import GROUPS, ServeConfig, SettingError


def test_every_setting_is_a_flag_with_help_and_the_config_default(monkeypatch):
    monkeypatch.delenv("LAPLACE_API_KEY", raising=False)
    assert cli.parse([]) == ServeConfig()  # the flags' defaults are the fields' defaults
    for f in dataclasses.fields(ServeConfig):
        assert f.metadata["help"] and f.metadata["group"] in GROUPS, f.name
    flags = {a.dest for a in cli.parser()._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(ServeConfig)}


def test_flags_parse_into_typed_fields(monkeypatch):
    monkeypatch.setenv("LAPLACE_API_KEY", "from-env")
    cfg = cli.parse(["--max-num-seqs", "16", "--prefix-cache-bytes", "512M", "--exact", "--decode-buckets", "1,4"])
    assert cfg.max_num_seqs == 16 and cfg.prefix_cache_bytes == 512 << 20 and cfg.exact
    assert cfg.buckets() == [1, 4] and cfg.api_key == "from-env"
    assert cli.parse(["--api-key", "k"]).api_key == "k"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_num_seqs", 0, "max_num_seqs must be >= 1; got 0"),
        ("top_p", 0.0, "top_p must be positive"),
        ("drain_timeout", -1.0, "drain_timeout must be positive"),
        ("prng_impl", "philox", "prng_impl must be one of auto, threefry2x32"),
        ("decode_buckets", "1,99", "widths in 1..max_num_seqs (8)"),
        ("prefix_cache_bytes", -5, "prefix_cache_bytes must be >= 0"),
        ("attn_impl", "triton", "attn_impl must be one of chunk, pallas, mosaic"),
    ],
)
def test_out_of_range_settings_are_refused_with_their_name(field, value, message):
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        ServeConfig(**{field: value})
    assert e.value.name == field


def test_jump_forward_must_agree_with_the_speculative_verify():
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    with pytest.raises(SettingError, match="pass 0 or 3") as e:
        ServeConfig(speculative_config=spec, jump_forward=4)
    assert e.value.name == "jump_forward"
    assert ServeConfig(speculative_config=spec, jump_forward=3).jump_forward == 3
    with pytest.raises(SettingError, match="jump_forward must be >= 0"):
        ServeConfig(jump_forward=-1)


def test_the_cli_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(["--max-num-seqs", "0"])
    assert e.value.code == 2
    assert "--max-num-seqs: must be >= 1; got 0" in capsys.readouterr().err


def test_serve_py_is_a_thin_entry():
    with open("serve.py") as f:
        assert len(f.read().splitlines()) <= 40


def test_attn_impl_overrides_the_checkpoints_kernels(tmp_path):
    """--attn-impl replaces the loaded model's ``attn_impl`` (so a checkpoint trained with the XLA
    kernel can serve with the Pallas TPU decode steps); without it the checkpoint's stays."""
    import jax

    from laplace_jax import ModelConfig, init_params
    from laplace_jax.checkpoint import save_model

    model = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, use_short_conv=True)
    save_model(str(tmp_path / "m"), model, init_params(model, jax.random.key(0)))
    for flags, want in (([], "auto"), (["--attn-impl", "recurrent"], "recurrent")):
        cfg = cli.parse(["--checkpoint", str(tmp_path / "m"), "--tokenizer", "byte", *flags])
        assert cli._load(cfg)[1].attn_impl == want
