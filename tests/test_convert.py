"""fla checkpoint import/export: bit-exact round trips and clear errors for bad directories."""

import json

import jax
import numpy as np
import pytest
from fla_files import fla_config, write_fla_checkpoint
from safetensors.numpy import load_file

from laplace_jax import ModelConfig, init_params
from laplace_jax.checkpoint import load_model
from laplace_jax.convert import load_fla, main, save_fla
from laplace_jax.errors import CheckpointFormatError


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


@pytest.mark.parametrize("fuse_norm", [True, False])
@pytest.mark.parametrize("short_conv", [False, True])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_fla_names_of_every_flavour_import(tmp_path, fuse_norm, short_conv, kv_heads):
    """State dicts named as fla names them (fuse_norm True: attn.g_norm_swish_gate, False:
    attn.g_norm; short conv; GQA) import, and export uses fla's default name with the same values."""
    import torch
    from safetensors.torch import save_file
    from torch_gla import GLAForCausalLM

    c = fla_config(use_short_conv=short_conv, num_kv_heads=kv_heads, fuse_norm=fuse_norm)
    torch.manual_seed(0)
    sd = GLAForCausalLM(c).state_dict()
    for k in sd:
        if "norm" in k:  # distinct gains, so a mix-up between norms would show
            sd[k] = 1 + 0.1 * torch.randn_like(sd[k])
    gate = "g_norm_swish_gate" if fuse_norm else "g_norm"
    assert f"model.layers.0.attn.{gate}.weight" in sd
    (tmp_path / "fla").mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "fla" / "model.safetensors"))
    (tmp_path / "fla" / "config.json").write_text(json.dumps(c))
    cfg, params = load_fla(str(tmp_path / "fla"))
    np.testing.assert_array_equal(
        params["layers"]["attn"]["g_norm_swish_gate"]["weight"][1], sd[f"model.layers.1.attn.{gate}.weight"].numpy()
    )
    save_fla(str(tmp_path / "back"), cfg, params)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    renamed = {k.replace("attn.g_norm.", "attn.g_norm_swish_gate."): v.numpy() for k, v in sd.items()}
    assert back.keys() == renamed.keys()
    for k in back:
        np.testing.assert_array_equal(back[k], renamed[k], err_msg=k)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["fuse_norm"] is True


def test_both_gate_norm_names_is_an_error(tmp_path):
    write_fla_checkpoint(tmp_path, fla_config())
    sd = load_file(str(tmp_path / "model.safetensors"))
    for i in range(2):
        sd[f"model.layers.{i}.attn.g_norm.weight"] = sd[f"model.layers.{i}.attn.g_norm_swish_gate.weight"]
    from safetensors.numpy import save_file

    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"both attn\.g_norm_swish_gate and attn\.g_norm"):
        load_fla(str(tmp_path))


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
    with pytest.raises(CheckpointFormatError, match=r"not a readable safetensors file"):
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
