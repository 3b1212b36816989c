"""Prefix-state cache: the recurrent state after a run of token ids, so a prompt that starts with
them resumes there and prefills only the rest.

A GLA model's whole context is one fixed-size state per sequence (GLA state stack + short-conv
caches; 29.5 MB for the 3B model at any length), so an entry costs the same for a 16-token prefix
as for a 16k-token one. Two kinds of entry:

  block  the state at a multiple of ``block`` prompt tokens, taken from the prefill itself.
         ``block`` is a multiple of the prefill chunk and of the kernel's chunk (``chunk_size``), so a
         prompt resumed from it is cut into the same prefill calls as without the cache: its
         numbers are bit-identical (``exact``).
  end    the state at the end of a finished request (its prompt and every generated token that
         was fed back), for the conversation's next turn. The decode step produced it, so a
         prompt resumed from it differs from a full prefill by the recurrent-vs-chunked rounding
         (the same as decode's own tokens do); block entries are not taken after such a resume.

Which block states are kept: a prompt's last full block, and the deepest block that an earlier
prompt also had (its digest was seen before: a shared prefix, such as a system prompt that ends
mid-block). Interior blocks are not kept: a 2,048-id prompt would otherwise fill 16 entries
(0.47 GB for the 3B model) of which later prompts use one.

Keys are chained digests of ``block``-token runs (``block_digests``): one hash per block over the
ids' bytes, no per-token Python work. An end entry of length m is filed under the digest of its
m // block full blocks with the digest of its last m % block ids (a run of exactly ``block`` ids
when m is a multiple). A lookup walks the prompt's block digests from the longest down and takes
the longest entry that is a proper prefix (at least one token is left to prefill: its last logits
start sampling).

Entries are device arrays on the device whose prefill or slot produced them: restoring one into
that device's prefill is zero-copy (the state is assembled from per-device buffers), and one
held by another device is one device-to-device copy (still a hit). Host memory would cost a
host-to-device copy of the whole state per hit. The byte budget is per device, with LRU
eviction within each device. This module is host-side bookkeeping; it runs on the engine thread.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any

import numpy as np

DIGEST_BYTES = 16
SEEN_DIGESTS = 1 << 16  # block digests remembered to spot shared prefixes (1 MB)
# Host memory an entry costs beyond its state (the Entry, its key, one jax.Array per state leaf):
# counted against the budget so it bounds what the process grows by. The soak measured about 4 KB
# per entry with the tiny model (RSS growth minus state bytes held, over its entries).
ENTRY_OVERHEAD_BYTES = 4096


def block_digests(ids: np.ndarray, block: int, n_blocks: int) -> list[bytes]:
    """Chained digests of the first ``n_blocks`` runs of ``block`` ids: digest[j] identifies
    ids[: (j + 1) * block] (each folds in the one before)."""
    out, prev = [], b""
    data = np.ascontiguousarray(ids[: n_blocks * block], dtype=np.int32)
    for j in range(n_blocks):
        prev = hashlib.blake2b(prev + data[j * block : (j + 1) * block].tobytes(), digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out


def _tail_digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=DIGEST_BYTES).digest()


@dataclasses.dataclass(eq=False)
class Entry:
    """A cached state: ``length`` ids, held on device index ``device`` as ``state`` (the model's
    state for one sequence: a tuple of per-layer dicts, leaves [1, ...])."""

    key: tuple
    length: int
    device: int
    state: Any
    nbytes: int
    exact: bool


@dataclasses.dataclass
class CacheStats:
    """Counters since start (the engine exports them as metrics)."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens restored instead of prefilled
    evictions: int = 0
    cross_device: int = 0  # hits served from another device's entry (one copy each)


class PrefixCache:
    """LRU cache of per-sequence states keyed by the token ids they follow; ``budget`` bytes per
    device (entries of ``entry_bytes`` each)."""

    def __init__(self, budget: int, entry_bytes: int, block: int, devices: int):
        if block < 1:
            raise ValueError(f"the prefix block must be positive; got {block}")
        self.budget, self.entry_bytes, self.block, self.devices = budget, entry_bytes, block, devices
        self._entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()  # LRU first
        self._tails: dict[bytes, dict[int, set[bytes]]] = {}  # parent digest -> tail length -> digests
        self.held = [0] * devices  # bytes per device
        self.stats = CacheStats()
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.entry_bytes <= self.budget

    @property
    def capacity(self) -> int:
        """Entries each device can hold."""
        return self.budget // self.entry_bytes if self.entry_bytes else 0

    def __len__(self) -> int:
        return len(self._entries)

    # ----- lookup ------------------------------------------------------------------------
    def lookup(self, ids: np.ndarray, digests: list[bytes], device: int) -> Entry | None:
        """The entry for the longest proper prefix of ``ids`` (None: a miss) for a prefill on
        device index ``device``; counts the hit or miss. ``digests``: ``block_digests`` of
        ``ids``' full blocks."""
        limit = len(ids) - 1
        n_blocks = limit // self.block
        digests = [b"", *digests[:n_blocks]]
        found = None
        for j in range(n_blocks, -1, -1):  # longest first: tails under block j, then block j itself
            found = self._longest_tail(ids, digests[j], j * self.block, limit)
            if found is None and j > 0:
                found = self._entries.get(("block", digests[j]))
            if found is not None:
                break
        if found is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(found.key)
        self.stats.hits += 1
        self.stats.cached_tokens += found.length
        self.stats.cross_device += found.device != device
        return found

    def _longest_tail(self, ids: np.ndarray, parent: bytes, start: int, limit: int) -> Entry | None:
        for t in sorted(self._tails.get(parent, {}), reverse=True):
            if start + t <= limit:
                key = ("end", parent, t, _tail_digest(ids[start : start + t]))
                if key in self._entries:
                    return self._entries[key]
        return None

    # ----- insertion ---------------------------------------------------------------------
    def blocks_to_keep(self, digests: list[bytes]) -> set[int]:
        """Of a prompt's full blocks (``digests``), the block counts whose states to keep: the
        last, and the deepest one an earlier prompt had; then remember these digests."""
        keep = {len(digests)} if digests else set()
        shared = [j + 1 for j, d in enumerate(digests) if d in self._seen]
        if shared:
            keep.add(max(shared))
        for d in digests:
            self._seen[d] = None
            self._seen.move_to_end(d)
        while len(self._seen) > SEEN_DIGESTS:
            self._seen.popitem(last=False)
        return keep

    def plan(self, prompts: dict[int, list[int]]) -> tuple[dict[int, tuple[int, Any]], dict[int, dict[int, bytes]]]:
        """For a prefill of ``prompts`` ({device: ids}): each prompt's longest cached prefix
        ({device: (ids restored, state)}), and the block states to keep ({device: {ids done:
        block digest}}, as ``blocks_to_keep`` picks; only for rows whose numbers are those of a
        full prefill: no resume, or a resume from a block entry)."""
        starts, keep = {}, {}
        for d, ids in prompts.items():
            arr = np.asarray(ids, np.int32)
            digests = block_digests(arr, self.block, len(arr) // self.block)
            hit = self.lookup(arr, digests, d)
            kept = self.blocks_to_keep(digests) if hit is None or hit.exact else set()
            keep[d] = {n * self.block: digests[n - 1] for n in kept}
            if hit is not None:
                starts[d] = (hit.length, hit.state)
        return starts, keep

    def put_block(self, digest: bytes, length: int, device: int, state: Any) -> None:
        """Hold the prefill's ``state`` after ``length`` ids (a multiple of ``block``) whose last
        block digest is ``digest``."""
        self._put(("block", digest), length, device, state, exact=True)

    def put_end(self, ids: np.ndarray, device: int, state: Any) -> None:
        """Hold a finished request's ``state``, the state after exactly ``ids``."""
        m = len(ids)
        if m == 0:
            return
        full = (m - 1) // self.block  # a multiple of block files as a full-length tail
        parent = block_digests(ids, self.block, full)[-1] if full else b""
        key = ("end", parent, m - full * self.block, _tail_digest(ids[full * self.block :]))
        self._put(key, m, device, state, exact=False)

    def _put(self, key: tuple, length: int, device: int, state: Any, exact: bool) -> None:
        """Hold ``state`` (``length`` ids, on device index ``device``) under ``key``; evicts this
        device's least recently used entries to stay within the budget. A key already held is
        only refreshed."""
        if not self.enabled:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        while self.held[device] + self.entry_bytes > self.budget:
            self._evict_one(device)
        self._entries[key] = Entry(key, length, device, state, self.entry_bytes, exact)
        self.held[device] += self.entry_bytes
        if key[0] == "end":
            self._tails.setdefault(key[1], {}).setdefault(key[2], set()).add(key[3])

    def _evict_one(self, device: int) -> None:
        key = next(k for k, e in self._entries.items() if e.device == device)
        entry = self._entries.pop(key)
        self.held[device] -= entry.nbytes
        self.stats.evictions += 1
        if key[0] == "end":
            by_len = self._tails[key[1]]
            by_len[key[2]].discard(key[3])
            if not by_len[key[2]]:
                del by_len[key[2]]
            if not by_len:
                del self._tails[key[1]]

    def clear(self) -> None:
        """Drop every entry (the engine's slots were rebuilt)."""
        self._entries.clear()
        self._tails.clear()
        self.held = [0] * self.devices
