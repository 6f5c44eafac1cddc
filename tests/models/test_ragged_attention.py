"""The ragged decode attention (jax's Pallas decode kernel) against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.compiled import hlo_stats
from mgrpo_jax import models, sampling, sharding
from mgrpo_jax.models import attention, decode, qwen3, ragged_attention

# Three kv heads of four query heads each; 256 slots; rows from 1 slot to the full cache,
# and lengths on both sides of a 16-slot block and a 128-slot part.
B, K, G, S, H = 6, 3, 4, 256, 16
LENGTHS = (1, 256, 17, 128, 129, 200)


def _qkv(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, K, G, 1, H)), dtype)
  k = jnp.asarray(rng.normal(size=(B, K, S, H)), dtype)
  v = jnp.asarray(rng.normal(size=(B, K, S, H)), dtype)
  return q, k, v


def _reference(q, k, v, pos):
  up = lambda x: x.astype(jnp.float32)
  return attention.reference(up(q), up(k), up(v), pos, jnp.ones((B, S), bool))


def test_tiles_cut_the_cache_evenly():
  assert ragged_attention.tiles(8192) == (16, 128)
  assert ragged_attention.tiles(256, 16, 128) == (16, 16)
  assert ragged_attention.tiles(256, 3, 128) == (2, 128)
  assert ragged_attention.tiles(96) == (6, 16)
  assert ragged_attention.tiles(16) == (1, 16)
  assert ragged_attention.tiles(4096, 1, 64) == (1, 64)
  with pytest.raises(ValueError, match="multiple of 16"):
    ragged_attention.tiles(100)


def test_slots_read_round_each_row_up_to_a_key_block():
  # 8192 slots: key blocks of 128. 1 -> 128, 128 -> 128, 129 -> 256, 8192 -> 8192.
  assert ragged_attention.slots_read([1, 128, 129, 8192], 8192) == 128 + 128 + 256 + 8192
  # 256 slots in 16 parts: blocks of 16. 17 -> 32; a length past the cache reads all of it.
  assert ragged_attention.slots_read([17, 300], 256) == 32 + 256


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_kernel_equals_reference(splits):
  # The Pallas kernel itself (interpreted on CPU), float32 with exact matmuls.
  q, k, v = _qkv()
  pos = jnp.asarray(LENGTHS)[:, None] - 1
  with jax.default_matmul_precision("highest"):
    want = _reference(q, k, v, pos)
    got = jax.jit(functools.partial(ragged_attention.decode, window=S, splits=splits,
                                    interpret=True))(q, k, v, pos)
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)


@pytest.mark.devices(6)
def test_kernel_runs_per_shard_of_rows_and_kv_heads():
  # Under a mesh, each device runs the kernel over its own rows (data=2) and kv heads
  # (tensor=3), as the cache is sharded; the result is the reference's.
  mesh = sharding.make_mesh(dict(data=2, fsdp=1, tensor=3, expert=1), jax.devices()[:6])
  q, k, v = _qkv()
  pos = jnp.asarray(LENGTHS)[:, None] - 1
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH, "tensor"))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
  run = jax.jit(functools.partial(ragged_attention.decode, window=S, interpret=True))
  with jax.default_matmul_precision("highest"), jax.set_mesh(mesh):
    got = run(q, k, v, pos)
    text = run.lower(q, k, v, pos).compile().as_text()
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(got, _reference(q, k, v, pos), atol=2e-6, rtol=1e-6)
  assert got.sharding.spec[:2] == spec.spec[:2]
  assert "all-gather" not in text and "all-to-all" not in text


def test_kernel_reads_nothing_past_a_row_length():
  # Slots past a row's length hold garbage (a finite 1e4, as a stale longer row might):
  # the output does not change.
  q, k, v = _qkv()
  pos = jnp.asarray(LENGTHS)[:, None] - 1
  past = jnp.arange(S)[None, None, :, None] > pos[:, :, None, None]
  k2, v2 = jnp.where(past, 1e4, k), jnp.where(past, -1e4, v)
  run = jax.jit(functools.partial(ragged_attention.decode, window=S, interpret=True))
  with jax.default_matmul_precision("highest"):
    np.testing.assert_array_equal(run(q, k2, v2, pos), run(q, k, v, pos))


def test_kernel_bf16_close_to_reference():
  q, k, v = _qkv(jnp.bfloat16)
  pos = jnp.asarray(LENGTHS)[:, None] - 1
  with jax.default_matmul_precision("highest"):
    want = _reference(q, k, v, pos)
  got = jax.jit(functools.partial(ragged_attention.decode, window=S, interpret=True))(
      q, k, v, pos)
  assert got.dtype == jnp.bfloat16
  # bf16 inputs and outputs; the kernel keeps each part's partial output in bf16 too.
  assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 5e-3), (jnp.bfloat16, 3e-2)])
def test_kernel_equals_reference_on_gpu(dtype, atol):
  # The compiled Triton kernel and its merge (f32 matmuls may run in TF32 there).
  q, k, v = _qkv(dtype)
  pos = jnp.asarray(LENGTHS)[:, None] - 1
  with jax.default_matmul_precision("highest"):
    want = _reference(q, k, v, pos)
  got = jax.jit(functools.partial(ragged_attention.decode, window=S))(q, k, v, pos)
  assert bool(jnp.isfinite(got.astype(jnp.float32)).all())
  assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < atol


def test_off_gpu_the_window_path_gives_the_same():
  # On CPU `decode` runs the XLA path over the window (every row within it).
  q, k, v = _qkv()
  pos = jnp.asarray(LENGTHS)[:, None] - 1
  pos = jnp.minimum(pos, 199)
  with jax.default_matmul_precision("highest"):
    want = _reference(q, k, v, pos)
    got = jax.jit(functools.partial(ragged_attention.decode, window=208))(q, k, v, pos)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)


# A dense tiny model; head_dim 16 and 3 groups of 2 query heads.
_CONFIG = models.Qwen3Config(vocab_size=131, hidden_size=46, intermediate_size=58,
                             num_layers=2, num_heads=6, num_kv_heads=3, head_dim=16,
                             rope_theta=10_000.0, max_position_embeddings=512)


def _decode_logits(config, dparams, tokens_BxT, split_B):
  """Prefill of each row's first tokens, then 4 steps, row b at position split_b + j; the
  cache grows from 16 to 32 slots after the second step."""
  b, t = tokens_BxT.shape
  cache = decode.init_cache(config, b, 16)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  _, cache, _ = decode.forward(config, dparams, tokens_BxT, positions, cache)
  out = []
  for j in range(4):
    if j == 2:
      cache = decode.pad_cache(config, cache, 32)
    pos_B = split_B + j
    tok_B = jnp.take_along_axis(tokens_BxT, jnp.minimum(pos_B, t - 1)[:, None], axis=1)
    logits, cache, _ = decode.forward(config, dparams, tok_B, pos_B[:, None], cache)
    out.append(logits[:, 0])
  return jnp.stack(out, 1), cache


@pytest.mark.parametrize("interpret", [False, True])
def test_model_decode_steps_equal_the_xla_layout(interpret, monkeypatch):
  # The sampler's decode steps with attention="ragged" (keys stored [B, K, S, H]) give the
  # logits of the default layout; `interpret` runs the kernel itself inside the model.
  calls = []
  if interpret:
    original = ragged_attention.decode
    def interpreted(*args, **kwargs):
      calls.append(1)
      return original(*args, interpret=True, **kwargs)
    monkeypatch.setattr(ragged_attention, "decode", interpreted)
  ragged = models.Qwen3Config(**{**_CONFIG.__dict__, "attention": "ragged"})
  params = qwen3.init_params(_CONFIG, jax.random.key(0))
  dparams = sampling.decode_params(_CONFIG, params)
  tokens = jax.random.randint(jax.random.key(2), (4, 11), 0, _CONFIG.vocab_size)
  split = jnp.asarray([0, 3, 7, 13])  # Row 3 decodes past the first 16 slots.
  with jax.default_matmul_precision("highest"):
    # A new function per run: jit's cache would otherwise hand the second parameter the
    # program traced before the kernel was patched in.
    run = lambda c: jax.jit(lambda *a: _decode_logits(c, *a))(dparams, tokens, split)
    want, cache = run(_CONFIG)
    got, rcache = run(ragged)
  assert cache.k[0].shape == (4, 3, 16, 32) and rcache.k[0].shape == (4, 3, 32, 16)
  np.testing.assert_allclose(np.swapaxes(rcache.k[0], 2, 3), cache.k[0], atol=1e-6)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  assert decode.key_slot_axis(ragged) == 2 and decode.key_slot_axis(_CONFIG) == 3
  # Traced with the kernel: each layer's 4 decode steps (the prefill takes "auto").
  assert len(calls) == (4 * _CONFIG.num_layers if interpret else 0)


def test_sampler_greedy_tokens_are_the_same_with_ragged():
  # The sampler end to end (prefill, then decode chunks; its cache holds every row here):
  # greedy tokens and log-probs of attention="ragged" equal the default's.
  ragged = models.Qwen3Config(**{**_CONFIG.__dict__, "attention": "ragged"})
  params = qwen3.init_params(_CONFIG, jax.random.key(0))
  prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 9, 6], [11]]
  out = {c.attention: sampling.generate(c, params, prompts, max_new_tokens=12,
                                        temperature=0.0, key=jax.random.key(3))
         for c in (_CONFIG, ragged)}
  np.testing.assert_array_equal(out["ragged"].tokens, out["auto"].tokens)
  np.testing.assert_allclose(out["ragged"].logprobs, out["auto"].logprobs, atol=1e-5)


def test_config_refuses_a_head_dim_the_kernel_cannot_tile():
  with pytest.raises(models.ConfigError, match="head_dim=14.*powers of two"):
    models.Qwen3Config(**{**_CONFIG.__dict__, "head_dim": 14, "attention": "ragged"})
  models.Qwen3Config(**{**_CONFIG.__dict__, "head_dim": 14})  # Accepted by the others.


def test_ragged_is_auto_outside_decode_steps():
  r = functools.partial(attention.resolve, dtype=jnp.float32, head_dim=16)
  assert r("ragged", cached=True, packed=False, t=64, s=64) == r(
      "auto", cached=True, packed=False, t=64, s=64)
  assert r("ragged", cached=False, packed=True, t=256, s=256) == "blockwise"


def test_kernel_is_a_triton_call_compiled_for_an_h100(h100_device):
  # Deviceless: the decode step's attention lowers to the Pallas (Triton) kernel for an
  # H100 target and XLA:GPU compiles it on this CPU (needs the CUDA wheels, jax[cuda12]).
  one = jax.sharding.SingleDeviceSharding(h100_device)
  shape = lambda x, dt=jnp.bfloat16: jax.ShapeDtypeStruct(x.shape, dt, sharding=one)
  q, k, v = _qkv()
  pos = jnp.zeros((B, 1), jnp.int32)
  run = functools.partial(ragged_attention.decode, window=S)
  hlo = jax.jit(run).lower(shape(q), shape(k), shape(v), shape(pos, jnp.int32)).compile()
  module = hlo_stats.parse(hlo.as_text())
  runs = list(module.executed())
  assert [i.custom_call_target for i, _, _ in runs if i.custom_call_target] == [
      "__gpu$xla.gpu.triton"]
  # No copy of the cache: the kernel reads keys and values where they lie, and every
  # kernel writes less than half of one of them (its per-part outputs, their merge).
  written = [module.bytes_written(i, c) for i, _, c in runs]
  assert max(written) < k.size * 2 / 2
