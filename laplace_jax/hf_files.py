"""The files besides the weights that make an fla export a Hugging Face model directory:
tokenizer files, token ids, a generation config and a ``trust_remote_code`` entry point.

``write_hf_files(out, cfg, tok)`` writes, next to ``config.json`` and ``model.safetensors``:

  tokenizer.json           the byte tokenizer as a ``tokenizers`` byte-level model (ids 1..255 are
                           the bytes, id 0 the end token "<|endoftext|>"), or a copy of the run's
                           own ``tokenizer.json``
  tokenizer_config.json    ``PreTrainedTokenizerFast`` with eos / bos / pad tokens
  generation_config.json   bos / eos / pad token ids
  modeling_laplace_gla.py  imports fla's GLA classes; ``config.json``'s ``auto_map`` points here,
                           so ``trust_remote_code=True`` loads the export without importing fla first

The byte tokenizer's export round-trips every byte 1..255 and decodes invalid UTF-8 the way
``ByteTokenizer.decode`` does (U+FFFD per invalid sequence). Byte 0 is the end token in both:
``ByteTokenizer`` drops it from text, the export drops it too.
"""

from __future__ import annotations

import json
import os
import shutil

from laplace_jax.config import ModelConfig
from laplace_jax.data.tokenizer import ByteTokenizer, Tokenizer

END_TOKEN = "<|endoftext|>"
MODELING_FILE = "modeling_laplace_gla.py"
MODELING_SOURCE = '''"""Entry point for ``trust_remote_code=True``: this export is an fla GLA model.

Needs flash-linear-attention (``pip install flash-linear-attention``), whose kernels need a GPU.
Written by laplace-jax's ``convert to-fla``.
"""

from fla.models import GLAConfig, GLAForCausalLM

__all__ = ["GLAConfig", "GLAForCausalLM"]
'''
AUTO_MAP = {
    "AutoConfig": f"{MODELING_FILE[:-3]}.GLAConfig",
    "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.GLAForCausalLM",
}


def byte_level_chars() -> dict[int, str]:
    """The byte-level alphabet of ``tokenizers``' ByteLevel pre-tokenizer (GPT-2's): printable
    Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + n)
            n += 1
    return out


def byte_tokenizer_json(path: str) -> None:
    """Write the byte tokenizer as a ``tokenizers`` JSON file (see the module docstring)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    chars = byte_level_chars()
    vocab = {chars[b]: b for b in range(1, 256)} | {END_TOKEN: ByteTokenizer.eos_id}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(END_TOKEN, special=True)])
    tok.save(path)


def token_ids(tok: Tokenizer) -> dict[str, int]:
    """bos / eos / pad ids for the configs: the models here have one special token, the end token."""
    return {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id}


def write_hf_files(out: str, cfg: ModelConfig, tok: Tokenizer) -> None:
    """Add the tokenizer, token ids, generation config and remote-code entry to an fla export."""
    if isinstance(tok, ByteTokenizer):
        byte_tokenizer_json(os.path.join(out, "tokenizer.json"))
        end = END_TOKEN
    else:
        shutil.copyfile(tok.spec, os.path.join(out, "tokenizer.json"))
        end = tok.eos_token
    specials = {"bos_token": end, "eos_token": end, "pad_token": end}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    ids = token_ids(tok)
    _write_json(os.path.join(out, "tokenizer_config.json"), tokenizer_config)
    _write_json(os.path.join(out, "special_tokens_map.json"), specials)
    _write_json(os.path.join(out, "generation_config.json"), ids)
    config_file = os.path.join(out, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    _write_json(config_file, {**config, **ids, "auto_map": AUTO_MAP})
    with open(os.path.join(out, MODELING_FILE), "w") as f:
        f.write(MODELING_SOURCE)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
