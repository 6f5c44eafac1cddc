"""The sampler's own layout of a Qwen3: one array per layer, weights in the compute dtype.

Training keeps the stacked `[L, ...]` parameters and the layer scan (`qwen3.forward`); that
is the layout of HF I/O, LoRA targets, sharding rules and checkpoints. A decode step reads
every weight once per token, and a scan over stacked arrays made XLA:GPU copy each layer's
weights (and its KV cache) out of the stack before reading them: about as many bytes written
per step as read (docs/results/gpu-compile.md). Here each layer's weights and cache are arrays
of their own, the layers are unrolled, and weights are cast to the compute dtype once per
policy version (`decode_params`), not on every step from float32 masters.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from mgrpo_jax.models import qwen3
from mgrpo_jax.models.config import Qwen3Config


@flax.struct.dataclass
class DecodeParams:
  """Weights for sampling: `layers[i]` is layer i's Block state (its own arrays)."""

  embed_VxD: jax.Array
  head_DxV: jax.Array | None  # None when the head is tied to the embedding.
  final_norm: jax.Array
  layers: tuple


@flax.struct.dataclass
class LayerCache:
  """Keys and values, one array per layer; slot s of row b holds position s.

  Keys are stored [B, K, H, S] (slots minor), values [B, K, S, H]: each as the attention's
  matmul reads it (q k^T and p v), so no step transposes or copies them. With
  attention="ragged" keys are stored as values, [B, K, S, H], as the Pallas decode kernel
  reads them (`key_slot_axis`).
  """

  k: tuple  # L x [B, K, H, S]
  v: tuple  # L x [B, K, S, H]

  @property
  def max_len(self) -> int:
    return self.v[0].shape[2]


def key_slot_axis(config: Qwen3Config) -> int:
  """The slot axis of a layer's cached keys: 3 ([B, K, H, S]), or 2 ([B, K, S, H]) for
  attention="ragged" (the axis a cache grows along)."""
  return 2 if config.attention == "ragged" else 3


def init_cache(config: Qwen3Config, batch: int, max_len: int, dtype=None) -> LayerCache:
  """An empty per-layer cache for `batch` rows of up to `max_len` positions."""
  b, k, s, h = batch, config.num_kv_heads, max_len, config.head_dim
  dtype = dtype or config.compute_jnp_dtype
  zeros = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  keys = (b, k, s, h) if key_slot_axis(config) == 2 else (b, k, h, s)
  return LayerCache(zeros(keys), zeros((b, k, s, h)))


def pad_cache(config: Qwen3Config, cache: LayerCache, length: int) -> LayerCache:
  """`cache` grown to `length` slots per row (new slots hold zeros), along the slot axis of
  the config's layout (`key_slot_axis`)."""
  more = length - cache.max_len
  pad = lambda x, axis: jnp.pad(x, [(0, more if a == axis else 0) for a in range(x.ndim)])
  return LayerCache(tuple(pad(x, key_slot_axis(config)) for x in cache.k),
                    tuple(pad(x, 2) for x in cache.v))


def _restructure(config: Qwen3Config, params, layer_leaf, other_leaf) -> DecodeParams:
  """DecodeParams from a stacked parameter tree (arrays, shardings or shapes): layer i of a
  stack is `layer_leaf(leaf, index in its stack)`, any other leaf `other_leaf(leaf)`."""
  stacks = {k: params[name] if name in params else None
            for k, name in ((False, "layers"), (True, "moe_layers"))}
  leaf = lambda tree: other_leaf(jax.tree.leaves(tree)[0])  # The array inside its Variable.
  seen, layers = {False: 0, True: 0}, []
  for sparse in config.sparse_layers():
    i = seen[sparse]
    layers.append(jax.tree.map(lambda a, i=i: layer_leaf(a, i), stacks[sparse]))
    seen[sparse] += 1
  head = None if config.tie_embeddings else leaf(params["lm_head"])
  return DecodeParams(leaf(params["embed"]), head, leaf(params["final_norm"]["scale"]),
                      tuple(layers))


def _cast(config: Qwen3Config, a):
  # Everything the forward reads is cast to the compute dtype there (`.astype(dt)`, routers
  # and LoRA factors included): casting once here gives the same numbers.
  return a.astype(config.compute_jnp_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a


@functools.partial(jax.jit, static_argnums=0)
def decode_params(config: Qwen3Config, params: nnx.State) -> DecodeParams:
  """The sampler's weights from the training parameters (one jitted copy per policy
  version): per-layer arrays in the compute dtype. Floats of 32 bits stay the masters."""
  return _restructure(config, params, lambda a, i: _cast(config, a[i]),
                      lambda a: _cast(config, a))


def shardings(config: Qwen3Config, param_shardings: nnx.State) -> DecodeParams:
  """The NamedShardings of `decode_params`' output, from those of the stacked parameters
  (`sharding.param_shardings`): a layer's arrays keep their spec minus the layer axis."""
  drop = lambda s, i: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
  return _restructure(config, param_shardings, drop, lambda s: s)


def cache_shardings(config: Qwen3Config, stacked: jax.sharding.NamedSharding) -> LayerCache:
  """Per-layer cache shardings from the stacked cache's (`sharding.cache_sharding`)."""
  one = jax.sharding.NamedSharding(stacked.mesh, jax.sharding.PartitionSpec(*stacked.spec[1:]))
  return LayerCache((one,) * config.num_layers, (one,) * config.num_layers)


@functools.lru_cache(maxsize=64)
def _block_graphdefs(config: Qwen3Config) -> dict:
  """{sparse: the NNX graph definition of one Block of that kind} (no params allocated)."""
  model = nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0, lora=1)))
  out = {}
  for sparse, name in ((False, "layers"), (True, "moe_layers")):
    if hasattr(model, name):
      out[sparse] = nnx.split(getattr(model, name))[0]
  return out


def forward(config: Qwen3Config, params: DecodeParams, tokens_BxT, positions_BxT,
            cache: LayerCache, *, logits_idx_B=None, attn_window: int | None = None,
            rope_offset_B=None, prefix=None):
  """Cached forward over the per-layer layout: (float32 logits, cache, `qwen3.Routing`).

  The same computation as `qwen3.forward` with a cache (see there for positions, windows and
  `logits_idx_B`), with the layers unrolled: each layer's weights and cache are read where
  they lie and its new keys and values written into its own (donated) cache arrays.

  `positions_BxT` are cache indices; a row's RoPE positions are those plus its
  `rope_offset_B` (the length of a prefix it reads from elsewhere; default 0). `prefix` =
  (pool: LayerCache, pool_len_P, members_PxM, pool_row_B): a decode step (T = 1) attends to
  row b's pool row and its own cache (`prefix_attention.decode`).
  """
  dt = config.compute_jnp_dtype
  b = tokens_BxT.shape[0]
  x = qwen3.rows_sharded(jnp.take(params.embed_VxD, tokens_BxT, axis=0).astype(dt))
  rope_BxT = positions_BxT if rope_offset_B is None else positions_BxT + rope_offset_B[:, None]
  sin, cos = qwen3.rope_sin_cos(rope_BxT, config.head_dim, config.rope_theta)
  key_mask_BxS = jnp.ones((b, cache.max_len), bool)
  token_w = jnp.ones(tokens_BxT.shape, bool)
  window = attn_window or cache.max_len
  graphdefs = _block_graphdefs(config)
  ks, vs, routed = [], [], []
  for i, sparse in enumerate(config.sparse_layers()):
    block = nnx.merge(graphdefs[sparse], params.layers[i])
    kv = (cache.k[i], cache.v[i], None, window)
    if prefix is not None:
      pool, *rest = prefix
      kv += ((pool.k[i], pool.v[i], *rest),)
    x, (k, v), r = block(x, sin, cos, positions_BxT, key_mask_BxS, kv, None, token_w, None)
    x = qwen3.rows_sharded(x)
    ks.append(k)
    vs.append(v)
    if sparse:
      routed.append(r)
  # One [L, ...] Routed, as the scan over the sparse layers returns it.
  routed = [jax.tree.map(lambda *a: jnp.stack(a), *routed)] if routed else []
  routing = qwen3.routing_of(routed, tokens_BxT.shape)
  if logits_idx_B is not None:
    x = jnp.take_along_axis(x, logits_idx_B[:, None, None], axis=1)
  x = qwen3.rms_norm(x, params.final_norm, config.rms_norm_eps)
  if params.head_DxV is None:
    logits = jnp.einsum("btd,vd->btv", x, params.embed_VxD.astype(dt),
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", x, params.head_DxV.astype(dt),
                        preferred_element_type=jnp.float32)
  return logits, LayerCache(tuple(ks), tuple(vs)), routing
