"""Qwen3 decoder (dense, or mixture-of-experts) in Flax NNX, layers run under `jax.lax.scan`.

The NNX modules define the parameters; the public entry points are pure
functions of `(config, params, ...)` that merge the cached graph definition
with the parameter state inside whatever jitted function calls them.

Dense layers are stacked in `layers`, sparse (MoE) layers in `moe_layers`; the forward runs
each maximal run of consecutive layers of one kind as one scan (a Qwen3-MoE release is one
run of sparse layers, a dense Qwen3 one run of dense layers).
"""

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from mgrpo_jax.models import attention
from mgrpo_jax.models import moe
from mgrpo_jax.models import prefix_attention
from mgrpo_jax.models import ragged_attention
from mgrpo_jax.models.config import Qwen3Config


# What a remat'd layer keeps for the backward pass (Qwen3Config.remat_policy): nothing (all
# of the layer is recomputed), or the outputs of its weight matmuls ("save_dots": the
# projections are not recomputed; attention scores, a batched dot, still are).
_REMAT_POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable,
                   "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer; slot s of row b holds position s of row b."""

  k_LxBxKxSxH: jax.Array
  v_LxBxKxSxH: jax.Array

  @property
  def max_len(self) -> int:
    return self.k_LxBxKxSxH.shape[3]


def init_cache(config: Qwen3Config, batch: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache for `batch` rows of up to `max_len` positions."""
  shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
  dtype = dtype or config.compute_jnp_dtype
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _normal(std):
  return nnx.initializers.normal(stddev=std)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis, computed in float32 (as HF Qwen3 does)."""

  def __init__(self, dim: int, eps: float, *, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x, scale, eps: float):
  """RMSNorm of `x` over its last axis in float32, scaled by `scale`, in x's dtype."""
  dtype = x.dtype
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale.astype(dtype) * x32.astype(dtype)


def rope_sin_cos(positions_BxT, head_dim: int, theta: float):
  """Rotary angles for each position, in float32: two [B, T, head_dim/2] arrays."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  return jnp.sin(angles), jnp.cos(angles)


def _apply_rope(x_BxNxTxH, sin_BxTxH2, cos_BxTxH2):
  # HF's rotate_half convention: the two halves of the head dim form the pairs.
  x1, x2 = jnp.split(x_BxNxTxH, 2, axis=-1)
  sin = sin_BxTxH2[:, None].astype(x_BxNxTxH.dtype)
  cos = cos_BxTxH2[:, None].astype(x_BxNxTxH.dtype)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rows_sharded(x):
  """Pins an activation's leading (row) axis to the mesh's batch axes, when a mesh is set.

  Under `jax.set_mesh(mesh)` (the train step sets it) this keeps activations split by rows,
  so each layer all-gathers its fsdp-sharded weights (FSDP) instead of XLA sharding the
  activations along the hidden axis and holding every row of the batch on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in ("data", "fsdp", "expert") if a in mesh.axis_names)
  if mesh.empty or not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
    # Rows that do not split evenly are left to XLA: an uneven row sharding pinned here
    # made XLA:CPU's collectives deadlock (micro-batches of 4 rows on 8 devices).
    return x
  return jax.lax.with_sharding_constraint(
      x, jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1))))


def _add_adapters(module, cfg: Qwen3Config, shapes: dict, rngs: nnx.Rngs):
  """LoRA factors `<name>_lora_a` [*in, r] and `<name>_lora_b` [r, *out] of the targeted
  projections in `shapes` ({name: (hf name, in dims, out dims)}).

  A is uniform(+-1/sqrt(fan_in)) and B zero, as PEFT initialises them, so a fresh adapter
  changes nothing. Float32 whatever the base's dtype (the trained master weights, as PEFT's
  default); drawn from the `lora` stream, so the base weights of a key do not change.
  """
  r = cfg.lora_rank
  for name, (hf_name, in_dims, out_dims) in shapes.items():
    if r and hf_name in cfg.lora_targets:
      bound = 1.0 / math.sqrt(math.prod(in_dims))
      a = jax.random.uniform(rngs.lora(), (*in_dims, r), jnp.float32, -bound, bound)
      setattr(module, f"{name}_lora_a", nnx.LoRAParam(a))
      setattr(module, f"{name}_lora_b", nnx.LoRAParam(jnp.zeros((r, *out_dims), jnp.float32)))


def _adapted(module, name: str, y, x, eq_a: str, eq_b: str, a_shape=None, b_shape=None):
  """`y` (the projection of `x`) plus its adapter's (x A) B * alpha/r, when it has one.

  Computed on the fly from the two thin factors: the merged weight never exists, in the
  sampler or in the train step, and the gradient reaches only A and B.
  """
  if not hasattr(module, f"{name}_lora_a"):  # Structure, fixed at setup: no traced branch.
    return y
  cfg = module.cfg
  a = getattr(module, f"{name}_lora_a")[...].astype(x.dtype)
  b = getattr(module, f"{name}_lora_b")[...].astype(x.dtype)
  a = a if a_shape is None else a.reshape(a_shape)
  b = b if b_shape is None else b.reshape(b_shape)
  delta = jnp.einsum(eq_b, jnp.einsum(eq_a, x, a), b)
  return y + (delta * (cfg.lora_alpha / cfg.lora_rank)).astype(y.dtype)


def _write_rows(cache_BxKxSxH, new_BxKxTxH, start_B, axis: int = 2):
  """Writes row b's T new slots at start_b.. (contiguous positions); slots past S are dropped.

  The slots lie along `axis` (2, or 3 for keys stored [B, K, H, S]) of cache and news.

  A dynamic_update_slice per row (not a scatter) so XLA updates the cache in place inside
  the layer scan; a scatter there costs two extra copies of the whole cache (measured with
  compiled.memory_analysis on CPU). dynamic_update_slice clamps a start that runs past the
  end, so such a row rewrites the clamped window with its old slots plus its in-range news.
  """
  s, t = cache_BxKxSxH.shape[axis], new_BxKxTxH.shape[axis]
  if t > s:
    raise ValueError(f"Cannot write {t} positions per row into a cache of {s} slots.")
  if t == 1:
    # Decode: one scatter of one slot per row, in place; a slot past the end is dropped.
    # (The per-row update below would add a gather, a roll and a select per layer and step.)
    # Indexed by (row, head, slot) together: the scatter's indexed dims are then the leading
    # ones as stored, so XLA:GPU writes in place without transposing the cache around it.
    b, k = cache_BxKxSxH.shape[:2]
    rows, heads = jnp.arange(b)[:, None], jnp.arange(k)[None, :]
    at = ((rows, heads, start_B[:, None]) if axis == 2 else
          (rows, heads, slice(None), start_B[:, None]))
    new = jnp.take(new_BxKxTxH, 0, axis=axis).astype(cache_BxKxSxH.dtype)
    if cache_BxKxSxH.dtype.itemsize != 2:
      return cache_BxKxSxH.at[at].set(new, mode="drop")
    # A 16-bit float cache is scattered as its bits: XLA:CPU scatters bf16 by converting
    # the whole cache to float32 and back (GBs of temporaries); integers it does in place.
    bits = lambda x, dt: jax.lax.bitcast_convert_type(x, dt)
    out = bits(cache_BxKxSxH, jnp.uint16).at[at].set(bits(new, jnp.uint16), mode="drop")
    return bits(out, cache_BxKxSxH.dtype)

  def row(c_KxSxH, n_KxTxH, p):
    at = jnp.minimum(p, s - t)
    shift = p - at  # > 0 only for a write that runs past the last slot.
    old = jax.lax.dynamic_slice_in_dim(c_KxSxH, at, t, axis=axis - 1)
    keep_new = jnp.expand_dims(jnp.arange(t) >= shift, [a for a in range(3) if a != axis - 1])
    merged = jnp.where(keep_new, jnp.roll(n_KxTxH, shift, axis=axis - 1), old)
    return jax.lax.dynamic_update_slice_in_dim(c_KxSxH, merged, at, axis=axis - 1)

  return jax.vmap(row)(cache_BxKxSxH, new_BxKxTxH, start_B)


class Attention(nnx.Module):
  """Grouped-query attention with per-head q/k RMSNorm and RoPE.

  Heads come before time ([B, K, T, H]) in every activation and in the cache, so the
  attention matmuls need no transposes of the (large) cache at decode time.
  """

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd, init = cfg.param_jnp_dtype, _normal(0.02)
    self.cfg = cfg
    self.q = nnx.Param(init(rngs.params(), (d, h, dh), pd))
    self.k = nnx.Param(init(rngs.params(), (d, k, dh), pd))
    self.v = nnx.Param(init(rngs.params(), (d, k, dh), pd))
    self.o = nnx.Param(init(rngs.params(), (h, dh, d), pd))
    self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, param_dtype=pd)
    self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, param_dtype=pd)
    _add_adapters(self, cfg, {"q": ("q_proj", (d,), (h, dh)), "k": ("k_proj", (d,), (k, dh)),
                              "v": ("v_proj", (d,), (k, dh)), "o": ("o_proj", (h, dh), (d,))},
                  rngs)

  def __call__(self, x_BxTxD, sin, cos, positions_BxT, key_mask_BxS, cache_kv=None,
               segment_ids_BxT=None):
    """Returns the attention output and, with a cache, the updated (k, v) of all layers.

    `cache_kv = (k_LxBxKxSxH, v_LxBxKxSxH, layer, window)`: this layer's new keys and values
    are written at their positions first, then the queries attend to the first `window`
    slots of the cache row (the caller guarantees no position reaches past it). With
    `layer=None` the two arrays are this layer's own, keys [B, K, H, S] and values
    [B, K, S, H] (the sampler's layout, `models/decode.py`), and so are the ones returned;
    a fifth element, the pool of a shared prefix (`decode.forward`'s `prefix`), makes a
    decode step attend to each row's pool row before its own slots.
    Without a cache, query t sits in slot t (causality follows slots, so RoPE positions may
    restart inside a packed row) and `segment_ids_BxT` keeps packed sequences apart.
    """
    cfg, dt = self.cfg, x_BxTxD.dtype
    b, t, _ = x_BxTxD.shape
    kv, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    q = self.q[...].astype(dt).reshape(-1, kv, g, cfg.head_dim)
    q = jnp.einsum("btd,dkgh->bkgth", x_BxTxD, q)
    q = self.q_norm(_adapted(self, "q", q, x_BxTxD, "btd,dr->btr", "btr,rkgh->bkgth",
                             b_shape=(-1, kv, g, cfg.head_dim)))
    k = jnp.einsum("btd,dkh->bkth", x_BxTxD, self.k[...].astype(dt))
    k = self.k_norm(_adapted(self, "k", k, x_BxTxD, "btd,dr->btr", "btr,rkh->bkth"))
    v = jnp.einsum("btd,dkh->bkth", x_BxTxD, self.v[...].astype(dt))
    v = _adapted(self, "v", v, x_BxTxD, "btd,dr->btr", "btr,rkh->bkth")
    q = _apply_rope(q.reshape(b, kv * g, t, -1), sin, cos).reshape(q.shape)
    k = _apply_rope(k, sin, cos)
    new_cache, out = None, None
    q_idx_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
    if cache_kv is not None:
      ck, cv, layer, window = cache_kv[:4]
      # A shared prefix (`decode.forward`'s `prefix`): the pool's keys and values of this
      # layer, the rows' lengths, members and each row's pool row.
      prefix = cache_kv[4] if len(cache_kv) > 4 else None
      # Per-row positions: each row writes where it is; out-of-range writes are dropped.
      start_B = positions_BxT[:, 0]
      if layer is None and cfg.attention == "ragged":
        # A layer's own arrays, keys as values, [B, K, S, H]: the ragged kernel's layout.
        ck_l = _write_rows(ck, k.astype(ck.dtype), start_B)
        cv_l = _write_rows(cv, v.astype(cv.dtype), start_B)
        new_cache = (ck_l, cv_l)
        if t == 1 and prefix is not None:
          out = prefix_attention.decode(q, ck_l.astype(dt), cv_l.astype(dt), positions_BxT,
                                        *prefix, window=window, key_axis=2,
                                        splits=cfg.decode_splits or ragged_attention.SPLITS)
        elif t == 1:
          # The whole cache goes in: each row is read to its own length, not to the window
          # (a slice of the cache would be copied before the kernel reads it).
          out = ragged_attention.decode(q, ck_l.astype(dt), cv_l.astype(dt), positions_BxT,
                                        window=window,
                                        splits=cfg.decode_splits or ragged_attention.SPLITS)
      elif layer is None:
        # A layer's own arrays, keys as [B, K, H, S]: the layout the scores' matmul reads
        # (slots minor), so XLA keeps the cache as it is and writes it in place.
        ck_l = _write_rows(ck, jnp.swapaxes(k, 2, 3).astype(ck.dtype), start_B, axis=3)
        cv_l = _write_rows(cv, v.astype(cv.dtype), start_B)
        new_cache = (ck_l, cv_l)
        if t == 1 and prefix is not None:
          out = prefix_attention.decode(q, ck_l[..., :window].astype(dt),
                                        cv_l[:, :, :window].astype(dt), positions_BxT,
                                        *prefix, window=window, key_axis=3)
        ck_l = jnp.swapaxes(ck_l, 2, 3)  # Folded into the matmul's dimensions, not copied.
      else:
        ck_l = _write_rows(ck[layer], k.astype(ck.dtype), start_B)
        cv_l = _write_rows(cv[layer], v.astype(cv.dtype), start_B)
        new_cache = (jax.lax.dynamic_update_index_in_dim(ck, ck_l, layer, 0),
                     jax.lax.dynamic_update_index_in_dim(cv, cv_l, layer, 0))
      # Decode is bound by reading the cache: read only the slots in use (static window).
      k, v = ck_l[:, :, :window].astype(dt), cv_l[:, :, :window].astype(dt)
      key_mask_BxS = key_mask_BxS[:, :window]
      q_idx_BxT = positions_BxT  # A cached token's slot is its position.
    if out is None:
      out = attention.attend(q, k, v, q_idx_BxT=q_idx_BxT, kv_valid_BxS=key_mask_BxS,
                             q_seg_BxT=segment_ids_BxT, kv_seg_BxS=segment_ids_BxT,
                             impl=cfg.attention, cached=cache_kv is not None,
                             block=cfg.attention_block, decode_splits=cfg.decode_splits,
                             max_segments=cfg.attention_max_segments)
    if cache_kv is not None and cache_kv[2] is None:
      # Sampler: heads to the minor axes, then one [B*T, N*H] x [N*H, D] matmul, the weight
      # read as stored (contracting (k, g, h) in place made XLA:GPU transpose it every step).
      out_BxTxNH = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, -1)
      y = out_BxTxNH @ self.o[...].astype(dt).reshape(-1, cfg.hidden_size)
    else:
      o = self.o[...].astype(dt).reshape(kv, g, cfg.head_dim, -1)
      y = jnp.einsum("bkgth,kghd->btd", out, o)
    return _adapted(self, "o", y, out, "bkgth,kghr->btr", "btr,rd->btd",
                    a_shape=(kv, g, cfg.head_dim, -1)), new_cache


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    d, f, pd, init = cfg.hidden_size, cfg.intermediate_size, cfg.param_jnp_dtype, _normal(0.02)
    self.cfg = cfg
    self.gate = nnx.Param(init(rngs.params(), (d, f), pd))
    self.up = nnx.Param(init(rngs.params(), (d, f), pd))
    self.down = nnx.Param(init(rngs.params(), (f, d), pd))
    _add_adapters(self, cfg, {"gate": ("gate_proj", (d,), (f,)), "up": ("up_proj", (d,), (f,)),
                              "down": ("down_proj", (f,), (d,))}, rngs)

  def __call__(self, x_BxTxD):
    dt = x_BxTxD.dtype
    proj = lambda name, x: _adapted(self, name, x @ getattr(self, name)[...].astype(dt), x,
                                    "btd,dr->btr", "btr,rf->btf")
    return proj("down", jax.nn.silu(proj("gate", x_BxTxD)) * proj("up", x_BxTxD))


class Block(nnx.Module):
  """Pre-norm decoder layer: attention, then the SwiGLU `mlp` or (sparse) the `moe` block."""

  def __init__(self, cfg: Qwen3Config, *, sparse: bool = False, rngs: nnx.Rngs):
    pd = cfg.param_jnp_dtype
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
    if sparse:
      self.moe = moe.MoE(cfg, rngs=rngs)
    else:
      self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, sin, cos, positions, key_mask, cache_kv=None, segment_ids=None,
               token_w=None, experts=None):
    """(x, updated cache, Routed of a sparse layer or None)."""
    h, new_cache = self.attn(self.attn_norm(x), sin, cos, positions, key_mask, cache_kv,
                             segment_ids)
    x = x + h
    if hasattr(self, "moe"):
      y, routed = self.moe(self.mlp_norm(x), token_w, experts)
      return x + y, new_cache, routed
    return x + self.mlp(self.mlp_norm(x)), new_cache, None


@flax.struct.dataclass
class Routing:
  """The experts every sparse layer chose, and the router's load-balancing loss.

  `experts_LxBxTxK` (L = sparse layers, in layer order) can be fed back to the forward
  (routing replay); `aux_loss` is transformers' `load_balancing_loss_func` over all sparse
  layers and real tokens (0 for a dense model).
  """

  experts_LxBxTxK: jax.Array
  aux_loss: jax.Array


def _layer_runs(cfg: Qwen3Config):
  """[(sparse, first index in its stack, count, first layer)] of consecutive same-kind layers."""
  runs, seen = [], {False: 0, True: 0}
  for i, sparse in enumerate(cfg.sparse_layers()):
    if runs and runs[-1][0] == sparse:
      runs[-1][2] += 1
    else:
      runs.append([sparse, seen[sparse], 1, i])
    seen[sparse] += 1
  return [tuple(r) for r in runs]


class Qwen3(nnx.Module):
  """The causal LM. `layers` (dense) and `moe_layers` (sparse) each hold one Block whose
  params are stacked on axis 0; a stack with no layers is absent."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    pd = cfg.param_jnp_dtype
    self.cfg = cfg
    self.embed = nnx.Param(_normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd))

    def make_layers(n, sparse):
      @nnx.split_rngs(splits=n)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(cfg, sparse=sparse, rngs=rngs)
      return make(rngs)

    num_sparse = sum(cfg.sparse_layers())
    if num_sparse < cfg.num_layers:
      self.layers = make_layers(cfg.num_layers - num_sparse, False)
    if num_sparse:
      self.moe_layers = make_layers(num_sparse, True)
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Param(_normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), pd))

  def __call__(self, tokens_BxT, positions_BxT, key_mask_BxS, cache: KVCache | None = None,
               logits_idx_B=None, attn_window: int | None = None, segment_ids_BxT=None,
               return_hidden: bool = False, experts_LxBxTxK=None):
    """(logits or hidden, cache or None, Routing)."""
    cfg = self.cfg
    dt = cfg.compute_jnp_dtype
    x = rows_sharded(jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dt))
    sin, cos = rope_sin_cos(positions_BxT, cfg.head_dim, cfg.rope_theta)
    # Tokens the load-balancing loss counts: real ones (transformers: the attention mask).
    token_w = jnp.ones(tokens_BxT.shape, bool) if cache is not None else key_mask_BxS
    if segment_ids_BxT is not None:
      token_w = token_w & (segment_ids_BxT > 0)
    window = attn_window or (None if cache is None else cache.max_len)

    def body(graphdef, carry, xs):
      x, kv = carry
      state_l, layer, experts = xs
      block = nnx.merge(graphdef, state_l)
      x, kv, routed = block(x, sin, cos, positions_BxT, key_mask_BxS,
                            None if kv is None else (*kv, layer, window), segment_ids_BxT,
                            token_w, experts)
      return (rows_sharded(x), kv), routed

    # The cache rides in the scan carry (not xs/ys) so XLA can update it in place.
    kv = None if cache is None else (cache.k_LxBxKxSxH, cache.v_LxBxKxSxH)
    routed = []
    for sparse, start, count, first in _layer_runs(cfg):
      graphdef, state = nnx.split(self.moe_layers if sparse else self.layers)
      if count < jax.tree.leaves(state)[0].shape[0]:  # A run of a mixed stack.
        state = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, start, start + count), state)
      given = None
      if sparse and experts_LxBxTxK is not None:
        given = jax.lax.slice_in_dim(experts_LxBxTxK, start, start + count)
      run = functools.partial(body, graphdef)
      if cfg.remat:
        run = jax.checkpoint(run, prevent_cse=False, policy=_REMAT_POLICIES[cfg.remat_policy])
      (x, kv), ys = jax.lax.scan(run, (x, kv), (state, first + jnp.arange(count), given))
      if sparse:
        routed.append(ys)
    routing = routing_of(routed, tokens_BxT.shape)
    if logits_idx_B is not None:
      # Only one position per row needs logits (prefill): skip the [B, T, V] projection.
      x = jnp.take_along_axis(x, logits_idx_B[:, None, None], axis=1)
    x = self.final_norm(x)
    if return_hidden:
      # The caller applies the head itself, in chunks (never [B, T, V] at once).
      return x, (None if kv is None else KVCache(*kv)), routing
    logits = jnp.einsum("btd,dv->btv", x, self.head().astype(dt),
                        preferred_element_type=jnp.float32)
    return logits, (None if kv is None else KVCache(*kv)), routing

  def head(self):
    """The [D, V] output projection (the embedding's transpose when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]


def routing_of(routed: list, shape_BxT) -> Routing:
  """Routing of the sparse runs' scan outputs (per-layer Routed stacked on axis 0)."""
  if not routed:
    return Routing(jnp.zeros((0, *shape_BxT, 0), jnp.int32), jnp.zeros((), jnp.float32))
  cat = lambda name: jnp.concatenate([getattr(r, name) for r in routed], axis=0)
  return Routing(cat("experts_BxTxK"),
                 moe.load_balancing_loss(cat("counts_E"), cat("probs_E"), cat("rows")))


@functools.lru_cache(maxsize=64)
def graphdef(config: Qwen3Config) -> nnx.GraphDef:
  """The (cached) NNX graph definition of a config, built without allocating params."""
  gdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
  return gdef


@functools.lru_cache(maxsize=16)
def _init_fn(config: Qwen3Config, mesh):
  """The jitted initialiser of a config (cached, so a second model compiles nothing)."""
  def init(key):
    # LoRA factors (if the config has them) draw from their own stream: the base weights of
    # a key are the same with or without adapters.
    rngs = nnx.Rngs(params=key, lora=jax.random.fold_in(key, 1))
    return nnx.split(Qwen3(config, rngs=rngs))[1]

  out_shardings = None
  if mesh is not None:
    from mgrpo_jax import sharding  # Local: sharding imports nothing from models.
    out_shardings = sharding.param_shardings(abstract_params(config), mesh)
  return jax.jit(init, out_shardings=out_shardings)


def init_params(config: Qwen3Config, key: jax.Array, mesh=None) -> nnx.State:
  """Random parameters (normal(0.02), norms at 1), created by one jitted function.

  With a mesh, each parameter is created directly in its shards (eval_shape ->
  shardings -> jit with out_shardings), so no device holds a full copy.
  """
  return _init_fn(config, mesh)(key)


def abstract_params(config: Qwen3Config) -> nnx.State:
  """ShapeDtypeStructs of the parameter state, for sharding and checkpoint restore."""
  _, state = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
  return state


def forward(config: Qwen3Config, params: nnx.State, tokens_BxT, positions_BxT,
            cache: KVCache | None = None, key_mask_BxS=None, logits_idx_B=None,
            attn_window: int | None = None, segment_ids_BxT=None, *, experts_LxBxTxK=None,
            return_routing: bool = False):
  """Pure forward: float32 logits [B, T, V] and the updated cache (and `Routing`).

  Without a cache, keys are the T input tokens and `key_mask_BxS` (S = T) marks the
  real ones. With a cache, tokens are written at `positions_BxT` and attend to all
  cache slots up to their position (a row's earlier slots must hold real tokens).
  With `logits_idx_B`, logits are computed only at that index of each row: [B, 1, V].
  `attn_window` (static) limits a cached forward to the first slots of the cache; every
  position written or attended must be below it. `segment_ids_BxT` (uncached only) packs
  several sequences in a row: a token attends only to earlier slots of its own segment.
  MoE: `experts_LxBxTxK` (int, one [B, T, k] per sparse layer) replays given routes instead
  of routing; with `return_routing` the result is (logits, cache, Routing) with the routes
  this forward used and the load-balancing loss.
  """
  model = nnx.merge(graphdef(config), params)
  b = tokens_BxT.shape[0]
  s = tokens_BxT.shape[1] if cache is None else cache.max_len
  if key_mask_BxS is None:
    key_mask_BxS = jnp.ones((b, s), bool)
  out, cache, routing = model(tokens_BxT, positions_BxT, key_mask_BxS.astype(bool), cache,
                              logits_idx_B, attn_window, segment_ids_BxT,
                              experts_LxBxTxK=experts_LxBxTxK)
  return (out, cache, routing) if return_routing else (out, cache)


def hidden_and_head(config: Qwen3Config, params: nnx.State, tokens_BxT, positions_BxT, *,
                    key_mask_BxS=None, segment_ids_BxT=None, experts_LxBxTxK=None,
                    return_routing: bool = False):
  """Uncached forward up to the final norm: (hidden [B, T, D] in compute dtype, head [D, V]).

  For losses that apply the head in chunks (`rl.losses.chunked_logprobs`), so that the
  float32 logits over the vocabulary never exist for the whole batch at once. MoE routes
  in and out as in `forward` ((hidden, head, Routing) with `return_routing`).
  """
  model = nnx.merge(graphdef(config), params)
  if key_mask_BxS is None:
    key_mask_BxS = jnp.ones(tokens_BxT.shape, bool)
  x, _, routing = model(tokens_BxT, positions_BxT, key_mask_BxS.astype(bool), None, None, None,
                        segment_ids_BxT, return_hidden=True, experts_LxBxTxK=experts_LxBxTxK)
  head = model.head().astype(config.compute_jnp_dtype)
  return (x, head, routing) if return_routing else (x, head)


def logits(config: Qwen3Config, params: nnx.State, tokens_BxT, mask_BxT):
  """Float32 logits [B, T, V] of a right-padded batch (mask 1 = real token)."""
  positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
  out, _ = forward(config, params, tokens_BxT, positions, None, mask_BxT)
  return out
