"""Attention kernels: blockwise and cuDNN equal the reference (forward and gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import models
from mgrpo_jax.models import attention, qwen3

# Prime sizes catch swapped axes; T is not a multiple of the blocks (padding inside).
B, K, G, T, H = 2, 2, 3, 37, 8


def _qkv(dtype=jnp.float32, seed=0, s=T):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, K, G, T, H)), dtype)
  k = jnp.asarray(rng.normal(size=(B, K, s, H)), dtype)
  v = jnp.asarray(rng.normal(size=(B, K, s, H)), dtype)
  return q, k, v


def _cases():
  q_idx = jnp.broadcast_to(jnp.arange(T), (B, T))
  lengths = np.array([T, 20])
  valid = jnp.arange(T)[None] < lengths[:, None]
  # Row 0: three packed sequences; row 1: two, then padding (segment 0).
  seg = np.stack([np.repeat([1, 2, 3], [10, 15, 12]),
                  np.r_[np.repeat([1, 2], [8, 12]), np.zeros(17, int)]])
  return {
      "padded": (q_idx, valid, None, None, valid),
      "packed": (q_idx, jnp.ones((B, T), bool), jnp.asarray(seg), jnp.asarray(seg),
                 jnp.asarray(seg > 0)),
  }


def _loss(fn, live_BxT):
  def f(q, k, v):
    o = fn(q, k, v).astype(jnp.float32)
    return jnp.sum(jnp.where(live_BxT[:, None, None, :, None], o * jnp.sin(o), 0.0))
  return f


@pytest.mark.parametrize("case", ["padded", "packed"])
@pytest.mark.parametrize("blocks", [(8, 8), (16, 8), (512, 512)])
def test_blockwise_equals_reference(case, blocks):
  q_idx, valid, qs, ks, live = _cases()[case]
  q, k, v = _qkv()
  ref = lambda q, k, v: attention.reference(q, k, v, q_idx, valid, qs, ks)
  blk = lambda q, k, v: attention.blockwise(q, k, v, q_idx, valid, qs, ks, block_q=blocks[0],
                                            block_kv=blocks[1])
  o_ref, o_blk = ref(q, k, v), jax.jit(blk)(q, k, v)
  w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], o_ref.shape)
  np.testing.assert_allclose(np.asarray(o_blk)[w], np.asarray(o_ref)[w], atol=2e-6)
  g_ref = jax.grad(_loss(ref, live), argnums=(0, 1, 2))(q, k, v)
  g_blk = jax.jit(jax.grad(_loss(blk, live), argnums=(0, 1, 2)))(q, k, v)
  assert float(jnp.abs(g_ref[1]).max()) > 1e-2  # Gradients are not trivially zero.
  for a, b in zip(g_blk, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("case", ["padded", "packed"])
@pytest.mark.parametrize("chunk,loop", [(1, None), (8, None), (16, None), (T, None),
                                        (8, False), (16, False)])
def test_query_chunked_equals_reference(case, chunk, loop):
  """Chunks of `chunk` queries (a score budget of that many query rows; T: one piece), by
  the platform's way (None: on CPU the loop), a loop or static slices (GPU's way)."""
  q_idx, valid, qs, ks, live = _cases()[case]
  q, k, v = _qkv()
  budget = chunk * B * K * G * T * 4
  ref = lambda q, k, v: attention.reference(q, k, v, q_idx, valid, qs, ks)
  chk = lambda q, k, v: attention.query_chunked(q, k, v, q_idx, valid, qs, ks,
                                                max_score_bytes=budget, loop=loop)
  w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], (B, K, G, T, H))
  np.testing.assert_allclose(np.asarray(jax.jit(chk)(q, k, v))[w],
                             np.asarray(ref(q, k, v))[w], atol=2e-6)
  g_ref = jax.grad(_loss(ref, live), argnums=(0, 1, 2))(q, k, v)
  g_chk = jax.jit(jax.grad(_loss(chk, live), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g_chk, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_attend_bounds_the_reference_scores_of_a_large_batch():
  """An evaluation's prefill (512 rows of 640 tokens, the CPU multihop agents' heads): the
  reference's temporaries hold the whole batch's scores (3.4 GB, 6.4 GB in all); "auto"
  keeps the reference's math in chunks of queries, so what it holds beside a few copies of
  the queries (320 MB) is one chunk's scores (`REFERENCE_MAX_SCORE_BYTES`)."""
  b, kh, g, t, h = 512, 2, 2, 640, 64
  shapes = (jax.ShapeDtypeStruct((b, kh, g, t, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, t, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, t, h), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), bool))
  temp = lambda fn: jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
  full = temp(attention.reference)
  bounded = temp(lambda q, k, v, i, m: attention.attend(q, k, v, q_idx_BxT=i, kv_valid_BxS=m,
                                                        cached=True))
  scores, queries = b * kh * g * t * t * 4, b * kh * g * t * h * 4
  assert full >= scores
  assert bounded <= 2 * queries + 2 * attention.REFERENCE_MAX_SCORE_BYTES < scores
  assert bounded < full / 4


def test_even_tiles_stay_within_the_most_and_are_as_few_as_its_tiles():
  """An even tile (of CPU attention; of query_chunked's chunks, where `most` is the rows the
  byte budget holds, rounded down to 8) never exceeds `most`, is a multiple of 8, and cuts n
  into no more pieces than tiles of `most` would, padding fewer than 8 rows per piece."""
  for most in (8, 16, 72, 128, 256, 1000 // 8 * 8):
    for n in (1, 7, 8, 9, 37, 100, 129, 511, 640, 1000, 4097):
      tile = attention._even_tile(n, most)
      pieces = -(-n // tile)
      assert tile <= most and tile % 8 == 0, (n, most, tile)
      assert pieces == -(-n // most), (n, most, tile)
      assert tile * pieces - n < 8 * pieces, (n, most, tile)


def test_query_chunked_gradient_keeps_one_chunk_of_scores():
  """Under jax.grad each chunk's scores are recomputed in the backward pass, not kept: the
  temporaries stay far below the reference's, whose backward keeps every score."""
  b, kh, g, t, h = 16, 2, 2, 512, 16
  shapes = (jax.ShapeDtypeStruct((b, kh, g, t, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, t, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, t, h), jnp.float32))
  q_idx = jnp.broadcast_to(jnp.arange(t), (b, t))
  valid = jnp.ones((b, t), bool)
  budget = 8 << 20  # A sixteenth of the batch's 128 MiB of scores.
  grad = lambda fn: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))
  temp = lambda fn: (jax.jit(grad(fn)).lower(*shapes).compile().memory_analysis()
                     .temp_size_in_bytes)
  full = temp(lambda q, k, v: attention.reference(q, k, v, q_idx, valid))
  chunked = temp(lambda q, k, v: attention.query_chunked(q, k, v, q_idx, valid,
                                                         max_score_bytes=budget))
  assert full >= b * kh * g * t * t * 4
  assert chunked < full / 3


def test_auto_train_rows_take_cpu_tiles_and_equal_reference():
  """"auto" on packed train rows past 128 x 128: the blockwise kernel, in CPU_BLOCK tiles
  where lowered for a CPU (lax.platform_dependent), the config's block where lowered for a
  GPU; the same outputs and gradients as the reference."""
  t = 256
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(B, K, G, t, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, K, t, H)), jnp.float32) for _ in range(2))
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [100, 90, 66]),
                              np.r_[np.repeat([1, 2], [130, 100]), np.zeros(26, int)]]))
  q_idx = jnp.broadcast_to(jnp.arange(t), (B, t))
  valid = jnp.ones((B, t), bool)
  ref = lambda q, k, v: attention.reference(q, k, v, q_idx, valid, seg, seg)
  auto = lambda q, k, v: attention.attend(q, k, v, q_idx_BxT=q_idx, kv_valid_BxS=valid,
                                          q_seg_BxT=seg, kv_seg_BxS=seg, block=512)
  live = seg > 0
  w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], q.shape)
  np.testing.assert_allclose(np.asarray(jax.jit(auto)(q, k, v))[w], np.asarray(ref(q, k, v))[w],
                             atol=2e-6)
  g_ref = jax.grad(_loss(ref, live), argnums=(0, 1, 2))(q, k, v)
  g_auto = jax.jit(jax.grad(_loss(auto, live), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g_auto, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5)
  # Lowered for the CPU, the queries are blocked [t / CPU_BLOCK, B, K, G, CPU_BLOCK, H]; the
  # config's 512 would make one block of all 256.
  hlo = jax.jit(auto).lower(q, k, v).as_text()
  tile = attention.CPU_BLOCK
  assert f"tensor<{t // tile}x{B}x{K}x{G}x{tile}x{H}xf32>" in hlo
  assert f"tensor<1x{B}x{K}x{G}x{t}x{H}xf32>" not in hlo
  # Lowered for a GPU (no device needed to lower), the config's block: one tile of 256.
  gpu = jax.jit(auto).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert f"tensor<1x{B}x{K}x{G}x{t}x{H}xf32>" in gpu
  assert f"tensor<{t // tile}x{B}x{K}x{G}x{tile}x{H}xf32>" not in gpu


def test_blockwise_bf16_close_to_reference():
  q_idx, valid, qs, ks, live = _cases()["packed"]
  q, k, v = _qkv(jnp.bfloat16)
  o_ref = attention.reference(q.astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32), q_idx, valid, qs, ks)
  o_blk = attention.blockwise(q, k, v, q_idx, valid, qs, ks, block_q=16, block_kv=8)
  assert o_blk.dtype == jnp.bfloat16
  w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], o_ref.shape)
  err = np.abs(np.asarray(o_blk, np.float32) - np.asarray(o_ref))[w]
  assert err.max() < 3e-2 and err.mean() < 5e-3


def test_blockwise_cached_queries():
  # Decode-style queries at arbitrary per-row positions against a longer cache.
  s = 53
  q, k, v = _qkv(s=s)
  pos = jnp.asarray(np.stack([np.arange(10, 10 + T), np.arange(T) + 16]))
  valid = jnp.arange(s)[None] < jnp.asarray([[47], [53]])
  o_ref = attention.reference(q, k, v, pos, valid)
  o_blk = attention.blockwise(q, k, v, pos, valid, block_q=8, block_kv=16)
  np.testing.assert_allclose(o_blk, o_ref, atol=2e-6)


@pytest.mark.parametrize("splits", [1, 2, 5, 53, 64])
def test_split_kv_decode_equals_reference(splits):
  # One query per row at its own position (the decode step), against a cache of 53 slots
  # (prime: chunks do not divide it); row 1 has invalid slots at its end.
  s = 53
  q, k, v = _qkv(s=s)
  q = q[:, :, :, :1]
  pos = jnp.asarray([[40], [51]])
  valid = jnp.arange(s)[None] < jnp.asarray([[53], [47]])
  o_ref = attention.reference(q, k, v, pos, valid)
  o = jax.jit(attention.split_kv, static_argnames="splits")(q, k, v, pos, valid,
                                                             splits=splits)
  np.testing.assert_allclose(o, o_ref, atol=2e-6)
  via = attention.attend(q, k, v, q_idx_BxT=pos, kv_valid_BxS=valid, cached=True,
                         decode_splits=splits)
  np.testing.assert_allclose(via, o_ref, atol=2e-6)


def test_split_kv_bf16_close_to_reference():
  s = 53
  q, k, v = _qkv(jnp.bfloat16, s=s)
  q, pos, valid = q[:, :, :, :1], jnp.asarray([[30], [52]]), jnp.ones((B, s), bool)
  up = lambda x: x.astype(jnp.float32)
  o_ref = attention.reference(up(q), up(k), up(v), pos, valid)
  o = jax.jit(attention.split_kv, static_argnames="splits")(q, k, v, pos, valid, splits=4)
  assert o.dtype == jnp.bfloat16
  assert float(jnp.abs(up(o) - o_ref).max()) < 3e-2


def test_cudnn_call_layout_matches_reference():
  # The cuDNN wrapper's transposes, GQA grouping and lengths, run through XLA on CPU.
  q_idx, valid, _, _, live = _cases()["padded"]
  q, k, v = _qkv()
  o_ref = attention.reference(q, k, v, q_idx, valid)
  o = attention.cudnn(q, k, v, valid.sum(-1), implementation="xla")
  w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], o_ref.shape)
  np.testing.assert_allclose(np.asarray(o)[w], np.asarray(o_ref)[w], atol=2e-6)


def test_cudnn_packed_segments_describe_the_rows():
  # cuDNN's sequence packing: each row's segment lengths and start offsets, -1 past its last
  # segment; attention within each described segment equals the packed reference.
  q_idx, valid, seg, _, live = _cases()["packed"]
  describe = jax.jit(attention.segment_lengths_and_offsets, static_argnums=1)
  lengths, offsets = describe(seg, 6)
  np.testing.assert_array_equal(lengths, [[10, 15, 12, -1, -1, -1], [8, 12, -1, -1, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 10, 25, 37, -1, -1, -1],
                                          [0, 8, 20, -1, -1, -1, -1]])
  # A bound of 3 segments holds row 0 exactly.
  np.testing.assert_array_equal(describe(seg, 3)[1], [[0, 10, 25, 37], [0, 8, 20, -1]])
  q, k, v = _qkv()
  o_ref = np.asarray(attention.reference(q, k, v, q_idx, valid, seg, seg))
  for b in range(B):
    for n, start in zip(np.asarray(lengths[b]), np.asarray(offsets[b])):
      if n < 0:
        break
      span = slice(start, start + n)
      alone = attention.reference(q[b:b + 1, :, :, span], k[b:b + 1, :, span],
                                  v[b:b + 1, :, span], q_idx[b:b + 1, :n],
                                  jnp.ones((1, n), bool))
      np.testing.assert_allclose(o_ref[b:b + 1, :, :, span], alone, atol=2e-6)


def test_cudnn_packed_is_the_fused_call_compiled_for_an_h100(monkeypatch, h100_device):
  # Deviceless: the packed kernel lowers to cuDNN's fused attention custom call for an
  # H100 target (XLA:GPU's pipeline on this CPU; needs the CUDA wheels, jax[cuda12]).
  from jax._src.cudnn import fused_attention_stablehlo
  # jax asks the local GPU for its compute capability (packing needs Hopper); there is
  # none here, so it is told the target's: an H100, 9.0.
  monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability",
                      lambda c: tuple(map(int, c.split("."))) <= (9, 0))
  _, _, seg, _, live = _cases()["packed"]
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16,
                                         sharding=jax.sharding.SingleDeviceSharding(h100_device))
  q, k, v = _qkv()
  hb = 16  # cuDNN's head dim: a multiple of 8.
  q, k, v = (jnp.concatenate([x, x], -1) for x in (q, k, v))
  assert q.shape[-1] == hb
  fused = lambda q, k, v: attention.cudnn_packed(q, k, v, jnp.asarray(seg), max_segments=4)
  grad = jax.grad(_loss(fused, live), argnums=(0, 1, 2))
  hlo = jax.jit(grad).lower(shape(q), shape(k), shape(v)).compile().as_text()
  assert 'custom_call_target="__cudnn$fmhaSoftmax"' in hlo
  assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in hlo


def test_resolve():
  r = functools.partial(attention.resolve, dtype=jnp.bfloat16, head_dim=128)
  on_gpu = jax.default_backend() == "gpu"
  assert r("reference", cached=False, packed=False, t=9, s=9) == "reference"
  assert r("cudnn", cached=True, packed=False, t=1, s=64) == "blockwise"
  assert r("cudnn", cached=False, packed=True, t=64, s=64) == "blockwise"
  assert r("auto", cached=False, packed=False, t=64, s=64) == (
      "cudnn" if on_gpu else "reference")
  # The train step's rows past 128 x 128 take the blockwise kernel (faster on CPU under
  # grad from 128 tokens on); the sampler's cached queries keep the reference to 1024 x 1024.
  assert r("auto", cached=False, packed=True, t=128, s=128) == "reference"
  assert r("auto", cached=False, packed=True, t=256, s=256) == "blockwise"
  assert r("auto", cached=True, packed=False, t=1024, s=1024) == "reference"
  # CPU tiles cut a length into the fewest even tiles (129 tokens: two of 72, not of 128).
  assert [attention._even_tile(n, 128) for n in (37, 128, 129, 256, 300)] == [
      40, 128, 72, 128, 104]
  assert r("auto", cached=True, packed=False, t=4096, s=4096) == "blockwise"
  # cuDNN for packed rows only when asked for by name ("auto" keeps blockwise there).
  assert r("cudnn_packed", cached=False, packed=True, t=64, s=64) == "cudnn_packed"
  assert r("cudnn_packed", cached=False, packed=False, t=64, s=64) == "cudnn"
  assert r("cudnn_packed", cached=True, packed=True, t=1, s=64) == "blockwise"
  assert r("auto", cached=False, packed=True, t=4096, s=4096) == "blockwise"
  with pytest.raises(ValueError, match="attention='flash'"):
    r("flash", cached=False, packed=False, t=1, s=1)
  with pytest.raises(models.ConfigError, match="attention"):
    models.get_preset("tiny", attention="flash")
  with pytest.raises(models.ConfigError, match="attention_max_segments must be an int >= 1"):
    models.get_preset("tiny", attention_max_segments=0)


@pytest.mark.parametrize("dtype,head_dim", [(jnp.float32, 128), (jnp.bfloat16, 20),
                                            (jnp.bfloat16, 256)])
def test_auto_takes_cudnn_only_for_inputs_it_accepts(dtype, head_dim):
  # cuDNN's fused kernel raises on float32 and on odd or large head dims: "auto" must not
  # pick it there (float32 test models on a GPU), and an explicit "cudnn" says why.
  r = functools.partial(attention.resolve, dtype=dtype, head_dim=head_dim, cached=False,
                        packed=False)
  assert r("auto", t=64, s=64) == "reference" and r("auto", t=4096, s=4096) == "blockwise"
  with pytest.raises(ValueError, match="cannot run: its? .*not (float32|20|256)"):
    r("cudnn", t=64, s=64)
  if dtype == jnp.float32:
    with pytest.raises(models.ConfigError, match="compute_dtype='float32'.*attention='auto'"):
      models.get_preset("qwen3_0p6b", attention="cudnn", compute_dtype="float32")
  models.get_preset("qwen3_0p6b", attention="cudnn", compute_dtype="bfloat16")  # Accepted.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(jnp.bfloat16, 3e-2), (jnp.float16, 5e-3)])
def test_cudnn_equals_reference_on_gpu(dtype, atol):
  # cuDNN's fused kernel takes half-precision inputs only; the reference runs in float32.
  q_idx, valid, _, _, live = _cases()["padded"]
  q, k, v = _qkv(dtype)
  with jax.default_matmul_precision("highest"):
    ref = lambda q, k, v: attention.reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                              v.astype(jnp.float32), q_idx, valid)
    fused = lambda q, k, v: attention.cudnn(q, k, v, valid.sum(-1))
    w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], q.shape)
    np.testing.assert_allclose(np.asarray(fused(q, k, v), np.float32)[w],
                               np.asarray(ref(q, k, v), np.float32)[w], atol=atol)
    g_ref = jax.grad(_loss(ref, live), argnums=(0, 1, 2))(q, k, v)
    g_cud = jax.grad(_loss(fused, live), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_cud, g_ref):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 atol=10 * atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(jnp.bfloat16, 3e-2), (jnp.float16, 5e-3)])
def test_cudnn_packed_equals_reference_on_gpu(dtype, atol):
  # Packed rows (segment ids, trailing padding) through cuDNN's sequence packing, against
  # the float32 reference on the real tokens; head dim 16 (cuDNN: a multiple of 8).
  q_idx, valid, seg, _, live = _cases()["packed"]
  q, k, v = (jnp.concatenate([x, -x], -1) for x in _qkv(dtype))
  with jax.default_matmul_precision("highest"):
    ref = lambda q, k, v: attention.reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                              v.astype(jnp.float32), q_idx, valid, seg, seg)
    fused = jax.jit(lambda q, k, v: attention.cudnn_packed(q, k, v, seg, max_segments=4))
    w = np.broadcast_to(np.asarray(live)[:, None, None, :, None], q.shape)
    np.testing.assert_allclose(np.asarray(fused(q, k, v), np.float32)[w],
                               np.asarray(ref(q, k, v), np.float32)[w], atol=atol)
    g_ref = jax.grad(_loss(ref, live), argnums=(0, 1, 2))(q, k, v)
    g_cud = jax.jit(jax.grad(_loss(fused, live), argnums=(0, 1, 2)))(q, k, v)
    assert float(jnp.abs(g_ref[1]).max()) > 1e-2
    for a, b in zip(g_cud, g_ref):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 atol=10 * atol)


def test_model_blockwise_and_packed_equal_reference():
  cfg = models.Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 61, 11), rng.integers(0, 61, 17)
  # Two sequences packed in one row of 32 (positions restart, 4 padding tokens).
  tokens = np.zeros((1, 32), np.int32)
  tokens[0, :11], tokens[0, 11:28] = a, b
  seg = np.r_[np.ones(11), np.full(17, 2), np.zeros(4)].astype(np.int32)[None]
  pos = np.r_[np.arange(11), np.arange(17), np.zeros(4)].astype(np.int32)[None]
  for impl in ("reference", "blockwise"):
    c = cfg.replace(attention=impl, attention_block=8)
    packed, _ = qwen3.forward(c, params, jnp.asarray(tokens), jnp.asarray(pos),
                              segment_ids_BxT=jnp.asarray(seg))
    for x, span in ((a, slice(0, 11)), (b, slice(11, 28))):
      alone = models.logits(cfg.replace(attention="reference"), params, jnp.asarray(x)[None],
                            jnp.ones((1, len(x)), bool))
      np.testing.assert_allclose(packed[0, span], alone[0], atol=2e-5)


def test_cache_writes_in_place_and_drop_past_the_end():
  # Rows write T contiguous positions; a row whose write runs past the last slot keeps its
  # earlier slots (dynamic_update_slice would otherwise clamp and overwrite them).
  s, t = 10, 4
  cache = jnp.arange(2 * 1 * s * 1, dtype=jnp.float32).reshape(2, 1, s, 1)
  new = -jnp.arange(1, 2 * t + 1, dtype=jnp.float32).reshape(2, 1, t, 1)
  out = qwen3._write_rows(cache, new, jnp.asarray([3, 8]))
  want = np.array(cache)
  want[0, 0, 3:7, 0] = [-1, -2, -3, -4]
  want[1, 0, 8:10, 0] = [-5, -6]  # Positions 10 and 11 are dropped.
  np.testing.assert_array_equal(out, want)
  stopped = qwen3._write_rows(cache, new[:, :, :1], jnp.asarray([s, s]))  # Slot s: nowhere.
  np.testing.assert_array_equal(stopped, cache)
  # A decode step (one slot per row) writes each row at its own position.
  one = qwen3._write_rows(cache, new[:, :, :1], jnp.asarray([s - 1, 0]))
  want = np.array(cache)
  want[0, 0, s - 1, 0], want[1, 0, 0, 0] = -1, -5
  np.testing.assert_array_equal(one, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_writes_along_the_slot_axis_of_either_layout(dtype):
  # The sampler's keys are [B, K, H, S] (slots minor, axis=3), its values [B, K, S, H]; a
  # bf16 cache is written through its bits. Both must land exactly where axis 2 lands.
  b, k, s, h, t = 3, 2, 7, 5, 3
  cache = jnp.arange(b * k * s * h).reshape(b, k, s, h).astype(dtype)
  new = -jnp.arange(1, b * k * t * h + 1).reshape(b, k, t, h).astype(dtype)
  for start in ([0, 4, s], [6, 2, 5]):  # Row 2 of the first: past the end, dropped.
    start = jnp.asarray(start)
    for n in (new[:, :, :1], new):  # A decode step (one slot) and a prefill chunk.
      want = qwen3._write_rows(cache.astype(jnp.float32), n.astype(jnp.float32), start)
      got = qwen3._write_rows(cache, n, start)
      got_t = qwen3._write_rows(jnp.swapaxes(cache, 2, 3), jnp.swapaxes(n, 2, 3), start, axis=3)
      assert got.dtype == got_t.dtype == dtype
      np.testing.assert_array_equal(np.asarray(got, np.float32), want)
      np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got_t, 2, 3), np.float32), want)
