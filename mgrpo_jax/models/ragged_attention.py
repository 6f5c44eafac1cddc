"""Decode attention that reads each row's own length: jax's Pallas decode kernel for GPUs.

A decode step has one query per row, and row b sees the cache slots 0..q_idx[b] (cached rows
are prefixes: a row's earlier slots hold its real tokens). The XLA path reads every row up to
one static window, the longest row's, bucketed; with rows of mixed lengths most of that read
is wasted. The kernel of `jax.experimental.pallas.ops.gpu.decode_attention` (flash-decoding in
Triton) takes each row's length: a row's keys are cut into `splits` parts, a part past the
row's length is skipped without a read, and inside a part the loop stops at the row's last
block. We call it (`_parts`) and merge its parts ourselves, in fewer kernels than the library.
Triton's blocks are powers of two: the head dim must be one (`Qwen3Config` checks), and the
cache a multiple of 16 slots (`tiles`).

The kernel reads keys and values as [S, H] per (row, kv head): the per-layer cache of a
config with attention="ragged" stores both as [B, K, S, H] (`decode.init_cache`). It lowers
only for GPUs: elsewhere (XLA:CPU) `decode` runs the XLA path over the window, which is the
same rule and the same result. `interpret=True` runs the kernel itself through Pallas'
interpreter on any backend (tests); it emulates the kernel's grid one program at a time.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode
from jax.sharding import PartitionSpec as P

from mgrpo_jax import sharding
from mgrpo_jax.models import attention

# The library's defaults: 16 parts of the keys per row (one program each, so a long row is
# spread over 16 of the GPU's SMs), key blocks of up to 128 slots, query heads padded to 16
# (Triton's smallest matmul tile).
SPLITS = 16
BLOCK_K = 128
BLOCK_H = 16
# The kernel's smallest key block and part (Triton's matmul tiles).
_MIN_BLOCK = 16


def tiles(s: int, splits: int = SPLITS, block_k: int = BLOCK_K) -> tuple[int, int]:
  """(parts, key block) for a cache of `s` slots: the most parts up to `splits` and the
  largest power-of-two block up to `block_k` that cut `s` evenly, as the kernel needs."""
  if s % _MIN_BLOCK:
    raise ValueError(f"attention='ragged' needs a cache of a multiple of {_MIN_BLOCK} slots, "
                     f"not {s} (the kernel's key blocks are at least {_MIN_BLOCK}).")
  n = max(1, min(splits, s // _MIN_BLOCK))
  while s % (n * _MIN_BLOCK):
    n -= 1
  part = s // n
  bk = _MIN_BLOCK
  while bk * 2 <= min(block_k, part) and part % (bk * 2) == 0:
    bk *= 2
  return n, bk


def slots_read(lengths_B, s: int, splits: int = SPLITS, block_k: int = BLOCK_K) -> int:
  """KV slots the kernel reads for rows of `lengths_B` in a cache of `s` slots (per layer
  and kv head): each row up to its length rounded up to a key block (the kernel's loop
  bounds), for pricing a decode step."""
  _, bk = tiles(s, splits, block_k)
  lengths = np.minimum(np.asarray(lengths_B, np.int64), s)
  return int((-(-lengths // bk) * bk).sum())


def _parts(q_GxH, k_SxH, v_SxH, length, *, n: int, bk: int, interpret: bool):
  """The library's kernel over one (row, kv head): per part of the keys, its unnormalised
  output [n, G, H] (in q's dtype), softmax sum and max [n, G] (float32)."""
  g, h = q_GxH.shape
  part = k_SxH.shape[0] // n
  body = functools.partial(pallas_decode.attn_forward_kernel, sm_scale=h ** -0.5,
                           block_k=bk, block_h=BLOCK_H, num_heads=g)
  stat = lambda: jax.ShapeDtypeStruct((n, g), jnp.float32)
  # The BlockSpecs of the library's `decode_attn_unbatched`: program (i, j) takes the query
  # heads of block i and part j of the keys; parts past the row's length return at once.
  return pl.pallas_call(
      body, grid=(pl.cdiv(g, BLOCK_H), n),
      in_specs=[pl.BlockSpec((BLOCK_H, h), lambda i, j: (i, 0)),
                pl.BlockSpec((None, part, h), lambda i, j: (j, 0, 0)),
                pl.BlockSpec((None, part, h), lambda i, j: (j, 0, 0)),
                None, pl.BlockSpec((), lambda i, j: ())],
      out_specs=[pl.BlockSpec((None, BLOCK_H, h), lambda i, j: (j, i, 0)),
                 pl.BlockSpec((None, BLOCK_H), lambda i, j: (j, i)),
                 pl.BlockSpec((None, BLOCK_H), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((n, g, h), q_GxH.dtype), stat(), stat()],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="ragged_decode",
  )(q_GxH, k_SxH.reshape(n, part, h), v_SxH.reshape(n, part, h), None, length)


def kernel(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B, *, splits: int = SPLITS,
           block_k: int = BLOCK_K, interpret: bool = False):
  """Attention of one query per row over the first `lengths_B[b]` slots of row b's keys.

  A row of length 0 (an idle slot, which writes nowhere) reads nothing and gives zeros.
  """
  h = q_BxKxGxH.shape[-1]
  n, bk = tiles(k_BxKxSxH.shape[2], splits, block_k)
  # Batched by vmap, which adds grid axes (the library's `gqa` would take keys [B, S, K, H]
  # and transpose the whole cache every step).
  one = functools.partial(_parts, n=n, bk=bk, interpret=interpret)
  per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
  o, l, m = jax.vmap(per_head)(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B.astype(jnp.int32))
  # Merge the parts by their maxima (flash-decoding); a skipped part has l = 0 and the
  # kernel's initial max (float32's min), so its weight is 0. Our own merge, not the
  # library's, which takes four kernels a layer: the parts summed as n static terms fuse
  # into two (maxima and weights; the weighted sums and the division). The library puts an
  # optimization barrier after the maxima against NaNs it saw on GPU once they fused;
  # with it this merge takes three kernels. Checked on GPU by the `gpu` test only.
  w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # [B, K, n, G]
  num = sum(o[:, :, i].astype(jnp.float32) * w[:, :, i, :, None] for i in range(n))
  den = sum(l[:, :, i] * w[:, :, i] for i in range(n))
  den = jnp.where(den > 0, den, 1.0)  # A row of length 0: num is 0 too.
  return (num / den[..., None]).astype(q_BxKxGxH.dtype)


def _per_shard(fn, q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B):
  """`fn` on each device's rows and kv heads, under the mesh set by `jax.set_mesh` (if any).

  XLA cannot split a custom call: without this, a mesh that shards the rows makes every
  device all-gather each layer's whole cache and run the kernel over all rows. Rows and kv
  heads are independent, so the shards need no communication. The cache's sharding
  (`sharding.cache_sharding`): rows over the batch axes, kv heads over `tensor` when it
  divides them.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B)
  size = lambda axes: int(np.prod([mesh.shape[a] for a in axes]))
  rows = tuple(a for a in sharding.BATCH if a in mesh.axis_names)
  if size(rows) == 1 or q_BxKxGxH.shape[0] % size(rows):
    rows = ()  # Rows that do not split evenly stay whole (XLA gathers them).
  heads = "tensor" if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 and (
      q_BxKxGxH.shape[1] % mesh.shape["tensor"] == 0) else None
  if not rows and heads is None:
    return fn(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B)
  spec = P(rows or None, heads)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, P(rows or None)),
                       out_specs=spec, check_vma=False)(
                           q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B)


def decode(q_BxKxGx1xH, k_BxKxSxH, v_BxKxSxH, q_idx_Bx1, *, window: int,
           splits: int = SPLITS, interpret: bool = False):
  """One decode step's attention over the whole per-layer cache (no slice of it is copied):
  row b sees slots 0..q_idx[b]. On GPU the Pallas kernel reads only those; elsewhere the
  XLA path reads the first `window` slots of every row (`window` covers every q_idx)."""
  pos_B = q_idx_Bx1[:, 0].astype(jnp.int32)
  # A row whose position is past the cache writes nowhere (an idle slot, a finished row):
  # it reads nothing either.
  lengths_B = jnp.where(pos_B < k_BxKxSxH.shape[2], pos_B + 1, 0)

  def ragged(q, k, v, lengths):
    one = functools.partial(kernel, splits=splits, interpret=interpret)
    return _per_shard(one, q[:, :, :, 0], k, v, lengths)[:, :, :, None]

  def windowed(q, k, v, lengths):
    k, v = k[:, :, :window], v[:, :, :window]
    valid = jnp.ones((q.shape[0], window), bool)
    return attention.query_chunked(q, k, v, q_idx_Bx1, valid)

  args = (q_BxKxGx1xH, k_BxKxSxH, v_BxKxSxH, lengths_B)
  if interpret:
    return ragged(*args)
  # Lowered for the one platform the program is compiled for: a deviceless GPU compile on
  # a CPU host gets the kernel, a CPU program never lowers it.
  return jax.lax.platform_dependent(*args, cuda=ragged, default=windowed)
