"""Incremental detokenization and stop strings: same text as one decode, linear work, exact stop cuts."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.serve.detok import IncrementalDecoder, StopMatcher, TextStream


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting how many ids its decode has been shown."""

    def __init__(self):
        self.seen = 0

    def decode(self, ids):
        self.seen += len(ids)
        return super().decode(ids)


def stream_all(dec: IncrementalDecoder, ids: list[int], step: int) -> str:
    out = "".join(dec.push(ids[i : i + step]) for i in range(0, len(ids), step))
    return out + dec.flush()


@pytest.mark.parametrize("step", [1, 3])
def test_utf8_text_streams_to_the_same_string(step):
    text = "naïve café — 東京 🙂 done"
    ids = ByteTokenizer().encode(text)
    assert stream_all(IncrementalDecoder(ByteTokenizer(), ByteTokenizer().encode("ctx ")), ids, step) == text


def test_random_bytes_stream_like_one_decode():
    rng = np.random.default_rng(0)
    tok = ByteTokenizer()
    for trial in range(20):
        ids = rng.integers(1, 256, 300).tolist()
        prompt = rng.integers(1, 128, 8).tolist()  # ASCII: the prompt ends on a character boundary
        assert stream_all(IncrementalDecoder(tok, prompt), ids, 1 + trial % 4) == tok.decode(ids), trial


def test_prompt_ending_mid_character_does_not_leak_into_the_output():
    tok = ByteTokenizer()
    prompt = [*tok.encode("abc"), 0xE6]  # a dangling lead byte
    ids = [0x01, *tok.encode("xyz")]
    assert stream_all(IncrementalDecoder(tok, prompt), ids, 1) == tok.decode(ids)


def test_decoding_work_is_linear_in_output_length():
    def work(n: int) -> int:
        tok = CountingTokenizer()
        dec = IncrementalDecoder(tok, [65] * 10)
        ids = np.random.default_rng(1).integers(1, 256, n).tolist()
        stream_all(dec, ids, 1)
        return tok.seen

    small, large = work(500), work(5000)
    assert large / 5000 < 50  # a bounded window per token
    assert large < 12 * small  # 10x the tokens, ~10x the work (quadratic would be ~100x)


def test_hf_byte_level_bpe_streams_like_one_decode():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café 東京 🙂", "GLA state is fixed"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))

    class HF:
        def decode(self, ids):
            return tok.decode(ids)

    text = "the lazy café 東京 fox 🙂 state"
    ids = tok.encode(text).ids
    for step in (1, 2, 5):
        assert stream_all(IncrementalDecoder(HF(), tok.encode("fixed ").ids), ids, step) == tok.decode(ids)


def test_stop_matcher_cuts_at_the_earliest_stop_across_chunks():
    m = StopMatcher(["END", "xyz"])
    sent = []
    for piece in ["hello E", "N", "D and xyz"]:
        text, hit = m.feed(piece)
        sent.append(text)
        if hit:
            break
    assert "".join(sent) == "hello " and hit


def test_stop_matcher_holds_back_a_partial_match_then_releases_it():
    m = StopMatcher(["STOP"])
    assert m.feed("abcST") == ("abc", False)  # "ST" could begin "STOP"
    assert m.feed("O") == ("", False)
    assert m.feed("x") == ("STOx", False)
    assert m.flush() == ""
    m2 = StopMatcher(["STOP"])
    assert m2.feed("abSTO") == ("ab", False)
    assert m2.flush() == "STO"  # the generation ended without completing the stop


def test_text_stream_finish_reports_a_stop_found_in_the_held_tail():
    tok = ByteTokenizer()
    ts = TextStream(tok, ["é!"], [])
    ids = tok.encode("ab é!")
    text, hit = ts.push(ids[:-1])  # "ab " + é: "é" could start the stop string
    assert (text, hit) == ("ab ", False)
    rest, hit = ts.push(ids[-1:])
    assert (rest, hit) == ("", True)


def test_a_long_undecodable_run_is_settled_in_bounded_windows():
    tok = CountingTokenizer()
    ids = [0x80] * 3000 + ByteTokenizer().encode("ok é")  # 3000 lone continuation bytes, then text
    out = stream_all(IncrementalDecoder(tok, []), ids, 1)
    assert out == ByteTokenizer().decode(ids)
    assert tok.seen / len(ids) < 200  # bounded per token, not growing with the run
