"""fla checkpoint import/export: bit-exact round trips and clear errors for bad directories."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from laplace_jax import ModelConfig, init_params
from laplace_jax.checkpoint import load_model
from laplace_jax.convert import CheckpointFormatError, load_fla, main, save_fla
from tests.test_model import fla_config, write_fla_checkpoint


def test_export_import_round_trip_is_bit_exact(tmp_path):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, use_short_conv=True, n_kv_heads=1)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    save_fla(str(tmp_path), cfg, params)
    cfg2, params2 = load_fla(str(tmp_path))
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, params2)


def test_torch_state_dict_survives_import_export(tmp_path):
    write_fla_checkpoint(tmp_path / "fla", fla_config(use_short_conv=True))
    assert main(["from-fla", str(tmp_path / "fla"), str(tmp_path / "lap")]) == 0
    cfg, _params = load_model(str(tmp_path / "lap"))
    assert cfg.d_model == 64 and cfg.use_short_conv
    assert main(["to-fla", str(tmp_path / "lap"), str(tmp_path / "back")]) == 0
    a = load_file(str(tmp_path / "fla" / "model.safetensors"))  # independent reader
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_bf16_checkpoint_loads(tmp_path):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    import ml_dtypes

    save_fla(str(tmp_path), cfg, params, dtype=ml_dtypes.bfloat16)
    _, params2 = load_fla(str(tmp_path))
    np.testing.assert_allclose(params2["lm_head"]["kernel"], params["lm_head"]["kernel"], rtol=1e-2)


def test_bad_directories(tmp_path):
    with pytest.raises(CheckpointFormatError, match=r"no config\.json"):
        load_fla(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointFormatError, match="only 'gla'"):
        load_fla(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(fla_config(use_gv=True)))
    with pytest.raises(CheckpointFormatError, match="use_gv"):
        load_fla(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(fla_config()))
    with pytest.raises(CheckpointFormatError, match=r"no model\.safetensors"):
        load_fla(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointFormatError, match=r"truncated or not safetensors|corrupt"):
        load_fla(str(tmp_path))


def test_config_and_weights_disagree(tmp_path):
    write_fla_checkpoint(tmp_path, fla_config(use_short_conv=True))
    (tmp_path / "config.json").write_text(json.dumps(fla_config(use_short_conv=False)))
    with pytest.raises(CheckpointFormatError, match="does not explain"):
        load_fla(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(fla_config(use_short_conv=True, hidden_size=32)))
    with pytest.raises(CheckpointFormatError, match="shape"):
        load_fla(str(tmp_path))


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["from-fla", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err
