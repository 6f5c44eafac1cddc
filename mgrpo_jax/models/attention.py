"""Grouped-query attention kernels that share one masking rule, chosen by config.

Every implementation computes, for queries q[b, k, g, t] and keys k[b, k, s],

  visible(t, s) = s <= q_idx[t]  and  kv_valid[s]  and  q_seg[t] == kv_seg[s]

where `q_idx` is the cache slot (= packed-row index) of the query, so causality follows the
slots, while RoPE positions may restart inside a packed row. Implementations:

- "reference": the einsum over the full [T, S] score tensor (the parity baseline); `attend`
  runs it over chunks of queries where the scores of the whole batch would pass
  `REFERENCE_MAX_SCORE_BYTES` (`query_chunked`, the same result).
- "blockwise": flash-style online softmax over [block, block] tiles with a hand-written
  backward (`jax.custom_vjp`) that recomputes the tiles, so neither pass ever holds more
  than one tile of scores: memory is linear in T. Pure JAX, runs everywhere.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (fused flash kernel) for
  uncached right-padded batches on GPU, in bfloat16 or float16 with a head dim that is a
  multiple of 8 and at most 128 (`cudnn_unsupported`).
- "cudnn_packed": cuDNN's fused kernel also for packed rows (the update's segment ids),
  through its sequence-packing mode (per-row segment lengths and offsets); otherwise as
  "cudnn". GPU only, opt-in: "auto" never takes it until a lent GPU has checked it
  (tests/models/test_attention.py's `gpu` test).
- "ragged": a decode step over the sampler's per-layer cache reads each row's own length
  (`models/ragged_attention.py`: jax's Pallas decode kernel on GPU); elsewhere as "auto".
- "auto": cuDNN where it applies on GPU (unpacked rows), else the reference for small
  [T, S] (the sampler's cached queries up to 1024 x 1024, `_AUTO_REFERENCE_MAX_TS`; the
  train step's rows up to 128 x 128, `_AUTO_REFERENCE_MAX_TS_UNCACHED`), else blockwise, in
  even tiles of at most `CPU_BLOCK` where the program is lowered for a CPU.
"""

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "cudnn", "cudnn_packed", "blockwise", "reference", "ragged")
CUDNN_IMPLEMENTATIONS = ("cudnn", "cudnn_packed")
# "auto" keeps the reference while one row's scores per head stay this small: 1024 x 1024
# for the sampler's cached queries (forward only), 128 x 128 for the train step's rows. Under
# jax.grad on 2 CPU cores (the other jobs paused), one layer's attention of the CPU agents'
# heads (2 kv x 2, head dim 64, float32, three packed sequences a row), reference against
# blockwise in 128-tiles: 21 / 26 ms at 32 x 128 tokens, 37 / 31 at 16 x 256, 78 / 29 at
# 8 x 512, 187 / 72 at 4 x 1024; forward only, 64 rows: 20 / 20 ms at 128, 69 / 62 at 256,
# 280 / 150 at 512 (benchmarks/attention_cpu.py, benchmarks/results/attention-cpu.json).
# The sampler's cached
# prefill, which that forward case resembles, keeps the reference for now: the evaluation's
# memory figures (REFERENCE_MAX_SCORE_BYTES) were measured with it. On GPU, rows that cuDNN
# does not take (packed, or float32) past 128 x 128 also go blockwise: not measured there.
_AUTO_REFERENCE_MAX_TS = 1 << 20
_AUTO_REFERENCE_MAX_TS_UNCACHED = 128 * 128
# The blockwise kernel's tiles on XLA:CPU under "auto" (at most the config's block): 4 x 1024
# packed tokens under grad took 72 ms in 128-tiles, 66 in 256, 123 in 512; 8 x 512: 29, 51, 78.
CPU_BLOCK = 128
# What cuDNN's fused kernel takes (jax checks both when it lowers the call): half-precision
# inputs, and a head dim that is a multiple of 8 and at most 128 (256 from Hopper on).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128
# The most bytes of float32 scores the reference materialises in one piece: above it, the
# queries go through in chunks (`query_chunked`). An evaluation of 265 multihop questions
# (hundreds of rows at once) peaked at 9.9 GB resident with the whole [B, K, G, T, S]
# tensor, at 3.6 GB with this budget in 83 s instead of 71 (64 MiB: 3.4 GB in 100 s;
# experiments/hierarchy_ablation/eval_memory.py and results/eval-memory-cpu.json).
REFERENCE_MAX_SCORE_BYTES = 256 << 20
# A large finite negative instead of -inf: a row with no visible key softmaxes to a uniform
# garbage row instead of NaN (reference only; the blockwise kernel returns zeros there).
_MASK_VALUE = -1e30


def visible_mask(q_idx_BxT, kv_valid_BxS, q_seg_BxT=None, kv_seg_BxS=None, kv_start: int = 0):
  """The [B, T, S] boolean mask of the shared rule (keys numbered from `kv_start`)."""
  s_idx = kv_start + jnp.arange(kv_valid_BxS.shape[1])
  vis = (s_idx[None, None, :] <= q_idx_BxT[:, :, None]) & kv_valid_BxS[:, None, :]
  if q_seg_BxT is not None:
    vis &= q_seg_BxT[:, :, None] == kv_seg_BxS[:, None, :]
  return vis


def reference(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS, q_seg_BxT=None,
              kv_seg_BxS=None):
  """Materialises the [B, K, G, T, S] scores in float32 (test baseline, tiny shapes)."""
  dt = q_BxKxGxTxH.dtype
  scale = q_BxKxGxTxH.shape[-1] ** -0.5
  vis = visible_mask(q_idx_BxT, kv_valid_BxS, q_seg_BxT, kv_seg_BxS)
  scores = jnp.einsum("bkgth,bksh->bkgts", q_BxKxGxTxH, k_BxKxSxH,
                      preferred_element_type=jnp.float32) * scale
  scores = jnp.where(vis[:, None, None], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  return jnp.einsum("bkgts,bksh->bkgth", probs, v_BxKxSxH)


def query_chunked(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS, q_seg_BxT=None,
                  kv_seg_BxS=None, *, max_score_bytes: int | None = None,
                  loop: bool | None = None):
  """The reference over chunks of queries, each chunk's float32 scores within
  `max_score_bytes` (default `REFERENCE_MAX_SCORE_BYTES`): the same per-query softmax, so the
  same result, in bounded memory (the budget bounds one copy of a chunk's scores; the mask
  and probabilities sit beside it). The batch axis is left whole (and keeps its sharding).

  How the chunks run depends on the compiler, chosen where the program is lowered
  (`lax.platform_dependent`, so a deviceless GPU compile on a CPU host gets the GPU's).
  XLA:CPU bounds memory only with a loop (`lax.map`; a test's 512 rows x 640 queries: 1.1 GB
  of temporaries, 3.6 GB with static slices, 6.7 GB unchunked). XLA:GPU bounds it only with
  static slices (Qwen3-0.6B's prefill of 64 x 1024 tokens: 21.2 GB a GPU, 30.9 GB with the
  loop, 27.1 GB unchunked; docs/results/gpu-compile.md). `loop` True or False forces one way.
  Each chunk is rematerialised under `jax.grad`.
  """
  b, kh, g, t, _ = q_BxKxGxTxH.shape
  row_bytes = b * kh * g * k_BxKxSxH.shape[2] * 4
  most = max(1, (max_score_bytes or REFERENCE_MAX_SCORE_BYTES) // row_bytes)
  most = most // 8 * 8 if most >= 8 else most
  if most >= t:
    return reference(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS, q_seg_BxT,
                     kv_seg_BxS)
  # Chunks as even as multiples of 8 queries allow (where the budget holds 8 or more).
  chunk = _even_tile(t, most) if most >= 8 else _cdiv(t, _cdiv(t, most))
  n = _cdiv(t, chunk)

  def one(q_i, idx_i, seg_i):
    return reference(q_i, k_BxKxSxH, v_BxKxSxH, idx_i, kv_valid_BxS, seg_i, kv_seg_BxS)

  # Rematerialised: a gradient keeps one chunk's scores (CSE is harmless only in a loop).
  remat = lambda cse: jax.checkpoint(one, prevent_cse=cse)

  def looped(q, q_idx, q_seg):
    # Padded queries see nothing (slot -1); their rows are cut off below.
    q = _blocked(_pad_axis(q, 3, n * chunk, 0), 3, chunk)
    q_idx = _blocked(_pad_axis(q_idx.astype(jnp.int32), 1, n * chunk, -1), 1, chunk)
    q_seg = None if q_seg is None else _blocked(_pad_axis(q_seg, 1, n * chunk, 0), 1, chunk)
    out = jax.lax.map(lambda xs: remat(False)(*xs), (q, q_idx, q_seg))
    return _unblocked(out, 3)[:, :, :, :t]

  def sliced(q, q_idx, q_seg):
    cut = lambda x, i, axis: None if x is None else jax.lax.slice_in_dim(
        x, i, min(i + chunk, t), axis=axis)
    return jnp.concatenate([remat(True)(cut(q, i, 3), cut(q_idx, i, 1), cut(q_seg, i, 1))
                            for i in range(0, t, chunk)], axis=3)

  if loop is not None:
    return (looped if loop else sliced)(q_BxKxGxTxH, q_idx_BxT, q_seg_BxT)
  return jax.lax.platform_dependent(q_BxKxGxTxH, q_idx_BxT, q_seg_BxT, cpu=looped,
                                    default=sliced)


def _pad_axis(x, axis: int, size: int, value):
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _tile_probs(q_i, k_j, qi_i, qs_i, kv_j, ks_j, j, bk, scale, stat_i, *, online):
  """Scores of one [bq, bk] tile, masked; with online=False, probs exp(s - lse)."""
  s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale
  vis = (j * bk + jnp.arange(bk))[None, None, :] <= qi_i[:, :, None]
  vis &= kv_j[:, None, :] & (qs_i[:, :, None] == ks_j[:, None, :])
  vis = vis[:, None, None]
  if online:
    return jnp.where(vis, s, -jnp.inf)
  return jnp.where(vis, jnp.exp(s - stat_i[..., None]), 0.0)


def _blocked(x, axis: int, block: int):
  """[..., n * block, ...] -> [n, ..., block, ...] (blocks first, for loops)."""
  n = x.shape[axis] // block
  x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _unblocked(x, axis: int):
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _flash_fwd_blocks(q, k, v, q_idx, q_seg, kv_valid, kv_seg, bq, bk):
  """Blocked forward: (out [nq, B, K, G, bq, H], lse [nq, B, K, G, bq]) in float32."""
  scale = q.shape[-1] ** -0.5
  qb, qib, qsb = _blocked(q, 3, bq), _blocked(q_idx, 1, bq), _blocked(q_seg, 1, bq)
  kb, vb = _blocked(k, 2, bk), _blocked(v, 2, bk)
  kvb, ksb = _blocked(kv_valid, 1, bk), _blocked(kv_seg, 1, bk)
  nk = kb.shape[0]

  def one_q_block(xs):
    q_i, qi_i, qs_i = xs
    # Causal skip: key blocks past the block's last visible slot hold nothing visible.
    hi = jnp.clip((jnp.max(qi_i) + bk) // bk, 0, nk)

    def body(j, carry):
      m, l, acc = carry
      s = _tile_probs(q_i, kb[j], qi_i, qs_i, kvb[j], ksb[j], j, bk, scale, None, online=True)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      corr = jnp.exp(m - m_safe)
      pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), vb[j],
                      preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    shape = q_i.shape[:-1]
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(q_i.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, hi, body, init)
    has = l > 0
    out = acc / jnp.where(has, l, 1.0)[..., None]
    # +inf for a query that sees nothing: the backward's exp(s - lse) is then 0.
    lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), jnp.inf)
    return out, lse

  return jax.lax.map(one_q_block, (qb, qib, qsb))


def _flash_bwd_blocks(q, k, v, q_idx, q_seg, kv_valid, kv_seg, out_b, lse_b, do, bq, bk):
  """dq, dk, dv of the blocked forward, recomputing each tile's probabilities."""
  scale = q.shape[-1] ** -0.5
  qb, qib, qsb = _blocked(q, 3, bq), _blocked(q_idx, 1, bq), _blocked(q_seg, 1, bq)
  kb, vb = _blocked(k, 2, bk), _blocked(v, 2, bk)
  kvb, ksb = _blocked(kv_valid, 1, bk), _blocked(kv_seg, 1, bk)
  dob = _blocked(do, 3, bq)
  delta_b = jnp.sum(dob.astype(jnp.float32) * out_b, axis=-1)  # [nq, B, K, G, bq]
  nq, nk = qb.shape[0], kb.shape[0]
  q_last = jnp.max(qib, axis=(1, 2))  # [nq]: the furthest slot any query of a block sees.

  def k_block(j, carry):
    dq, dk, dv = carry

    def q_block(i, inner):
      dq, dk_j, dv_j = inner

      def tile(args):
        dq, dk_j, dv_j = args
        p = _tile_probs(qb[i], kb[j], qib[i], qsb[i], kvb[j], ksb[j], j, bk, scale, lse_b[i],
                        online=False)
        dv_j = dv_j + jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), dob[i],
                                 preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgqh,bksh->bkgqs", dob[i], vb[j], preferred_element_type=jnp.float32)
        ds = p * (dp - delta_b[i][..., None]) * scale
        dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k.dtype), kb[j],
                          preferred_element_type=jnp.float32)
        dk_j = dk_j + jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), qb[i],
                                 preferred_element_type=jnp.float32)
        return dq.at[i].add(dq_i), dk_j, dv_j

      return jax.lax.cond(q_last[i] >= j * bk, tile, lambda a: a, (dq, dk_j, dv_j))

    zeros = jnp.zeros(kb.shape[1:], jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(0, nq, q_block, (dq, zeros, zeros))
    return dq, dk.at[j].set(dk_j), dv.at[j].set(dv_j)

  init = (jnp.zeros(qb.shape, jnp.float32), jnp.zeros(kb.shape, jnp.float32),
          jnp.zeros(vb.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, nk, k_block, init)
  return (_unblocked(dq, 3).astype(q.dtype), _unblocked(dk, 2).astype(k.dtype),
          _unblocked(dv, 2).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, q_idx, q_seg, kv_valid, kv_seg, bq, bk):
  out_b, _ = _flash_fwd_blocks(q, k, v, q_idx, q_seg, kv_valid, kv_seg, bq, bk)
  return _unblocked(out_b, 3).astype(q.dtype)


def _flash_fwd(q, k, v, q_idx, q_seg, kv_valid, kv_seg, bq, bk):
  out_b, lse_b = _flash_fwd_blocks(q, k, v, q_idx, q_seg, kv_valid, kv_seg, bq, bk)
  out = _unblocked(out_b, 3).astype(q.dtype)
  # Residuals: the inputs, the output (cast, as the caller sees it) and the row statistics.
  return out, (q, k, v, q_idx, q_seg, kv_valid, kv_seg, out, lse_b)


def _flash_bwd(bq, bk, res, do):
  q, k, v, q_idx, q_seg, kv_valid, kv_seg, out, lse_b = res
  out_b = _blocked(out, 3, bq).astype(jnp.float32)
  dq, dk, dv = _flash_bwd_blocks(q, k, v, q_idx, q_seg, kv_valid, kv_seg, out_b, lse_b, do,
                                 bq, bk)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS, q_seg_BxT=None,
              kv_seg_BxS=None, *, block_q: int = 512, block_kv: int = 512):
  """Flash-style attention: [block_q, block_kv] tiles, online softmax, recomputing backward.

  Queries that see no key return 0 (the reference returns an average of garbage there);
  either way such rows carry no loss.
  """
  t, s = q_BxKxGxTxH.shape[3], k_BxKxSxH.shape[2]
  bq = min(block_q, -(-t // 8) * 8)
  bk = min(block_kv, -(-s // 8) * 8)
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  b = q_BxKxGxTxH.shape[0]
  if q_seg_BxT is None:
    q_seg_BxT, kv_seg_BxS = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  # Padded queries see nothing (slot -1); padded keys are invalid.
  q = _pad_axis(q_BxKxGxTxH, 3, tp, 0)
  q_idx = _pad_axis(q_idx_BxT.astype(jnp.int32), 1, tp, -1)
  q_seg = _pad_axis(q_seg_BxT.astype(jnp.int32), 1, tp, 0)
  k = _pad_axis(k_BxKxSxH, 2, sp, 0)
  v = _pad_axis(v_BxKxSxH, 2, sp, 0)
  kv_valid = _pad_axis(kv_valid_BxS.astype(bool), 1, sp, False)
  kv_seg = _pad_axis(kv_seg_BxS.astype(jnp.int32), 1, sp, 0)
  out = _flash(q, k, v, q_idx, q_seg, kv_valid, kv_seg, bq, bk)
  return out[:, :, :, :t]


def split_kv(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS, *, splits: int):
  """Flash-decoding for cached queries: the keys cut into `splits` chunks whose partial
  softmaxes are computed side by side, then merged by their maxima and sums.

  With one or few queries per row, the reference reduces over the whole window in one
  pass; split, the reductions are `splits` times shorter and `splits` times as many, which
  gives a GPU more blocks to spread the cache read over. Same masking rule (no segments:
  cached rows hold one sequence); queries that see no key return 0.
  """
  b, kv, g, t, h = q_BxKxGxTxH.shape
  s = k_BxKxSxH.shape[2]
  n = max(1, min(splits, s))
  c = -(-s // n)
  k = _pad_axis(k_BxKxSxH, 2, n * c, 0).reshape(b, kv, n, c, h)
  v = _pad_axis(v_BxKxSxH, 2, n * c, 0).reshape(b, kv, n, c, h)
  valid = _pad_axis(kv_valid_BxS.astype(bool), 1, n * c, False).reshape(b, 1, n, c)
  vis = (jnp.arange(n * c).reshape(n, c) <= q_idx_BxT[:, :, None, None]) & valid
  scores = jnp.einsum("bkgth,bknch->bkgtnc", q_BxKxGxTxH, k,
                      preferred_element_type=jnp.float32) * h ** -0.5
  scores = jnp.where(vis[:, None, None], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)  # Per chunk: [B, K, G, T, N].
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m_safe[..., None])  # Masked scores give exp(-inf) = 0.
  l = jnp.sum(p, axis=-1)
  # Unnormalised chunk outputs in the compute dtype, as the reference's probs @ v.
  o = jnp.einsum("bkgtnc,bknch->bkgtnh", p.astype(v.dtype), v).astype(jnp.float32)
  top = jnp.max(m, axis=-1, keepdims=True)
  w = jnp.where(jnp.isfinite(m), jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  total = jnp.sum(l * w, axis=-1)
  out = jnp.sum(o * w[..., None], axis=-2) / jnp.where(total > 0, total, 1.0)[..., None]
  return out.astype(q_BxKxGxTxH.dtype)


def cudnn(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, lengths_B, *, implementation: str = "cudnn"):
  """cuDNN's fused causal attention over right-padded rows of `lengths_B` real tokens.

  Only for uncached batches (query t sits in slot t). `implementation="xla"` runs the
  same call through XLA, which is how CPU tests check the layout and length handling.
  """
  b, kv, g, t, h = q_BxKxGxTxH.shape
  # [B, K, G, T, H] -> [B, T, K*G, H]: query head k*G + g uses kv head k, as jax expects.
  q = jnp.transpose(q_BxKxGxTxH, (0, 3, 1, 2, 4)).reshape(b, t, kv * g, h)
  k = jnp.transpose(k_BxKxSxH, (0, 2, 1, 3))
  v = jnp.transpose(v_BxKxSxH, (0, 2, 1, 3))
  lengths = lengths_B.astype(jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths,
                                     implementation=implementation)
  return jnp.transpose(out.reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))


def segment_lengths_and_offsets(seg_BxT, max_segments: int):
  """cuDNN's sequence-packing description of packed rows (segment ids 1.. in order, 0 on
  trailing padding): lengths [B, M] and start offsets [B, M + 1], -1 past a row's last
  segment, M = `max_segments` (segments past it are left out: the packer keeps to it)."""
  b, _ = seg_BxT.shape
  counts = jnp.zeros((b, max_segments + 1), jnp.int32).at[
      jnp.arange(b)[:, None], seg_BxT].add(1, mode="drop")
  lengths = counts[:, 1:]  # Segment s + 1's length; 0 past the row's last segment.
  ends = jnp.cumsum(lengths, axis=1)
  n = jnp.sum(lengths > 0, axis=1, keepdims=True)
  offsets = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), ends], axis=1)
  offsets = jnp.where(jnp.arange(max_segments + 1) <= n, offsets, -1)
  return jnp.where(lengths > 0, lengths, -1), offsets


def cudnn_packed(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, seg_BxT, *, max_segments: int):
  """cuDNN's fused causal attention within each packed segment (uncached, S = T).

  Rows hold at most `max_segments` segments (`Qwen3Config.attention_max_segments`, which
  the packer keeps to): cuDNN's softmax statistics are [B * max_segments, heads, T] floats.
  Padding (segment 0) belongs to no segment: its outputs are not defined (the update
  masks them out of the loss; they reach no real token, which only sees its segment).
  """
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa  # GPU-only kernel.

  b, kv, g, t, h = q_BxKxGxTxH.shape
  # jax's cuDNN training path takes even lengths only (the update's T = L - 1 is odd): one
  # more padding slot, in no segment, sliced off again.
  pad = t % 2
  q = jnp.transpose(q_BxKxGxTxH, (0, 3, 1, 2, 4)).reshape(b, t, kv * g, h)
  k = jnp.transpose(k_BxKxSxH, (0, 2, 1, 3))
  v = jnp.transpose(v_BxKxSxH, (0, 2, 1, 3))
  q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
  seg = jnp.pad(seg_BxT.astype(jnp.int32), ((0, 0), (0, pad)))
  lengths, offsets = segment_lengths_and_offsets(seg, max_segments)
  out = cudnn_fa.dot_product_attention(
      q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
      scale=float(h) ** -0.5, mask_type=cudnn_fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
  return jnp.transpose(out[:, :t].reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))


def cudnn_unsupported(dtype, head_dim: int) -> str | None:
  """Why cuDNN's fused kernel cannot take inputs of `dtype` and `head_dim`; None if it can."""
  name = jnp.dtype(dtype).name
  if name not in CUDNN_DTYPES:
    return f"it takes {' or '.join(CUDNN_DTYPES)} inputs, not {name}"
  if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
    return f"its head dim must be a multiple of 8 and at most {CUDNN_MAX_HEAD_DIM}, not {head_dim}"
  return None


def resolve(impl: str, *, cached: bool, packed: bool, t: int, s: int, dtype,
            head_dim: int) -> str:
  """The implementation `impl` ("auto" or explicit) stands for at these static shapes."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention={impl!r}; expected one of {IMPLEMENTATIONS}.")
  why_not = cudnn_unsupported(dtype, head_dim)
  if impl in CUDNN_IMPLEMENTATIONS and why_not:
    raise ValueError(f"attention={impl!r} cannot run: {why_not}. Use attention='auto', which "
                     "takes cuDNN only where it applies.")
  if impl == "ragged":
    # The ragged kernel runs before `attend` (qwen3.Attention, decode steps only).
    impl = "auto"
  if impl == "cudnn_packed" and not cached:
    return "cudnn_packed" if packed else "cudnn"
  cudnn_ok = not cached and not packed
  if impl in CUDNN_IMPLEMENTATIONS and not cudnn_ok:
    # Cached queries and packed rows need the general mask: cuDNN's padded-causal mask
    # cannot express them, so they take the memory-bounded pure-JAX kernel.
    return "blockwise"
  if impl != "auto":
    return impl
  if cudnn_ok and not why_not and jax.default_backend() == "gpu":
    return "cudnn"
  most = _AUTO_REFERENCE_MAX_TS if cached else _AUTO_REFERENCE_MAX_TS_UNCACHED
  return "reference" if t * s <= most else "blockwise"


def attend(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, *, q_idx_BxT, kv_valid_BxS, q_seg_BxT=None,
           kv_seg_BxS=None, impl: str = "auto", cached: bool = False, block: int = 512,
           decode_splits: int = 0, max_segments: int = 64):
  """Attention under the shared masking rule, by the implementation `impl` resolves to.

  Without a cache, rows must be right-padded (`kv_valid` a prefix) for cuDNN to apply.
  A decode step (cached, one query per row) with `decode_splits` > 1 takes `split_kv`.
  """
  t, s = q_BxKxGxTxH.shape[3], k_BxKxSxH.shape[2]
  packed = q_seg_BxT is not None
  if cached and t == 1 and decode_splits > 1 and not packed:
    return split_kv(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS,
                    splits=decode_splits)
  which = resolve(impl, cached=cached, packed=packed, t=t, s=s, dtype=q_BxKxGxTxH.dtype,
                  head_dim=q_BxKxGxTxH.shape[-1])
  if which == "reference":
    return query_chunked(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS,
                         q_seg_BxT, kv_seg_BxS)
  if which == "cudnn":
    return cudnn(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, kv_valid_BxS.sum(-1))
  if which == "cudnn_packed":
    return cudnn_packed(q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_seg_BxT,
                        max_segments=max_segments)
  tiles = lambda bq, bk: lambda q, k, v, q_idx, kv_valid, q_seg, kv_seg: blockwise(
      q, k, v, q_idx, kv_valid, q_seg, kv_seg, block_q=bq, block_kv=bk)
  args = (q_BxKxGxTxH, k_BxKxSxH, v_BxKxSxH, q_idx_BxT, kv_valid_BxS, q_seg_BxT, kv_seg_BxS)
  if impl != "auto" or block <= CPU_BLOCK:
    return tiles(block, block)(*args)
  # Smaller tiles where the program is lowered for a CPU (even ones of at most CPU_BLOCK:
  # 129 tokens are two tiles of 72, not of 128), the config's elsewhere.
  small = tiles(_even_tile(t, CPU_BLOCK), _even_tile(s, CPU_BLOCK))
  return jax.lax.platform_dependent(*args, cpu=small, default=tiles(block, block))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _even_tile(n: int, most: int) -> int:
  """The tile, a multiple of 8 of at most `most` (itself one), that cuts n into the fewest
  even tiles."""
  return min(most, 8 * _cdiv(_cdiv(n, _cdiv(n, most)), 8))
