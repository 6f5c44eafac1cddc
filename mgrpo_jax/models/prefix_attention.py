"""Cascade decode attention: the slots that share a prompt read its keys and values once.

The K rollouts of a question start from one prompt. Held per slot, its KV is read K times
a decode step; held once in a pool row, it is read once. A slot's context is then two
parts: its pool row's prefix (positions 0..pool_len-1, which every member sees whole) and
its own suffix (own positions 0..own_len-1; the step's query is own position own_len-1).
Attention over the concatenation is computed per part and merged (as Hydragen does):

- prefix: the queries of a pool row's M member slots gathered into one batch of M * G
  query heads per kv head, attending to the row's keys: one read of the prefix per row
  (with a members table as wide as the slots, the engine's, the Pallas path takes every
  slot's queries as they lie instead: the same work, no gather);
- own: ordinary attention of each slot's G query heads over its own suffix;
- merge: softmax over the union from each part's normalised output and log-sum-exp,
  exactly (o = sum_i exp(lse_i - lse) o_i, lse = log sum_i exp(lse_i)).

No per-slot copy of the pool is gathered; what moves between the parts is queries and
outputs, [B, K, G, H] each. Shapes: B slots, K kv heads, G query heads per kv head, H head
dim, P pool rows of L prefix positions, M members per row (padded with B), S own positions.
The pool row of a slot without a prefix is P.

Two paths, as `attention` / `ragged_attention`: `cascade` in XLA over the sampler's XLA
layout (keys [N, K, H, S], values [N, K, S, H]), and `cascade_ragged` through jax's Pallas
GPU decode kernel (keys and values [N, K, S, H]), which keeps scores on chip and skips the
blocks past a row's length; `interpret=True` runs it through Pallas' interpreter anywhere.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

from mgrpo_jax.models import ragged_attention


def gather_queries(q_BxKxGxH, members_PxM):
  """The queries of each pool row's members, [P, K, M * G, H]; padded members get zeros."""
  p, m = members_PxM.shape
  _, kv, g, h = q_BxKxGxH.shape
  q = jnp.take(q_BxKxGxH, members_PxM.reshape(-1), axis=0, mode="fill", fill_value=0)
  return jnp.swapaxes(q.reshape(p, m, kv, g, h), 1, 2).reshape(p, kv, m * g, h)


def member_index(members_PxM, pool_row_B):
  """Each slot's place among its pool row's members (0 for a slot without a row)."""
  p, m = members_PxM.shape
  b = pool_row_B.shape[0]
  row = jnp.take(members_PxM, jnp.minimum(pool_row_B, p - 1), axis=0)  # [B, M]
  # M static terms, not an argmax: elementwise, so it fuses into the gather that uses it
  # (a reduction would be a kernel of its own every layer).
  return sum(jnp.where(row[:, j] == jnp.arange(b), j, 0) for j in range(m))


def scatter_back(x_PxKxQx_, members_PxM, pool_row_B, g: int):
  """Per slot, its share of a per-pool-row result [P, K, M * G, ...]: [B, K, G, ...].

  A gather by (pool row, member index), not a scatter: each slot reads its G rows."""
  p, kv, q = x_PxKxQx_.shape[:3]
  m = q // g
  x = x_PxKxQx_.reshape(p, kv, m, g, *x_PxKxQx_.shape[3:])
  rows, at = jnp.minimum(pool_row_B, p - 1), member_index(members_PxM, pool_row_B)
  return x[rows, :, at]


def partial_attention(q_NxKxQxH, k_NxKxHxS, v_NxKxSxH, length_N):
  """Softmax attention of Q queries a row over its first `length_N` slots: (output
  normalised over those slots, float32 [N, K, Q, H]; log-sum-exp, float32 [N, K, Q],
  -inf where the row sees nothing)."""
  h = q_NxKxQxH.shape[-1]
  s = jnp.einsum("nkqh,nkhs->nkqs", q_NxKxQxH, k_NxKxHxS,
                 preferred_element_type=jnp.float32) * h ** -0.5
  visible = jnp.arange(s.shape[-1])[None, :] < length_N[:, None]
  s = jnp.where(visible[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])  # Masked scores give exp(-inf) = 0.
  l = jnp.sum(p, axis=-1)
  # Probabilities in the compute dtype for the second matmul, as the reference's.
  o = jnp.einsum("nkqs,nksh->nkqh", p.astype(v_NxKxSxH.dtype), v_NxKxSxH,
                 preferred_element_type=jnp.float32)
  has = l > 0
  return o / jnp.where(has, l, 1.0)[..., None], jnp.where(has, m_safe + jnp.log(
      jnp.where(has, l, 1.0)), -jnp.inf)


def merge(outs, lses):
  """Attention over the union of disjoint key sets from each set's normalised output
  [..., H] and log-sum-exp [...] (float32): exact; zeros where no set has a key."""
  top = functools.reduce(jnp.maximum, lses)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  ws = [jnp.exp(lse - top) for lse in lses]  # A set with nothing visible weighs 0.
  num = sum(w[..., None] * o for w, o in zip(ws, outs))
  den = sum(ws)
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def cascade(q_BxKxGx1xH, k_BxKxHxS, v_BxKxSxH, own_len_B, pool_k_PxKxHxL, pool_v_PxKxLxH,
            pool_len_P, members_PxM, pool_row_B):
  """One decode step's attention of each slot over its pool row's prefix and its own
  suffix (XLA layout): [B, K, G, 1, H] in q's dtype. Slot b sees all `pool_len[r]`
  positions of its row r = `pool_row[b]` (none if r = P) and its first `own_len[b]`."""
  g = q_BxKxGx1xH.shape[2]
  q = q_BxKxGx1xH[:, :, :, 0]
  # Prefix: one batch of M * G query heads per pool row and kv head, one read of its KV.
  o_p, lse_p = partial_attention(gather_queries(q, members_PxM), pool_k_PxKxHxL,
                                 pool_v_PxKxLxH, pool_len_P)
  o_p = scatter_back(o_p, members_PxM, pool_row_B, g)
  has = (pool_row_B < pool_k_PxKxHxL.shape[0])[:, None, None]
  lse_p = jnp.where(has, scatter_back(lse_p, members_PxM, pool_row_B, g), -jnp.inf)
  o_o, lse_o = partial_attention(q, k_BxKxHxS, v_BxKxSxH, own_len_B)
  return merge([o_p, o_o], [lse_p, lse_o]).astype(q.dtype)[:, :, :, None]


def _parts(q_QxH, k_SxH, v_SxH, length, *, n: int, bk: int, interpret: bool):
  """jax's Pallas decode kernel over one (row, kv head) with all Q query heads in one
  block (so each key block is read once for all of them): per part of the keys, the
  unnormalised output [n, Q, H] (q's dtype), softmax sum and max [n, Q] (float32)."""
  q, h = q_QxH.shape
  part = k_SxH.shape[0] // n
  # Triton's tiles are powers of two of at least 16: the block covers every query head.
  block_h = max(16, 1 << (q - 1).bit_length())
  body = functools.partial(pallas_decode.attn_forward_kernel, sm_scale=h ** -0.5,
                           block_k=bk, block_h=block_h, num_heads=q)
  stat = lambda: jax.ShapeDtypeStruct((n, q), jnp.float32)
  return pl.pallas_call(
      body, grid=(1, n),
      in_specs=[pl.BlockSpec((block_h, h), lambda i, j: (i, 0)),
                pl.BlockSpec((None, part, h), lambda i, j: (j, 0, 0)),
                pl.BlockSpec((None, part, h), lambda i, j: (j, 0, 0)),
                None, pl.BlockSpec((), lambda i, j: ())],
      out_specs=[pl.BlockSpec((None, block_h, h), lambda i, j: (j, i, 0)),
                 pl.BlockSpec((None, block_h), lambda i, j: (j, i)),
                 pl.BlockSpec((None, block_h), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((n, q, h), q_QxH.dtype), stat(), stat()],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="prefix_decode",
  )(q_QxH, k_SxH.reshape(n, part, h), v_SxH.reshape(n, part, h), None, length)


def _kernel_parts(q_NxKxQxH, k_NxKxSxH, v_NxKxSxH, length_N, *, splits: int,
                  interpret: bool, q_axes=(0, 1)):
  """`_parts` over every row and kv head: o [N, K, n, Q, H], l and m [N, K, n, Q].

  `q_axes`: q's (row, kv head) axes; None for one q that every row reads. The kernel's
  blocks index q where it lies (vmapping a Pallas call moves no axis), so q needs no copy
  into the rows' order."""
  n, bk = ragged_attention.tiles(k_NxKxSxH.shape[2], splits)
  one = functools.partial(_parts, n=n, bk=bk, interpret=interpret)
  row_axis, head_axis = q_axes
  # The rows are mapped first: a kv head axis after the row axis moves down one.
  head_axis -= row_axis is not None and row_axis < head_axis
  per_head = jax.vmap(one, in_axes=(head_axis, 0, 0, None))
  return jax.vmap(per_head, in_axes=(row_axis, 0, 0, 0))(
      q_NxKxQxH, k_NxKxSxH, v_NxKxSxH, length_N.astype(jnp.int32))


def cascade_ragged(q_BxKxGx1xH, k_BxKxSxH, v_BxKxSxH, own_len_B, pool_k_PxKxLxH,
                   pool_v_PxKxLxH, pool_len_P, members_PxM, pool_row_B, *,
                   splits: int = ragged_attention.SPLITS, interpret: bool = False):
  """`cascade` through the Pallas decode kernel (keys and values [N, K, S, H]): the prefix
  per pool row with its members' M * G query heads of a kv head in one block, the suffix
  per slot, each read to its own length; the parts of both merged together by their
  maxima. L and S must be multiples of 16 (`ragged_attention.tiles`).

  With a members table as wide as the slots (M = B, the engine's: a row may hold every
  slot) a gather of members saves no work: every pool row attends with every slot's
  queries as they lie, kv heads major ([K, B * G, H] is a reshape of [K, B, G, H], which
  the queries' producer writes), and each slot reads back its own row's results. Fewer
  members than slots take the gather (`gather_queries`, `scatter_back`)."""
  b, kv, g, _, h = q_BxKxGx1xH.shape
  p, width = members_PxM.shape
  q = q_BxKxGx1xH[:, :, :, 0]
  run = functools.partial(_kernel_parts, splits=splits, interpret=interpret)
  # A pool row without members is still read to its length: a free row should have 0.
  if width >= b:
    # [K, B, G, H]: one layout for both kernels (they index q where it lies).
    q, q_axes = jnp.transpose(q, (1, 0, 2, 3)), (1, 0)
    o_p, l_p, m_p = run(q.reshape(kv, b * g, h), pool_k_PxKxLxH, pool_v_PxKxLxH,
                        pool_len_P, q_axes=(None, 0))
    # Per slot b, row pool_row[b]'s results for b's queries: [P, K, n, B * G, ...] ->
    # [B, K, n, G, ...].
    rows, slots = jnp.minimum(pool_row_B, p - 1), jnp.arange(b)
    back = lambda x: x.reshape(p, kv, x.shape[2], b, g, *x.shape[4:])[rows, :, :, slots]
  else:
    # [K, B, G, H] as above; each row's members' queries gathered from it, [K, P, M * G, H].
    q, q_axes = jnp.transpose(q, (1, 0, 2, 3)), (1, 0)
    q_p = jnp.take(q, members_PxM.reshape(-1), axis=1, mode="fill", fill_value=0)
    o_p, l_p, m_p = run(q_p.reshape(kv, p, width * g, h), pool_k_PxKxLxH, pool_v_PxKxLxH,
                        pool_len_P, q_axes=(1, 0))
    # [P, K, n, M * G, ...] -> per slot [B, K, n, G, ...]: its row's results for its place
    # among the row's members, a gather both merge fusions read (no transpose of its own).
    rows = jnp.minimum(pool_row_B, p - 1)
    at = member_index(members_PxM, pool_row_B)
    back = lambda x: x.reshape(p, kv, x.shape[2], width, g, *x.shape[4:])[rows, :, :, at]
  # A slot without a row takes row P - 1's parts: zeroed, so they weigh nothing.
  has = (pool_row_B < p)[:, None, None, None]
  o_p, l_p = jnp.where(has[..., None], back(o_p), 0), jnp.where(has, back(l_p), 0.0)
  m_p = jnp.where(has, back(m_p), jnp.finfo(jnp.float32).min)
  # The suffix, each slot over its own cache, q read where it lies: results [B, K, ...].
  o_o, l_o, m_o = run(q, k_BxKxSxH, v_BxKxSxH, own_len_B, q_axes=q_axes)
  # Flash-decoding's merge over all parts of both, as static terms (as
  # `ragged_attention.kernel`'s: two kernels, the maxima's and the output's, which read the
  # prefix's parts through the slots' gather). A skipped part has l = 0 and the kernel's
  # initial max (float32's min), so it weighs 0.
  parts = [(o[:, :, i], l[:, :, i], m[:, :, i]) for o, l, m in ((o_p, l_p, m_p),
                                                              (o_o, l_o, m_o))
           for i in range(o.shape[2])]
  top = functools.reduce(jnp.maximum, [m for _, _, m in parts])
  ws = [jnp.exp(m - top) for _, _, m in parts]  # [B, K, G] each.
  num = sum(o.astype(jnp.float32) * w[..., None] for (o, _, _), w in zip(parts, ws))
  den = sum(l * w for (_, l, _), w in zip(parts, ws))
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  return out.astype(q_BxKxGx1xH.dtype)[:, :, :, None]


def decode(q_BxKxGx1xH, k_BxKx__, v_BxKxSxH, q_idx_Bx1, pool_k_PxKx__, pool_v_PxKxLxH,
           pool_len_P, members_PxM, pool_row_B, *, window: int, key_axis: int,
           splits: int = ragged_attention.SPLITS, interpret: bool = False):
  """One decode step of the model's attention with a shared prefix: row b's query (own
  position q_idx[b], which sees own positions 0..q_idx[b]) over its pool row's prefix and
  its own cache. Keys as the cache stores them (`key_axis` 3: [N, K, H, S], the XLA layout,
  already cut to `window`; 2: [N, K, S, H], whole). With key_axis 2 a GPU program runs
  `cascade_ragged`; anything else `cascade` over the first `window` own positions."""
  pos_B = q_idx_Bx1[:, 0].astype(jnp.int32)
  # A row past its cache (an idle slot) writes nowhere and reads none of its own.
  own_B = jnp.where(pos_B < v_BxKxSxH.shape[2], pos_B + 1, 0)
  pool = (pool_len_P, members_PxM, pool_row_B)
  if key_axis == 3:
    return cascade(q_BxKxGx1xH, k_BxKx__, v_BxKxSxH, own_B, pool_k_PxKx__, pool_v_PxKxLxH,
                   *pool)

  def ragged(q, k, v, own, pk, pv):
    return cascade_ragged(q, k, v, own, pk, pv, *pool, splits=splits, interpret=interpret)

  def windowed(q, k, v, own, pk, pv):
    own = jnp.minimum(own, window)
    return cascade(q, jnp.swapaxes(k[:, :, :window], 2, 3), v[:, :, :window], own,
                   jnp.swapaxes(pk, 2, 3), pv, *pool)

  args = (q_BxKxGx1xH, k_BxKx__, v_BxKxSxH, own_B, pool_k_PxKx__, pool_v_PxKxLxH)
  if interpret:
    return ragged(*args)
  return jax.lax.platform_dependent(*args, cuda=ragged, default=windowed)
