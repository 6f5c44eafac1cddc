"""Cascade (shared-prefix) decode attention against plain softmax over prefix + own keys."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import models, sampling
from mgrpo_jax.compiled import hlo_stats
from mgrpo_jax.models import decode, prefix_attention

# 7 slots, 3 kv heads of 6 query heads, head dim 16; 3 pool rows of up to 3 members (row 1
# has two, row 2 one), slots 3 and 6 without a prefix; prefixes of 48 slots, suffixes of 32.
# A pool row's M * G = 18 query heads take two of the Pallas kernel's 16-row tiles: one
# block of 32.
B, K, G, H, P, M, L, S = 7, 3, 6, 16, 3, 3, 48, 32
MEMBERS = np.array([[0, 4, 5], [2, 1, B], [B, B, 6]])
POOL_ROW = np.array([0, 1, 1, P, 0, 0, 2])
# Row 2's single member slot 6 is moved off it below (own only), so row 2 has no reader.


def _case(dtype, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  pool_len = np.array([L, 17, 1])
  own_len = rng.integers(1, S + 1, B)
  own_len[2] = 0  # A slot that sees only its prefix.
  own_len[3] = S  # No prefix, a full suffix.
  pool_row = POOL_ROW.copy()
  members = MEMBERS.copy()
  pool_row[6], members[2, 2] = P, B  # Row 2 has no member: read, never used.
  arrays = dict(q=normal(B, K, G, 1, H), k=normal(B, K, S, H), v=normal(B, K, S, H),
                pk=normal(P, K, L, H), pv=normal(P, K, L, H))
  # Rounded to the compute dtype once, so the reference sees the same inputs.
  arrays = {n: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for n, a in arrays.items()}
  return arrays, own_len, pool_len, members, pool_row


def _numpy_reference(a, own_len, pool_len, pool_row):
  """Per slot: its prefix's keys and values then its own, one softmax over all of them."""
  out = np.zeros((B, K, G, 1, H), np.float64)
  for b in range(B):
    r = pool_row[b]
    n = pool_len[r] if r < P else 0
    pk = a["pk"][r, :, :n] if r < P else np.zeros((K, 0, H))
    pv = a["pv"][r, :, :n] if r < P else np.zeros((K, 0, H))
    keys = np.concatenate([pk, a["k"][b, :, :own_len[b]]], axis=1)  # [K, n + own, H]
    vals = np.concatenate([pv, a["v"][b, :, :own_len[b]]], axis=1)
    s = np.einsum("kgh,ksh->kgs", a["q"][b, :, :, 0].astype(np.float64), keys) / np.sqrt(H)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b, :, :, 0] = np.einsum("kgs,ksh->kgh", p / p.sum(-1, keepdims=True), vals)
  return out


def _run(fn, dtype, a, own_len, pool_len, members, pool_row, keys_minor: bool):
  cast = lambda x: jnp.asarray(x, dtype)
  k, pk = cast(a["k"]), cast(a["pk"])
  if keys_minor:  # The XLA layout: keys [N, K, H, S].
    k, pk = jnp.swapaxes(k, 2, 3), jnp.swapaxes(pk, 2, 3)
  return jax.jit(fn)(cast(a["q"]), k, cast(a["v"]), jnp.asarray(own_len, jnp.int32), pk,
                     cast(a["pv"]), jnp.asarray(pool_len, jnp.int32),
                     jnp.asarray(members, jnp.int32), jnp.asarray(pool_row, jnp.int32))


def test_member_index_and_gather_queries():
  members, pool_row = jnp.asarray(MEMBERS), jnp.asarray(POOL_ROW)
  np.testing.assert_array_equal(prefix_attention.member_index(members, pool_row),
                                [0, 1, 0, 0, 1, 2, 2])
  q = jnp.arange(B, dtype=jnp.float32)[:, None, None, None] + jnp.zeros((B, K, G, H))
  qs = prefix_attention.gather_queries(q, members)  # [P, K, M * G, H]
  assert qs.shape == (P, K, M * G, H)
  # Row 1's queries: slot 2's G heads, slot 1's, then zeros for the padded member.
  np.testing.assert_array_equal(qs[1, 0, :, 0], [2] * G + [1] * G + [0] * G)
  back = prefix_attention.scatter_back(qs, members, pool_row, G)
  np.testing.assert_array_equal(back[:, 0, 0, 0], [0, 1, 2, 0, 4, 5, 6])


def test_merge_is_softmax_over_the_union():
  rng = np.random.default_rng(1)
  s1, s2 = rng.normal(size=5), rng.normal(size=3)
  v1, v2 = rng.normal(size=(5, 4)), rng.normal(size=(3, 4))
  part = lambda s, v: (np.exp(s - s.max()) @ v / np.exp(s - s.max()).sum(),
                       np.log(np.exp(s).sum()))
  (o1, l1), (o2, l2) = part(s1, v1), part(s2, v2)
  want = part(np.concatenate([s1, s2]), np.concatenate([v1, v2]))[0]
  got = prefix_attention.merge([jnp.asarray(o1), jnp.asarray(o2)],
                               [jnp.asarray(l1), jnp.asarray(l2)])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # A set with nothing visible (-inf) weighs nothing; two such give zeros.
  got = prefix_attention.merge([jnp.asarray(o1), jnp.asarray(o2)],
                               [jnp.asarray(l1), -jnp.inf])
  np.testing.assert_allclose(got, o1, rtol=1e-6)
  got = prefix_attention.merge([jnp.ones(4), jnp.ones(4)], [-jnp.inf, -jnp.inf])
  np.testing.assert_array_equal(got, np.zeros(4))


PATHS = {"xla": (prefix_attention.cascade, True),
         "ragged": (functools.partial(prefix_attention.cascade_ragged, splits=2,
                                      interpret=True), False)}


def _every_slot(members):
  """The engine's members table, [P, B]: as wide as the slots (padded with B)."""
  return np.pad(members, ((0, 0), (0, B - members.shape[1])), constant_values=B)


# Members: M < B (the Pallas path gathers them) or the engine's [P, B] (it takes every slot).
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_equals_softmax_over_prefix_and_own(path, dtype, wide):
  a, own_len, pool_len, members, pool_row = _case(dtype)
  members = _every_slot(members) if wide else members
  want = _numpy_reference(a, own_len, pool_len, pool_row)
  fn, keys_minor = PATHS[path]
  with jax.default_matmul_precision("highest"):
    got = _run(fn, dtype, a, own_len, pool_len, members, pool_row, keys_minor)
  assert got.shape == (B, K, G, 1, H) and got.dtype == jnp.dtype(dtype)
  got = np.asarray(got.astype(jnp.float32))
  if dtype == "float32":
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  else:
    # bf16 probabilities and output: a few of its ulps (2^-8) on outputs of size ~1.
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2)


def test_slot_without_any_key_gives_zeros():
  a, own_len, pool_len, members, pool_row = _case("float32")
  own_len[3] = 0  # Slot 3: no prefix and an empty suffix (an idle slot).
  for (fn, keys_minor), table in zip([*PATHS.values()] * 2,
                                     [members] * 2 + [_every_slot(members)] * 2):
    got = _run(fn, jnp.float32, a, own_len, pool_len, table, pool_row, keys_minor)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[3], 0.0)


def test_no_per_slot_copy_of_the_pool_is_materialised():
  # The naive way gathers each slot's prefix, [B, K, L, H]; the cascade's largest arrays
  # are the inputs (own caches [B, K, S, H], the pool [P, K, L, H]) and the prefix's
  # scores [P, K, M * G, L], all smaller here.
  assert max(P * K * L * H, P * K * M * G * L) < B * K * S * H
  a, own_len, pool_len, members, pool_row = _case("float32")
  args = (a["q"], np.swapaxes(a["k"], 2, 3), a["v"], own_len.astype(np.int32),
          np.swapaxes(a["pk"], 2, 3), a["pv"], pool_len.astype(np.int32),
          members.astype(np.int32), pool_row.astype(np.int32))
  text = jax.jit(prefix_attention.cascade).lower(*args).compile().as_text()
  module = hlo_stats.parse(text)
  largest = max(arr.size for comp in module.computations.values()
                for instr in comp.instrs.values() for arr in instr.shape)
  assert largest == B * K * S * H  # The own caches, as given.
  assert B * K * L * H > largest


# A dense tiny model through the sampler's forward; head_dim 16, 3 groups of 2 query heads.
_CONFIG = models.Qwen3Config(vocab_size=131, hidden_size=46, intermediate_size=58,
                             num_layers=2, num_heads=6, num_kv_heads=3, head_dim=16,
                             rope_theta=10_000.0, max_position_embeddings=512)


@pytest.mark.parametrize("attention,interpret", [("auto", False), ("ragged", False),
                                                 ("ragged", True)])
def test_decode_steps_over_a_pool_row_equal_the_whole_context_in_the_slot(
    attention, interpret, monkeypatch):
  # Slots 0 and 1 read a 5-token prompt from pool row 0 and cache only their own tokens
  # (cache index j, RoPE position 5 + j); slot 2 has no prefix. Their logits equal those
  # of slots that hold the prompt themselves.
  if interpret:
    original = prefix_attention.decode
    monkeypatch.setattr(prefix_attention, "decode",
                        lambda *a, **kw: original(*a, interpret=True, **kw))
  cfg = models.Qwen3Config(**{**_CONFIG.__dict__, "attention": attention})
  dparams = sampling.decode_params(cfg, models.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.vocab_size, 5)
  own = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 4)))
  members = jnp.asarray([[0, 1, 3], [3, 3, 3]])
  pool_row, pool_len = jnp.asarray([0, 0, 2]), jnp.asarray([5, 0])
  offset = jnp.asarray([5, 5, 0])

  def run():
    pool = decode.init_cache(cfg, 2, 16)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    _, pool, _ = decode.forward(cfg, dparams, jnp.asarray([prompt, prompt]), positions, pool)
    whole = decode.init_cache(cfg, 3, 16)
    _, whole, _ = decode.forward(cfg, dparams, jnp.asarray([prompt] * 3),
                                 jnp.broadcast_to(jnp.arange(5), (3, 5)), whole)
    slots = decode.init_cache(cfg, 3, 16)
    got, want = [], []
    for j in range(own.shape[1]):
      tok = own[:, j:j + 1]
      logits, slots, _ = decode.forward(
          cfg, dparams, tok, jnp.full((3, 1), j), slots, rope_offset_B=offset,
          prefix=(pool, pool_len, members, pool_row))
      got.append(logits[:, 0])
      logits, whole, _ = decode.forward(cfg, dparams, tok, (offset + j)[:, None], whole)
      want.append(logits[:, 0])
    return jnp.stack(got, 1), jnp.stack(want, 1)

  with jax.default_matmul_precision("highest"):
    got, want = jax.jit(run)()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
