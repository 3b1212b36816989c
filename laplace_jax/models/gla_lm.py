"""The GLA language model and its three entry points: forward, prefill, decode step.

    forward(cfg, params, tokens [B, T])              -> logits [B, T, V] fp32
    prefill(cfg, params, tokens [B, T], state=None)  -> (logits [B, T, V], state)
    decode_step(cfg, params, token [B], state)       -> (logits [B, V], state)

All three share one parameter tree. Layers are stacked on a leading axis of size n_layers and
run with ``nn.scan`` (compile time flat in depth), optionally rematerialised. The per-sequence
state is a dict of stacked arrays: ``gla`` [L, B, H, dk, dv] float32 and, with short conv,
``conv_q`` / ``conv_k`` / ``conv_v`` [L, B, W, channels] in the compute dtype. The stack rides
in the scan's carry and each layer updates its own slice in place (dynamic-update-slice), so a
donated state is read and written once per step with no state-sized copy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from laplace_jax.config import REMAT_POLICIES, ModelConfig
from laplace_jax.layers.common import Embedding, Linear, RMSNorm, SwiGLU
from laplace_jax.layers.gla import GatedLinearAttention
from laplace_jax.parallel import constrain

Array = jax.Array
Params = dict

State = dict[str, Array]


def pack_weights(params: Params) -> Params:
    """bf16 layer weights as their uint16 bits: the form in which XLA:CPU runs ``prefill`` and
    ``decode_step`` without a weight-sized copy. A CPU workaround: pack once where the weights
    are placed on CPU devices (serving does); other backends take the bf16 weights as they are.

    XLA:CPU widens a bf16 array that is sliced inside a loop to f32 as a whole, and the
    widening of the loop-invariant stack is hoisted out of the layer loop: an f32 copy of every
    layer's weights at once (10.7 GiB of temporaries for the 3B decode step at W=256). Integer
    bits are never widened; the model turns each layer's slice back into bf16 inside the loop.
    A bitcast inside the jitted step would not help: it materialises a copy of its own (on the
    TPU compiler, a weight-sized temporary and 44% of the 3B decode step's estimate)."""
    to_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x  # noqa: E731
    return {**params, "layers": jax.tree.map(to_bits, params["layers"])}


def _is_packed(params: Params) -> bool:
    return any(x.dtype == jnp.uint16 for x in jax.tree.leaves(params["layers"]))


def _unpack(variables: dict) -> dict:
    """One layer's weights with uint16 bits (``pack_weights``) turned back into bf16."""
    return jax.tree.map(
        lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x, variables
    )


class Block(nn.Module):
    """Pre-norm block: x += GLA(RMSNorm(x)); x += SwiGLU(RMSNorm(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, carry: tuple[Array, Array | None, State | None], layer: Array) -> tuple[tuple, None]:
        """carry: (x [B, T, D], lengths [B] or None, the whole state stack or None); layer: this layer's index."""
        x_BxTxD, lengths_B, stack = carry
        cfg = self.cfg
        dt = cfg.compute_dtype
        x_BxTxD = constrain(x_BxTxD, ("batch", "length", "act_embed"))
        state = (
            None if stack is None else jax.tree.map(lambda s: jax.lax.dynamic_index_in_dim(s, layer, 0, False), stack)
        )
        attn = GatedLinearAttention(cfg, name="attn")
        h, state = attn(RMSNorm(cfg.norm_eps, dt, name="attn_norm")(x_BxTxD), state, lengths_B)
        if stack is not None:
            stack = jax.tree.map(lambda s, n: jax.lax.dynamic_update_index_in_dim(s, n, layer, 0), stack, state)
        x_BxTxD = x_BxTxD + h
        mlp = SwiGLU(cfg.intermediate_size, dtype=dt, init_std=cfg.init_std, name="mlp")
        x_BxTxD = x_BxTxD + mlp(RMSNorm(cfg.norm_eps, dt, name="mlp_norm")(x_BxTxD))
        return (x_BxTxD, lengths_B, stack), None


class GLALM(nn.Module):
    """Embeddings -> n_layers scanned blocks -> RMSNorm -> LM head (untied unless tie_embeddings)."""

    cfg: ModelConfig
    packed: bool = False  # bf16 layer weights passed as uint16 bits (``pack_weights``)

    @nn.compact
    def __call__(
        self, tokens_BxT: Array, state: State | None, lengths_B: Array | None = None
    ) -> tuple[Array, State | None]:
        cfg = self.cfg
        dt = cfg.compute_dtype
        table_VxD = Embedding(cfg.vocab_size, cfg.d_model, dt, cfg.init_std, name="embeddings")()
        x = constrain(jnp.take(table_VxD, tokens_BxT, axis=0), ("batch", "length", "act_embed"))
        block = Block if cfg.remat == "none" else nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat])
        if self.packed:  # bf16 layer weights arrive as uint16 bits (pack_weights): one layer unpacked at a time
            block = nn.map_variables(block, "params", trans_in_fn=_unpack)
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=0,
            out_axes=0,
            length=cfg.n_layers,
            unroll=1 if cfg.scan_layers else cfg.n_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        (x, _, state), _ = stack(cfg, name="layers")((x, lengths_B, state), jnp.arange(cfg.n_layers))
        x = RMSNorm(cfg.norm_eps, dt, name="norm")(x)
        if cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, table_VxD, preferred_element_type=jnp.float32)
        else:
            head = Linear(
                cfg.vocab_size, ("embed", "vocab"), dtype=dt, init_std=cfg.init_std, fp32_out=True, name="lm_head"
            )
            logits = head(x)
        logits = constrain(logits, ("batch", "length", "act_vocab"))
        return logits.astype(jnp.float32), state


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
    """A zero per-sequence state for ``batch`` sequences (see module docstring for the layout)."""
    L = cfg.n_layers
    state = {"gla": jnp.zeros((L, batch, cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim), jnp.float32)}
    if cfg.use_short_conv:
        W, G, dt = cfg.conv_size, cfg.kv_groups, cfg.compute_dtype
        state["conv_q"] = jnp.zeros((L, batch, W, cfg.key_dim), dt)
        state["conv_k"] = jnp.zeros((L, batch, W, cfg.key_dim // G), dt)
        state["conv_v"] = jnp.zeros((L, batch, W, cfg.value_dim // G), dt)
    return state


def _check_state(cfg: ModelConfig, state: State, batch: int) -> None:
    want = jax.eval_shape(lambda: init_state(cfg, batch))
    if set(state) != set(want):
        raise ValueError(f"state must have keys {sorted(want)}; got {sorted(state)}")
    for key, ref in want.items():
        if tuple(state[key].shape) != ref.shape:
            raise ValueError(
                f"state[{key!r}] must have shape {ref.shape} for batch {batch}; got {tuple(state[key].shape)}"
            )


def forward(cfg: ModelConfig, params: Params, tokens_BxT: Array) -> Array:
    """Training / scoring forward pass: logits [B, T, V] float32 from a zero state."""
    _check_tokens(tokens_BxT, 2, "tokens")
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
    return GLALM(cfg, _is_packed(params)).apply({"params": params}, tokens_BxT, state, lengths_B)


def decode_step(
    cfg: ModelConfig, params: Params, token_B: Array, state: State, live_B: Array | None = None
) -> tuple[Array, State]:
    """Advance every sequence by one token with the recurrent step: (logits [B, V], state).

    ``live_B`` (bool): a row where it is False keeps its state bit for bit (its token is treated
    as padding inside the layers' own update, so no state-sized select is added). ``params`` as
    placed: bf16 or float32 weights, or on CPU ``pack_weights``' bits."""
    _check_tokens(token_B, 1, "token")
    _check_state(cfg, state, token_B.shape[0])
    lengths = None if live_B is None else live_B.astype(jnp.int32)
    logits, state = GLALM(cfg, _is_packed(params)).apply({"params": params}, token_B[:, None], state, lengths)
    return logits[:, 0], state
