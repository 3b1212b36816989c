"""The prefix-state cache: its index and LRU (host only), and the engine's outputs with the cache on
equal to the cache off (bit for bit from block entries; greedy text, and logprobs within 3e-5,
from a finished request's state), with the prefill it saves counted by the engine."""

import asyncio
import dataclasses

import httpx
import jax
import numpy as np
import pytest
from serving_helpers import CFG, PARAMS, TOK, Running, serve_config

from laplace_jax import init_params
from laplace_jax.loading import cast_params
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.metrics import sample_sum
from laplace_jax.serve.prefix_cache import ENTRY_OVERHEAD_BYTES, PrefixCache, block_digests
from laplace_jax.serve.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
# a finished request's state comes from the recurrent decode step: resuming from it differs from
# a full chunked prefill by rounding (measured max 3.1e-6 per token on this model; 10x margin)
END_ENTRY_TOL = 3e-5


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


# ----- the index (no device) ----------------------------------------------------------------
def cache(budget_entries: int = 4, block: int = 4, devices: int = 1) -> PrefixCache:
    return PrefixCache(budget_entries * 10, 10, block, devices)


def lookup(c: PrefixCache, prompt: list[int], device: int = 0):
    arr = np.asarray(prompt, np.int32)
    return c.lookup(arr, block_digests(arr, c.block, len(arr) // c.block), device)


def test_block_digests_chain_the_whole_prefix():
    a = np.arange(12, dtype=np.int32)
    b = a.copy()
    b[1] = 99  # differs only in the first block
    da, db = block_digests(a, 4, 3), block_digests(b, 4, 3)
    assert len(da) == 3 and len(set(da)) == 3
    assert all(x != y for x, y in zip(da, db, strict=True))  # every later digest depends on block 0
    assert block_digests(a[:8], 4, 2) == da[:2]


def test_lookup_takes_the_longest_proper_prefix():
    c = cache()
    p = np.arange(1, 14, dtype=np.int32)  # 13 ids
    d = block_digests(p, 4, 3)
    c.put_block(d[0], 4, 0, "s4")
    c.put_block(d[1], 8, 0, "s8")
    c.put_end(p[:10], 0, "s10")
    assert lookup(c, list(p)).state == "s10"  # the end entry at 10 beats the block at 8
    assert lookup(c, list(p[:10])).state == "s8"  # a proper prefix: 10 ids leave nothing to prefill
    assert lookup(c, list(p[:9])).state == "s8"
    other = list(p[:9])
    other[5] = 200  # block 1 differs: only block 0 matches
    assert lookup(c, other).state == "s4"
    assert lookup(c, [7, 7, 7, 7, 7]) is None
    assert (c.stats.hits, c.stats.misses, c.stats.cached_tokens) == (4, 1, 10 + 8 + 8 + 4)


def test_end_entry_at_a_block_multiple_and_exact_block_preferred():
    c = cache()
    p = np.arange(1, 11, dtype=np.int32)
    c.put_end(p[:8], 0, "end8")
    assert lookup(c, list(p)).state == "end8"
    c.put_block(block_digests(p, 4, 2)[1], 8, 0, "block8")
    assert lookup(c, list(p)).state == "block8"  # same length: the bit-exact entry wins


def test_lru_eviction_is_by_bytes_per_device():
    c = cache(budget_entries=2, devices=2)
    prompts = [np.full(5, i + 1, np.int32) for i in range(4)]
    for i, p in enumerate(prompts[:3]):
        c.put_block(block_digests(p, 4, 1)[0], 4, 0, f"d0-{i}")
    c.put_block(block_digests(prompts[3], 4, 1)[0], 4, 1, "d1")
    assert c.held == [20, 10] and c.stats.evictions == 1
    assert lookup(c, list(prompts[0])) is None  # the oldest on device 0 went
    assert lookup(c, list(prompts[1])).state == "d0-1"  # now most recent: the next put evicts prompt 2
    c.put_block(block_digests(np.full(5, 9, np.int32), 4, 1)[0], 4, 0, "d0-new")
    assert lookup(c, list(prompts[2])) is None and lookup(c, list(prompts[1])) is not None
    assert lookup(c, list(prompts[3]), device=0).state == "d1" and c.stats.cross_device == 1


def test_blocks_kept_are_the_last_and_the_deepest_shared():
    c = cache()
    system = np.arange(1, 11, dtype=np.int32)  # 10 ids: 2 full blocks, ends mid-block
    users = [np.concatenate([system, np.full(7, 50 + u, np.int32)]) for u in range(3)]
    keep = [c.blocks_to_keep(block_digests(p, 4, len(p) // 4)) for p in users]
    assert keep == [{4}, {4, 2}, {4, 2}]  # the second user shows the first 2 blocks are shared


def test_budget_below_one_state_is_off():
    c = PrefixCache(5, 10, 4, 1)
    c.put_block(b"x" * 16, 4, 0, "s")
    assert not c.enabled and len(c) == 0


# ----- the engine ---------------------------------------------------------------------------
def engine(cache_bytes: int, cfg=CFG, params=PARAMS, devices: int = 1, **kw) -> Engine:
    # 128-token blocks (the default for this model would be lcm(chunk_size 16, prefill chunk 16) = 16)
    kw = {"max_num_seqs": 2, "prefill_chunk": 16, "steps_per_call": 3, "max_model_len": 512, "prefix_block": 128, **kw}
    e = Engine(cfg, params, serve_config(prefix_cache_bytes=cache_bytes, devices=devices, **kw), eos_id=TOK.eos_id)
    e.warmup()
    return e


def served(e: Engine, prompts: list[list[int]], sp=GREEDY):
    """Each prompt in turn (one request at a time): completions and prompt ids prefilled per prompt."""
    outs, prefilled = [], []
    for p in prompts:
        before = e.programs.prefilled_tokens
        outs.append(e.generate([p], sp)[0])
        prefilled.append(e.programs.prefilled_tokens - before)
    return outs, prefilled


@pytest.mark.parametrize("shared", [200, 256], ids=["prefix-ends-mid-block", "prefix-on-a-block-boundary"])
def test_shared_prefix_is_bit_identical_and_prefilled_once(shared):
    prefix = ids(shared, 0)
    prompts = [prefix + ids(20 + i, 10 + i) for i in range(3)]
    off, on = engine(0), engine(1 << 26)
    a, pa = served(off, prompts)
    b, pb = served(on, prompts)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert x.logprobs == y.logprobs  # exact: same prefill calls from the same state
    cached = shared // 128 * 128  # the engine's 128-token block
    assert pa == [len(p) for p in prompts]
    assert pb == [len(prompts[0])] + [len(p) - cached for p in prompts[1:]]
    assert (on.prefix.stats.hits, on.prefix.stats.cached_tokens) == (2, 2 * cached)
    assert on.compiles.total("serving") == 0  # JAX's compile events: restores and snapshots compile nothing


def test_a_system_prompt_ending_mid_block_is_kept_once_shared():
    system = ids(300, 30)  # blocks at 128, 256; each user's own text fills the block at 384
    prompts = [system + ids(100, 31 + u) for u in range(3)]
    on = engine(1 << 26)
    _, pb = served(on, prompts)
    assert pb == [400, 400, 400 - 256]  # user 2 reveals the shared blocks; user 3 resumes at 256


def test_bf16_model_is_bit_identical_with_the_cache():
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    params = cast_params(init_params(cfg, jax.random.key(1)), "bfloat16")
    prefix = ids(256 + 40, 1)
    prompts = [prefix + ids(9, 20 + i) for i in range(2)]
    a, _ = served(engine(0, cfg, params), prompts)
    on = engine(1 << 26, cfg, params)
    b, pb = served(on, prompts)
    assert [x.tokens for x in a] == [y.tokens for y in b]
    assert [x.logprobs for x in a] == [y.logprobs for y in b]
    assert pb[1] == len(prompts[1]) - 256


def chat(e: Engine, turns: int = 3):
    """A conversation: each turn appends 30 new ids to the last prompt and reply."""
    conv, outs, prefilled = [], [], []
    for t in range(turns):
        conv = conv + ids(30, 100 + t)
        (o,), (n,) = served(e, [conv])
        outs.append(o)
        prefilled.append(n)
        conv = conv + o.tokens
    return outs, prefilled


def test_three_turn_chat_prefills_only_what_is_new():
    a, pa = chat(engine(0))
    on = engine(1 << 26)
    b, pb = chat(on)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert np.allclose([e[0] for e in x.logprobs], [e[0] for e in y.logprobs], rtol=0, atol=END_ENTRY_TOL)
    assert pa == [30, 30 + 12 + 30, 30 + 2 * (12 + 30)]
    # the new ids plus the reply's last token (sampled, never fed back through decode)
    assert pb == [30, 31, 31]
    assert on.prefix.stats.hits == 2 and on.compiles.total("serving") == 0


def test_lru_eviction_under_a_small_budget_stays_exact():
    prompts = [ids(130, i) for i in range(4)] + [ids(130, 3)[:128] + ids(5, 50)]
    a, _ = served(engine(0), prompts)
    small = engine(2 * (engine(0).state_bytes + ENTRY_OVERHEAD_BYTES))  # two entries
    b, _ = served(small, prompts)
    assert [x.tokens for x in a] == [y.tokens for y in b]
    assert [x.logprobs for x in a] == [y.logprobs for y in b]
    assert small.prefix.stats.evictions > 0 and len(small.prefix) == 2
    assert max(small.prefix.held) == 2 * (small.state_bytes + ENTRY_OVERHEAD_BYTES)
    assert small.prefix.stats.hits == 1  # the last prompt resumes from the newest block


def test_a_hit_on_another_devices_entry_is_a_copy():
    prefix = ids(128, 3)
    first, second = prefix + ids(10, 4), prefix + ids(11, 5)
    busy = ids(40, 6)
    off, on = engine(0, devices=2), engine(1 << 26, devices=2)
    res = {}
    for name, e in (("off", off), ("on", on)):
        e.generate([first], GREEDY)  # device 0 (the least loaded; lowest index first)
        res[name] = e.generate([busy, second], GREEDY)  # busy takes device 0, second device 1
    assert [o.tokens for o in res["off"]] == [o.tokens for o in res["on"]]
    assert [o.logprobs for o in res["off"]] == [o.logprobs for o in res["on"]]
    assert on.prefix.stats.cross_device == 1 and on.prefix.stats.cached_tokens == 128
    assert on.compiles.total("serving") == 0


def test_n_members_share_one_restored_prefill():
    prefix = ids(128, 7)
    results = {}
    for name, nbytes in (("off", 0), ("on", 1 << 26)):
        e = engine(nbytes)
        e.generate([prefix + ids(3, 8)], GREEDY)
        outs = {0: [], 1: []}
        sp = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
        prompt = prefix + ids(9, 9)
        before = e.programs.prefilled_tokens
        e.submit(*(Request(prompt, sp[j], lambda t, r, out=outs[j]: out.extend(t)) for j in range(2)))
        e.run_until_idle()
        results[name] = (outs, e.programs.prefilled_tokens - before)
    assert results["on"][0] == results["off"][0]
    assert results["off"][1] == 137 and results["on"][1] == 9


def test_server_exports_cache_metrics_and_the_bench_counts_turns(tmp_path):
    from laplace_jax.serve import bench

    srv = Running(max_num_seqs=2, prefill_chunk=16, prefix_cache_bytes=1 << 26)
    try:
        flags = "--workload multi-turn --num-prompts 2 --turns 3 --input-len 20 --output-len 6 --temperature 0"
        args = bench.parse(["--base-url", srv.url, "--model", "tiny", *flags.split()])
        res = asyncio.run(bench.run(args))
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.close()
    assert res["failed"] == 0
    turns = res["turns"]
    assert [t["prefilled_tokens"] for t in turns] == [40, 42, 42]  # 2 chats x (20 new + the last reply token)
    assert [t["restored_tokens"] for t in turns] == [0, 2 * 25, 2 * 51]
    assert [t["prompt_tokens"] for t in turns] == [40, 92, 144]
    assert sample_sum(metrics, "laplace:prefix_cache_hits_total") == 4
    assert sample_sum(metrics, "laplace:prefix_cache_misses_total") == 2
    assert sample_sum(metrics, "laplace:prefix_cache_tokens_total") == 2 * 25 + 2 * 51
    assert sample_sum(metrics, "laplace:prefix_cache_bytes") > 0
    assert sample_sum(metrics, "laplace:compiles_total", phase="serving") == 0


def test_byte_size_flag():
    import argparse

    from laplace_jax.serve.config import byte_size

    assert byte_size("0") == 0 and byte_size("512M") == 512 << 20 and byte_size("1g") == 1 << 30
    for bad in ("12X", "-1", "G"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_a_block_that_breaks_the_chunk_partition_is_refused():
    """The unit is the model's own kernel chunk (CFG.chunk_size = 16) and the prefill chunk."""
    with pytest.raises(ValueError, match=r"multiple of 16 \(the model's 16-token kernel chunk"):
        Engine(CFG, PARAMS, serve_config(prefill_chunk=16, prefix_cache_bytes=1 << 20, prefix_block=200), eos_id=0)
    engine = Engine(CFG, PARAMS, serve_config(prefill_chunk=16, prefix_cache_bytes=1 << 20, prefix_block=48), eos_id=0)
    assert engine.prefix.block == 48
