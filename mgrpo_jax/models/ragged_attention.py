"""Decode attention that reads each row's own length: jax's Pallas decode kernel for GPUs.

A decode step has one query per row, and row b sees the cache slots 0..q_idx[b] (cached rows
are prefixes: a row's earlier slots hold its real tokens). The XLA path reads every row up to
one static window, the longest row's, bucketed; with rows of mixed lengths most of that read
is wasted. `jax.experimental.pallas.ops.gpu.decode_attention` (flash-decoding in Triton) takes
each row's length: a row's keys are cut into `splits` parts, a part past the row's length
is skipped without a read, and inside a part the loop stops at the row's last block.

The kernel reads keys and values as [S, H] per (row, kv head): the per-layer cache of a
config with attention="ragged" stores both as [B, K, S, H] (`decode.init_cache`). It lowers
only for GPUs: elsewhere (XLA:CPU) `decode` runs the XLA path over the window, which is the
same rule and the same result. `interpret=True` runs the kernel itself through Pallas'
interpreter on any backend (tests); it emulates the kernel's grid one program at a time.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

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


def kernel(q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, lengths_B, *, splits: int = SPLITS,
           block_k: int = BLOCK_K, interpret: bool = False):
  """Attention of one query per row over the first `lengths_B[b]` slots of row b's keys.

  Rows of length 0 are not supported (a decode row sees at least its own token).
  """
  b, kv, g, h = q_BxKxGxH.shape
  n, bk = tiles(k_BxKxSxH.shape[2], splits, block_k)
  # The library's per-(row, kv head) entry, batched by vmap (which adds grid axes): its
  # `gqa` wrapper would take keys [B, S, K, H] and transpose the whole cache every step.
  one = functools.partial(
      pallas_decode.decode_attn_unbatched, sm_scale=h ** -0.5, block_h=BLOCK_H, block_k=bk,
      k_splits=n, num_warps=None, num_stages=2, grid=None, interpret=interpret, debug=False,
      return_residuals=False, normalize_output=True)
  lengths_BxK = jnp.broadcast_to(lengths_B.astype(jnp.int32)[:, None], (b, kv))
  per_head = jax.vmap(one, in_axes=(0, 0, 0, None, 0))
  out = jax.vmap(per_head, in_axes=(0, 0, 0, None, 0))(
      q_BxKxGxH, k_BxKxSxH, v_BxKxSxH, None, lengths_BxK)
  # The library divides by a float32 sum: back to the compute dtype, as the XLA path returns.
  return out.astype(q_BxKxGxH.dtype)


def decode(q_BxKxGx1xH, k_BxKxSxH, v_BxKxSxH, q_idx_Bx1, *, window: int,
           splits: int = SPLITS, interpret: bool = False):
  """One decode step's attention over the whole per-layer cache (no slice of it is copied):
  row b sees slots 0..q_idx[b]. On GPU the Pallas kernel reads only those; elsewhere the
  XLA path reads the first `window` slots of every row (`window` covers every q_idx)."""
  lengths_B = q_idx_Bx1[:, 0].astype(jnp.int32) + 1

  def ragged(q, k, v, lengths):
    out = kernel(q[:, :, :, 0], k, v, lengths, splits=splits, interpret=interpret)
    return out[:, :, :, None]

  def windowed(q, k, v, lengths):
    k, v = k[:, :, :window], v[:, :, :window]
    valid = jnp.ones((q.shape[0], window), bool)
    return attention.query_chunked(q, k, v, (lengths - 1)[:, None], valid)

  args = (q_BxKxGx1xH, k_BxKxSxH, v_BxKxSxH, lengths_B)
  if interpret:
    return ragged(*args)
  # Lowered for the one platform the program is compiled for: a deviceless GPU compile on
  # a CPU host gets the kernel, a CPU program never lowers it.
  return jax.lax.platform_dependent(*args, cuda=ragged, default=windowed)
