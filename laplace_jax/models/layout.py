"""How a model's layers are grouped for scanning: one scan per group, compile time per group.

A pure GLA model is one group, ``layers``: every layer's weights stacked, one ``nn.scan``. A
hybrid (``model.attn``) has blocks of two or more kinds (GLA, or one attention spec each), and a
scan needs one body, so the layers are cut into consecutive groups, each a ``unit`` of blocks
repeated ``repeats`` times: ``layers_0``, ``layers_1``, ... Each group is one scan over its
repeats whose body runs the unit's blocks in order (their weights stacked over the repeats).
What the compiler sees is the sum of the units' lengths, so the cut minimises that sum (fewest
groups on a tie): fla's usual hybrids, attention every k-th layer, are one group of unit length
k whatever the depth; an irregular pattern costs one block body per run of equal layers.
"""

from __future__ import annotations

import dataclasses
import functools

from laplace_jax.config import ModelConfig

Kind = int | None  # a block's mixer: None for GLA, else the index of its spec in model.attn


@dataclasses.dataclass(frozen=True)
class Group:
    name: str  # its key in the parameter tree
    unit: tuple[Kind, ...]
    repeats: int
    first: int  # its first layer's index in the model

    def layer(self, repeat: int, position: int) -> int:
        """The model's index of the unit's ``position``-th block in repeat ``repeat``."""
        return self.first + repeat * len(self.unit) + position

    def block_path(self, position: int) -> tuple[str, ...]:
        """Where that block's weights sit under the group's key (a one-block unit has no level of its own)."""
        return () if len(self.unit) == 1 else (f"block_{position}",)


def kinds(cfg: ModelConfig) -> tuple[Kind, ...]:
    specs = cfg.attn or ()
    return tuple(next((s for s, spec in enumerate(specs) if i in spec.layers), None) for i in range(cfg.n_layers))


@functools.lru_cache(maxsize=64)
def layer_groups(cfg: ModelConfig) -> tuple[Group, ...]:
    """The groups of ``cfg``'s layers, in order (module docstring)."""
    ks = kinds(cfg)
    n = len(ks)
    if all(k is None for k in ks):
        return (Group("layers", (None,), n, 0),)
    best: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] + [(1 << 30, 0, 0, 0)] * n  # (cost, groups, from, unit)
    for i in range(n):
        for j in range(i + 1, n + 1):
            length = j - i
            p = next(p for p in range(1, length + 1) if length % p == 0 and ks[i:j] == ks[i : i + p] * (length // p))
            cand = (best[i][0] + p, best[i][1] + 1, i, p)
            if cand[:2] < best[j][:2]:
                best[j] = cand
    cuts, j = [], n
    while j:
        _, _, i, p = best[j]
        cuts.append((i, j, p))
        j = i
    return tuple(Group(f"layers_{g}", ks[i : i + p], (j - i) // p, i) for g, (i, j, p) in enumerate(reversed(cuts)))


def is_layers_key(key: str) -> bool:
    """Whether a top-level parameter key holds stacked layer weights."""
    return key == "layers" or key.startswith("layers_")


def locate(cfg: ModelConfig, layer: int) -> tuple[Group, int, int]:
    """(group, repeat, position) of the model's layer ``layer``."""
    for group in layer_groups(cfg):
        offset = layer - group.first
        if 0 <= offset < group.repeats * len(group.unit):
            return group, offset // len(group.unit), offset % len(group.unit)
    raise IndexError(f"layer {layer} out of range [0, {cfg.n_layers})")
