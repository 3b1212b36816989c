"""The GLA language model and its entry points: forward, prefill, decode step, and a speculative
verify with its commit.

    forward(cfg, params, tokens [B, T])              -> logits [B, T, V] fp32
    prefill(cfg, params, tokens [B, T], state=None)  -> (logits [B, T, V], state)
    decode_step(cfg, params, token [B], state)       -> (logits [B, V], state)
    verify(cfg, params, tokens [B, N], state, live)  -> (logits [B, N, V], trace)
    commit(cfg, state, trace, emitted [B])           -> state after the first emitted tokens

All three share one parameter tree; layer weights are stacked on a leading axis of size
n_layers (``layers``), or, in a hybrid model with softmax attention layers (``model.attn``),
per group of layers (``layers_0``, ... : ``models.layout``). ``forward`` and ``prefill`` run each
group with ``nn.scan`` (compile time flat in depth), optionally rematerialised.

The per-sequence state is a tuple of n_layers dicts, one per layer: ``gla`` [B, H, dk, dv]
float32 and, with short conv, ``conv_q`` / ``conv_k`` / ``conv_v`` [B, W * channels] in the
compute dtype (the last W inputs, oldest first, flattened: ``layers.common.ShortConv``); an
attention layer's ``k`` / ``v`` [B, R, kv heads, head_dim] ring and ``pos`` [B] int32
(``layers.attention``).
Every leaf is its own buffer because ``decode_step`` runs the layers as an unrolled loop, and a
layer whose state is a buffer of its own updates it in one pass: the new state and the output read
from it are one fusion that reads the donated state once and writes it once in place. Slices of
one stacked buffer cannot do that (the TPU compiler splits the update into a dynamic-update-slice
and a second read for the output: 3 passes over the state, 34% of its bandwidth floor against 64%
for per-layer buffers at the 3B config, W=256, v5p, compiler estimates). ``prefill`` stacks the
tuple for its scan and splits it again: a copy of the state, small beside the prompt's compute.
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.config import REMAT_POLICIES, AttnSpec, ModelConfig
from laplace_jax.layers.attention import Attention, ring_size
from laplace_jax.layers.common import (
    TRACES,
    VERIFY_INPUTS,
    Embedding,
    Linear,
    RMSNorm,
    SwiGLU,
    conv_cache,
    model_target,
    weights_in_own_buffers,
)
from laplace_jax.layers.gla import GatedLinearAttention
from laplace_jax.models.layout import Group, is_layers_key, layer_groups, locate
from laplace_jax.ops.gla import gla_replay
from laplace_jax.ops.norm.mosaic import LANES
from laplace_jax.parallel import constrain

Array = jax.Array
Params = dict

LayerState = dict[str, Array]  # one layer's state (module docstring)
State = tuple[LayerState, ...]  # n_layers of them
Stack = dict[str, Array]  # the same leaves stacked on a leading layer axis, inside the layer scan
CONV_CACHES = {"conv_q": "q_conv1d", "conv_k": "k_conv1d", "conv_v": "v_conv1d"}  # state key -> conv module


def pack_weights(params: Params) -> Params:
    """bf16 layer weights as their uint16 bits: the form in which XLA:CPU runs ``prefill`` (the
    scanned layers) without a weight-sized copy. A CPU workaround: pack once where the weights
    are placed on CPU devices (serving does); other backends take the bf16 weights as they are,
    and so does ``decode_step`` on every backend (its layer loop is unrolled; both forms work).

    XLA:CPU widens a bf16 array that is sliced inside a loop to f32 as a whole, and the
    widening of the loop-invariant stack is hoisted out of the layer loop: an f32 copy of every
    layer's weights at once (10.2 GiB of temporaries for the 3B prefill of one 512-token row).
    Integer bits are never widened; the model turns each layer's slice back into bf16 inside the loop.
    A bitcast inside the jitted step would not help: it materialises a copy of its own (on the
    TPU compiler, a weight-sized temporary and 44% of the 3B decode step's estimate)."""
    to_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x  # noqa: E731
    return {k: jax.tree.map(to_bits, v) if is_layers_key(k) else v for k, v in params.items()}


def unstack_weights(cfg: ModelConfig, params: Params) -> Params:
    """The layer weights with each layer in buffers of its own: every layer group's stacked tree
    becomes a tuple of per-layer trees (the same bytes; place it once, as serving does on TPU).
    ``decode_step``, ``verify`` and ``prefill`` take this form and run the layers unrolled, and on
    a TPU with two TensorCores per chip their few-row products are then the Mosaic matmul kernel
    (``layers.common.matmul``), which reads each weight in place: a slice of a stack it would
    first copy out. Training takes the stacked form.

    A vector whose width is not whole lane tiles (the 3B's 192-wide output-norm gain) is placed
    as a [1, w] row, the form the Mosaic row kernels read it in (``ops.norm.mosaic.gain_rows``):
    on a TPU a [w] vector is laid out otherwise, and its reshape to [1, w] is a relayout copy in
    every step (24 per token in the 3B decode). The model views the row back as [w]
    (``_as_declared``), and in the compiled program that view and the kernel's reshape cancel."""
    out = dict(params)
    for group in layer_groups(cfg):
        stack = params[group.name]
        out[group.name] = tuple(jax.tree.map(lambda w, r=r: _placed(w[r]), stack) for r in range(group.repeats))
    return out


def _placed(w: Array) -> Array:
    """One layer's weight as ``unstack_weights`` places it: a vector not whole lane tiles as a row."""
    return w.reshape(1, -1) if w.ndim == 1 and w.shape[0] % LANES else w


@functools.cache
def _declared(cfg: ModelConfig) -> Params:
    """Each layer group's weights as the modules declare one layer's (ShapeDtypeStructs)."""
    abstract = abstract_params(cfg)
    one = lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype)  # noqa: E731  less the layer axis
    return {group.name: jax.tree.map(one, abstract[group.name]) for group in layer_groups(cfg)}


def _as_declared(cfg: ModelConfig, layer: int, weights: Params) -> Params:
    """One layer's placed weights (``layer_weights``) in the shapes its modules declare."""
    group, _, j = locate(cfg, layer)
    node = _declared(cfg)[group.name]
    for key in group.block_path(j):
        node = node[key]
    return jax.tree.map(lambda w, d: w.reshape(d.shape), weights, node)


def _is_unstacked(params: Params) -> bool:
    return any(isinstance(v, tuple) for k, v in params.items() if is_layers_key(k))


def _is_packed(params: Params) -> bool:
    return any(x.dtype == jnp.uint16 for k, v in params.items() if is_layers_key(k) for x in jax.tree.leaves(v))


def _unpack(variables: dict) -> dict:
    """One layer's weights with uint16 bits (``pack_weights``) turned back into bf16."""
    return jax.tree.map(
        lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x, variables
    )


class Block(nn.Module):
    """Pre-norm block: x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x)). The mixer is GLA, or
    softmax attention when ``spec`` is given (a hybrid's attention layer).

    ``__call__`` is the body of the scan over stacked layers (prefill and training); ``step`` is
    one layer on its own state (``decode_step``'s unrolled layer loop)."""

    cfg: ModelConfig
    spec: AttnSpec | None = None

    def setup(self) -> None:
        cfg = self.cfg
        dt = cfg.compute_dtype
        self.attn_norm = RMSNorm(cfg.norm_eps, dt)
        self.attn = GatedLinearAttention(cfg) if self.spec is None else Attention(cfg, self.spec)
        self.mlp_norm = RMSNorm(cfg.norm_eps, dt)
        self.mlp = SwiGLU(cfg.intermediate_size, dtype=dt, init_std=cfg.init_std)

    def __call__(self, carry: tuple[Array, Array | None, Stack | None], layer: Array) -> tuple[tuple, None]:
        """carry: (x [B, T, D], lengths [B] or None, the stacked state or None); layer: this layer's index."""
        x_BxTxD, lengths_B, stack = carry
        state = (
            None if stack is None else jax.tree.map(lambda s: jax.lax.dynamic_index_in_dim(s, layer, 0, False), stack)
        )
        x_BxTxD, state = self.step(x_BxTxD, lengths_B, state)
        if stack is not None:
            stack = jax.tree.map(lambda s, n: jax.lax.dynamic_update_index_in_dim(s, n, layer, 0), stack, state)
        return (x_BxTxD, lengths_B, stack), None

    def step(
        self, x_BxTxD: Array, lengths_B: Array | None, state: LayerState | None
    ) -> tuple[Array, LayerState | None]:
        """One layer: x [B, T, D] and this layer's state (or None) -> (x, its new state)."""
        x_BxTxD = constrain(x_BxTxD, ("batch", "length", "act_embed"))
        h, state = self.attn(self.attn_norm(x_BxTxD), state, lengths_B)
        x_BxTxD, normed = self.mlp_norm(x_BxTxD, h)  # x + h and its norm, one pass
        return self.mlp(normed, residual=x_BxTxD), state  # x + mlp, the add in the last product


def _remat(cfg: ModelConfig) -> type[Block]:
    return Block if cfg.remat == "none" else nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat])


class Unit(nn.Module):
    """A group's unit of several blocks (``models.layout``): the body of its scan, each block on
    its own stacked state."""

    cfg: ModelConfig
    specs: tuple[AttnSpec | None, ...]

    def setup(self) -> None:
        self.blocks = [_remat(self.cfg)(self.cfg, spec, name=f"block_{j}") for j, spec in enumerate(self.specs)]

    def __call__(self, carry: tuple[Array, Array | None, tuple | None], repeat: Array) -> tuple[tuple, None]:
        x, lengths_B, stacks = carry
        new = []
        for j, block in enumerate(self.blocks):
            (x, _, stack), _ = block((x, lengths_B, None if stacks is None else stacks[j]), repeat)
            new.append(stack)
        return (x, lengths_B, None if stacks is None else tuple(new)), None


def _scanned(cfg: ModelConfig, group: Group, packed: bool) -> nn.Module:
    specs = tuple(None if kind is None else cfg.attn[kind] for kind in group.unit)
    body, args = (_remat(cfg), (cfg, specs[0])) if len(specs) == 1 else (Unit, (cfg, specs))
    if packed:  # bf16 layer weights arrive as uint16 bits (pack_weights): one layer unpacked at a time
        body = nn.map_variables(body, "params", trans_in_fn=_unpack)
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=0,
        out_axes=0,
        length=group.repeats,
        unroll=1 if cfg.scan_layers else group.repeats,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(*args)


class GLALM(nn.Module):
    """Embeddings -> n_layers scanned blocks (one scan per group of layers) -> RMSNorm -> LM head
    (untied unless tie_embeddings)."""

    cfg: ModelConfig
    packed: bool = False  # bf16 layer weights passed as uint16 bits (``pack_weights``)

    def setup(self) -> None:
        cfg = self.cfg
        dt = cfg.compute_dtype
        self.embeddings = Embedding(cfg.vocab_size, cfg.d_model, dt, cfg.init_std)
        groups = layer_groups(cfg)
        scans = [_scanned(cfg, group, self.packed) for group in groups]
        self.layers = scans[0] if groups[0].name == "layers" else scans  # a list: layers_0, layers_1, ...
        self.norm = RMSNorm(cfg.norm_eps, dt)
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.vocab_size, ("embed", "vocab"), dtype=dt, init_std=cfg.init_std, fp32_out=True)

    def __call__(
        self, tokens_BxT: Array, stacks: tuple | None, lengths_B: Array | None = None
    ) -> tuple[Array, tuple | None]:
        """tokens [B, T] and the stacked state of each group (``_stack``, or None) -> (logits
        [B, T, V] fp32, the groups' stacked states)."""
        x = self.embed(tokens_BxT)
        scans = self.layers if isinstance(self.layers, (list, tuple)) else [self.layers]
        new = []
        for g, (group, scan) in enumerate(zip(layer_groups(self.cfg), scans, strict=True)):
            (x, _, stack), _ = scan((x, lengths_B, None if stacks is None else stacks[g]), jnp.arange(group.repeats))
            new.append(stack)
        return self.head(x), (None if stacks is None else tuple(new))

    def embed(self, tokens_BxT: Array) -> Array:
        return constrain(jnp.take(self.embeddings(), tokens_BxT, axis=0), ("batch", "length", "act_embed"))

    def head(self, x_BxTxD: Array) -> Array:
        """Final norm and LM head: x [B, T, D] -> logits [B, T, V] fp32."""
        x = self.norm(x_BxTxD)
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, self.embeddings(), preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(x)
        return constrain(logits, ("batch", "length", "act_vocab")).astype(jnp.float32)


def _check_tokens(tokens: Array, ndim: int, what: str) -> None:
    if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
        shape = "[B, T]" if ndim == 2 else "[B]"
        raise ValueError(f"{what} must be integer token ids of shape {shape}; got {tokens.dtype} {tuple(tokens.shape)}")
    if ndim == 2 and tokens.shape[1] == 0:
        raise ValueError("tokens must hold at least one position (T >= 1)")


def init_params(cfg: ModelConfig, rng: Array) -> Params:
    """Random float32 parameters (N(0, init_std^2) weights, zero biases, unit norm gains)."""
    boxed = GLALM(cfg).init(rng, jnp.zeros((1, 1), jnp.int32), None)["params"]
    return nn.meta.unbox(boxed)


def abstract_params(cfg: ModelConfig) -> Params:
    """The parameter tree as ShapeDtypeStructs (nothing allocated)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def param_logical_axes(cfg: ModelConfig) -> Params:
    """A PartitionSpec of logical axis names for every parameter (stacked layers lead with 'layers')."""
    boxed = jax.eval_shape(lambda: GLALM(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32), None))["params"]
    return nn.get_partition_spec(boxed)


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def init_state(cfg: ModelConfig, batch: int) -> State:
    """A zero per-sequence state for ``batch`` sequences: one dict per layer (module docstring)."""

    def layer(i: int) -> LayerState:
        spec = cfg.attn_spec(i)
        if spec is not None:
            kv = (batch, ring_size(cfg, spec), spec.kv_heads, cfg.d_model // spec.num_heads)
            dt = cfg.compute_dtype
            return {"k": jnp.zeros(kv, dt), "v": jnp.zeros(kv, dt), "pos": jnp.zeros((batch,), jnp.int32)}
        state = {"gla": jnp.zeros((batch, cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim), jnp.float32)}
        if cfg.use_short_conv:
            W, G, dt = cfg.conv_size, cfg.kv_groups, cfg.compute_dtype
            state["conv_q"] = jnp.zeros((batch, W * cfg.key_dim), dt)
            state["conv_k"] = jnp.zeros((batch, W * (cfg.key_dim // G)), dt)
            state["conv_v"] = jnp.zeros((batch, W * (cfg.value_dim // G)), dt)
        return state

    return tuple(layer(i) for i in range(cfg.n_layers))


def _check_state(cfg: ModelConfig, state: State, batch: int) -> None:
    want = jax.eval_shape(lambda: init_state(cfg, batch))
    if not isinstance(state, (tuple, list)) or len(state) != len(want):
        got = f"a {type(state).__name__}" + (f" of {len(state)}" if isinstance(state, (tuple, list)) else "")
        raise ValueError(
            f"state must be a tuple of {len(want)} per-layer dicts (init_state(cfg, batch) makes one); got {got}"
        )
    for layer, (have, ref) in enumerate(zip(state, want, strict=True)):
        if not isinstance(have, dict) or set(have) != set(ref):
            keys = sorted(have) if isinstance(have, dict) else type(have).__name__
            raise ValueError(f"state[{layer}] must be a dict with keys {sorted(ref)}; got {keys}")
        for key, leaf in ref.items():
            if tuple(have[key].shape) != leaf.shape:
                raise ValueError(
                    f"state[{layer}][{key!r}] must have shape {leaf.shape} for batch {batch}; "
                    f"got {tuple(have[key].shape)}"
                )


def _stack(cfg: ModelConfig, state: State) -> tuple:
    """Per group, the states of its layers stacked over its repeats (one stack per unit position;
    a one-block unit's is the stack itself), as the groups' scans carry them."""

    def group_stack(group: Group) -> Stack | tuple[Stack, ...]:
        stacks = tuple(
            jax.tree.map(lambda *layers: jnp.stack(layers), *(state[group.layer(r, j)] for r in range(group.repeats)))
            for j in range(len(group.unit))
        )
        return stacks[0] if len(stacks) == 1 else stacks

    return tuple(group_stack(group) for group in layer_groups(cfg))


def _split(cfg: ModelConfig, stacks: tuple) -> State:
    def one(layer: int) -> LayerState:
        group, r, j = locate(cfg, layer)
        stack = stacks[layer_groups(cfg).index(group)]
        return jax.tree.map(lambda x: x[r], stack if len(group.unit) == 1 else stack[j])

    return tuple(one(layer) for layer in range(cfg.n_layers))


def stack_layers(cfg: ModelConfig, layers: list[Params]) -> Params:
    """Per-layer weight trees (NumPy, the model's order) -> the groups' stacked trees
    ({group name: tree}), as ``init_params`` lays them out."""
    out: Params = {}
    for group in layer_groups(cfg):
        node: Params = {}
        for j in range(len(group.unit)):
            stacked = jax.tree.map(lambda *ws: np.stack(ws), *(layers[group.layer(r, j)] for r in range(group.repeats)))
            if group.block_path(j):
                node[group.block_path(j)[0]] = stacked
            else:
                node = stacked
        out[group.name] = node
    return out


def layer_weights(cfg: ModelConfig, params: Params, layer: int) -> Params:
    """One layer's weights (unstacked, as placed: packed bits stay packed)."""
    group, r, j = locate(cfg, layer)
    node = params[group.name]
    stacked = not isinstance(node, tuple)
    if not stacked:  # unstack_weights: one tree per repeat
        node = node[r]
    for key in group.block_path(j):
        node = node[key]
    return jax.tree.map(lambda w: w[r], node) if stacked else node


def forward(cfg: ModelConfig, params: Params, tokens_BxT: Array) -> Array:
    """Training / scoring forward pass: logits [B, T, V] float32 from a zero state."""
    _check_tokens(tokens_BxT, 2, "tokens")
    if _is_unstacked(params):
        raise ValueError("forward takes the stacked weights (init_params' form), not unstack_weights'")
    with model_target(tokens_BxT):
        logits, _ = GLALM(cfg, _is_packed(params)).apply({"params": params}, tokens_BxT, None)
    return logits


def prefill(
    cfg: ModelConfig, params: Params, tokens_BxT: Array, state: State | None = None, lengths_B: Array | None = None
) -> tuple[Array, State]:
    """Run a prompt (optionally continuing ``state``): (logits [B, T, V], state after the prompt).

    ``lengths_B``: row b holds lengths[b] real tokens followed by padding that leaves the state
    untouched (fixed-size prefill chunks); its last real logits are logits[b, lengths[b] - 1].
    """
    _check_tokens(tokens_BxT, 2, "tokens")
    if state is None:
        state = init_state(cfg, tokens_BxT.shape[0])
    _check_state(cfg, state, tokens_BxT.shape[0])
    if _is_unstacked(params):  # unstack_weights: the layers unrolled, as decode_step runs them
        logits, new_state, _ = _unrolled(cfg, params, tokens_BxT, state, lengths_B)
        return logits, new_state
    with model_target(tokens_BxT):
        logits, stacks = GLALM(cfg, _is_packed(params)).apply(
            {"params": params}, tokens_BxT, _stack(cfg, state), lengths_B
        )
    return logits, _split(cfg, stacks)


def decode_step(
    cfg: ModelConfig, params: Params, token_B: Array, state: State, live_B: Array | None = None
) -> tuple[Array, State]:
    """Advance every sequence by one token with the recurrent step: (logits [B, V], state).

    The layers run as an unrolled loop, each on its own state buffer (module docstring).
    ``live_B`` (bool): a row where it is False keeps its state bit for bit (its token is treated
    as padding inside the layers' own update, so no state-sized select is added). ``params`` as
    placed: bf16 or float32 weights, or on CPU ``pack_weights``' bits."""
    _check_tokens(token_B, 1, "token")
    _check_state(cfg, state, token_B.shape[0])
    lengths = None if live_B is None else live_B.astype(jnp.int32)
    logits, new_state, _ = _unrolled(cfg, params, token_B[:, None], state, lengths)
    return logits[:, 0], new_state


def _unrolled(
    cfg: ModelConfig, params: Params, tokens_BxT: Array, state: State, lengths_B: Array | None, trace: str = ""
) -> tuple[Array, State, tuple]:
    """The layers as an unrolled loop, each on its own state buffer (``decode_step``, ``verify``):
    (logits [B, T, V], the new state, per layer the ``trace`` collection it sowed, if one is named)."""
    with weights_in_own_buffers() if _is_unstacked(params) else contextlib.nullcontext(), model_target(tokens_BxT):
        return _unrolled_layers(cfg, params, tokens_BxT, state, lengths_B, trace)


def _unrolled_layers(
    cfg: ModelConfig, params: Params, tokens_BxT: Array, state: State, lengths_B: Array | None, trace: str
) -> tuple[Array, State, tuple]:
    model = GLALM(cfg)
    x = model.apply({"params": params}, tokens_BxT, method=GLALM.embed)
    new_state, traces = [], []
    unstacked = _is_unstacked(params)
    for layer, layer_state in enumerate(state):
        weights = layer_weights(cfg, params, layer)
        weights = _unpack(_as_declared(cfg, layer, weights) if unstacked else weights)
        block = Block(cfg, cfg.attn_spec(layer))
        out = block.apply(
            {"params": weights}, x, lengths_B, layer_state, method=Block.step, mutable=[trace] if trace else False
        )
        (x, layer_state), sowed = out if trace else (out, {})
        new_state.append(layer_state)
        traces.append(sowed[trace]["attn"] if trace else None)
    return model.apply({"params": params}, x, method=GLALM.head), tuple(new_state), tuple(traces)


def verify(
    cfg: ModelConfig, params: Params, tokens_BxN: Array, state: State, live_B: Array, keep: str = VERIFY_INPUTS
) -> tuple[Array, tuple]:
    """A speculative verify: N tokens per live row from ``state`` through the layers (unrolled, as
    ``decode_step``) -> (logits [B, N, V], the trace ``commit`` takes). ``keep``: what each GLA layer
    traces, its inputs (``VERIFY_INPUTS``: k, v and gates, [B, N, H, K] each) or its state after
    every position (``VERIFY_STATES``: N states per row); conv and attention layers trace their
    inputs. The state after all N tokens is not returned: ``commit`` with N emitted gives it."""
    _check_tokens(tokens_BxN, 2, "tokens")
    _check_state(cfg, state, tokens_BxN.shape[0])
    if keep not in TRACES:
        raise ValueError(f"keep must be one of {TRACES}; got {keep!r}")
    logits, _, traces = _unrolled(cfg, params, tokens_BxN, state, live_B.astype(jnp.int32) * tokens_BxN.shape[1], keep)
    return logits, traces


def commit(cfg: ModelConfig, state: State, trace: tuple, emitted_B: Array) -> State:
    """The state after the first emitted[b] tokens of a ``verify`` from ``state`` (0: as it was),
    without the weights: each GLA layer replays its traced inputs (``ops.gla.gla_replay``, the
    recurrence's own arithmetic) or takes its traced state at that position; the conv caches and
    attention rings keep their first emitted inputs."""

    def one(layer: int, old: LayerState, got: dict) -> LayerState:
        if cfg.attn_spec(layer) is not None:
            k, v = got["inputs"][0]
            return Attention.keep(old, k, v, old["pos"], emitted_B)
        if "states" in got:
            states = jnp.concatenate([old["gla"][:, None], got["states"][0]], axis=1)  # [B, N + 1, ..]
            new = {"gla": jnp.take_along_axis(states, emitted_B[:, None, None, None, None], axis=1)[:, 0]}
        else:
            new = {"gla": gla_replay(*got["inputs"][0], old["gla"], emitted_B)}
        for key, conv in CONV_CACHES.items():
            if key in old:
                new[key] = conv_cache(old[key], got[conv]["inputs"][0], emitted_B)
        return new

    return tuple(one(i, old, got) for i, (old, got) in enumerate(zip(state, trace, strict=True)))
