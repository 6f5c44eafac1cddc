"""Packing and chunked scoring: packed losses and gradients equal the padded batch's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mgrpo_jax import models, sharding
from mgrpo_jax.rl import losses, packing
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.rl.batch import Batch

CFG = models.Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)


def _batch(b=8, t=29, seed=0):
  """Rows of different lengths: prompt, generated tokens, a tool reply, more generation."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, CFG.vocab_size, (b, t)).astype(np.int32)
  mask = np.zeros((b, t), np.float32)
  for i in range(b):
    end = rng.randint(9, t + 1)
    mask[i, 3:end] = 1
    mask[i, 6:8] = 0  # Tool output inside the episode.
    tokens[i, end:] = 0  # Right padding.
  mask[1] = 0  # A row with nothing to learn from.
  old = np.where(mask > 0, -rng.uniform(0.1, 3, (b, t)), 0).astype(np.float32)
  return {"tokens": tokens, "loss_mask": mask, "old_logp": old,
          "adv": rng.randn(b).astype(np.float32)}


def test_pack_layout():
  batch = _batch()
  p = packing.pack(batch, max_tokens_per_micro=64, agg="seq-mean-token-mean", min_len=8)
  m, r, l = p["tokens"].shape
  assert r * l <= 64 and l == 32
  # Every row with loss tokens is packed once, whole up to its last loss token.
  lengths = packing._lengths(batch["loss_mask"])
  assert lengths[1] == 0
  seqs = []
  for row_tok, row_seg, row_pos in zip(p["tokens"].reshape(-1, l), p["segment_ids"].reshape(-1, l),
                                       p["positions"].reshape(-1, l)):
    for s in range(1, row_seg.max() + 1):
      idx = np.flatnonzero(row_seg == s)
      assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1))  # Contiguous.
      np.testing.assert_array_equal(row_pos[idx], np.arange(len(idx)))
      seqs.append(tuple(row_tok[idx]))
  want = [tuple(batch["tokens"][i, :n]) for i, n in enumerate(lengths) if n]
  assert sorted(seqs) == sorted(want)
  assert p["loss_mask"].sum() == batch["loss_mask"][:, 1:].sum()
  assert float(p["denominator"]) == 7.0  # Sequences with >= 1 loss token.
  tm = packing.pack(batch, max_tokens_per_micro=64, agg="token-mean", min_len=8)
  assert float(tm["denominator"]) == batch["loss_mask"][:, 1:].sum()
  with pytest.raises(ValueError, match="max_tokens_per_micro=16"):
    packing.pack(batch, max_tokens_per_micro=16, agg="token-mean")


def _with_copies(batch, copies=(0, 0, 3, 5, 0)):
  """`batch` with rows `copies` appended again: M-GRPO's aligned rows repeat calls."""
  idx = np.concatenate([np.arange(len(batch["tokens"])), copies])
  return {k: v[idx] for k, v in batch.items()}


def _segments(segment_ids) -> int:
  """How many sequences packed rows hold."""
  ids = np.asarray(segment_ids)
  return int(sum(len(set(r[r > 0])) for r in ids.reshape(-1, ids.shape[-1])))


def test_pack_packs_identical_rows_once():
  batch = _with_copies(_batch())  # Row 0 four times, rows 3 and 5 twice: 13 rows.
  kw = dict(max_tokens_per_micro=64, agg="seq-mean-token-mean", min_len=8)
  once, every = packing.pack(batch, **kw), packing.pack(batch, **kw, dedupe=False)
  segments = lambda p: _segments(p["segment_ids"])
  # Row 1 has no loss token: it is never packed, nor counted.
  assert segments(every) == 12 and segments(once) == 12 - 5
  assert once["denominator"] == every["denominator"] == 12
  # A kept row's loss mask is weighted by its copies, its seq_tokens are one copy's: the
  # masks sum to the batch's either way.
  assert once["loss_mask"].max() == 4.0 and every["loss_mask"].max() == 1.0
  for p in (once, every):
    np.testing.assert_allclose(p["loss_mask"].sum(), batch["loss_mask"][:, 1:].sum())
  assert set(np.unique(once["seq_tokens"])) == set(np.unique(every["seq_tokens"]))
  # Rows that differ anywhere (here only in their advantage) are not copies.
  batch["adv"][-1] += 1.0
  assert segments(packing.pack(batch, **kw)) == 12 - 4


def test_packed_step_keeps_copies_with_a_router_aux_loss():
  """The router aux loss is a function of the tokens each micro-batch routes: copies stay."""
  moe = CFG.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  segments = lambda b: _segments(b.segment_ids)
  batch = Batch(**_with_copies(_batch()))
  prepare = lambda cfg, **kw: ts.make_train_step(cfg, ts.LossConfig(), optax.sgd(1.0),
                                                 max_tokens_per_micro=64, **kw).prepare(batch)
  assert segments(prepare(moe)) == segments(prepare(CFG)) == 12 - 5
  assert segments(prepare(moe.replace(router_aux_loss_coef=0.01))) == 12
  assert segments(prepare(CFG, dedupe_rows=False)) == 12


def test_pack_rows_multiple():
  p = packing.pack(_batch(), max_tokens_per_micro=64, agg="token-mean", min_len=8,
                   rows_multiple=4)
  assert p["tokens"].shape[1] % 4 == 0


def test_pack_max_segments():
  # cuDNN's packed attention describes a bounded number of sequences per row.
  free = packing.pack(_batch(), max_tokens_per_micro=64, agg="token-mean", min_len=8)
  assert free["segment_ids"].max() > 1
  capped = packing.pack(_batch(), max_tokens_per_micro=64, agg="token-mean", min_len=8,
                        max_segments=1)
  assert capped["segment_ids"].max() == 1
  assert capped["loss_mask"].sum() == free["loss_mask"].sum()  # Every sequence is kept.


def test_pack_rounds_micro_batches_to_a_power_of_two():
  """M is a bucket (few step shapes over RL steps); `num_micro` counts the micro-batches
  holding sequences, and every one past it is padding."""
  for rows in (3, 5, 8, 9):
    p = packing.pack(_batch(b=rows, seed=rows), max_tokens_per_micro=32, agg="token-mean",
                     min_len=32)  # One 32-token row a micro-batch: M = the packed rows.
    m, n = p["tokens"].shape[0], int(p["num_micro"])
    assert m == 1 << (n - 1).bit_length() and n <= m < 2 * n
    assert (p["segment_ids"][:n].reshape(n, -1).max(1) > 0).all()
    assert not p["segment_ids"][n:].any() and not p["loss_mask"][n:].any()


def test_packed_step_compiles_once_per_bucket_and_skips_the_padding():
  """Batches packing into 5, 6, 7 and 8 micro-batches run one compiled step (M = 8), equal
  to the padded step; the micro-batches past `num_micro` are never run (filled with a copy
  of a real one, the update does not change). REINFORCE: no clipped token, so every
  micro-batch moves the weights."""
  tx = optax.sgd(1.0)
  loss_cfg = ts.LossConfig(kind="reinforce")
  step = ts.make_train_step(CFG, loss_cfg, tx, max_tokens_per_micro=32)
  counts = set()
  for rows in (5, 6, 7, 8):
    batch = _batch(b=rows, seed=10 + rows)
    batch["loss_mask"][:, 3:17] = 1  # Over 16 tokens: one sequence a 32-token row.
    packed = step.prepare(Batch(**batch))
    counts.add(int(packed.num_micro))
    assert packed.tokens.shape[0] == 8
    out, m = step(_state(tx), Batch(**batch))
    ref, m_ref = ts.make_train_step(CFG, loss_cfg, tx)(_state(tx), Batch(**batch))
    np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-5)
    np.testing.assert_allclose(_flat(out.params), _flat(ref.params), atol=2e-6)
  assert counts == {5, 6, 7, 8} and step.jitted._cache_size() == 1
  # Padding micro-batches holding a real one's tokens: skipped, so the update is the same.
  batch = _batch(b=5, seed=15)
  batch["loss_mask"][:, 3:17] = 1
  packed = step.prepare(Batch(**batch))
  n = int(packed.num_micro)
  fill = lambda v: np.concatenate([v[:n], np.repeat(v[:1], len(v) - n, axis=0)])
  filled = packed.replace(**{k: fill(v) for k, v in packed.as_dict().items()
                             if np.ndim(v) == 3})
  assert n < 8 and filled.loss_mask[n:].any()
  out, _ = step.jitted(_state(tx), filled, None)
  ref, _ = step.jitted(_state(tx), packed, None)
  np.testing.assert_array_equal(_flat(out.params), _flat(ref.params))


def _state(tx, seed=0):
  return ts.init_state(models.init_params(CFG, jax.random.key(seed)), tx, jax.random.key(1))


def _flat(params):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(params))])


@pytest.mark.parametrize("kind,agg", [("clipped", "seq-mean-token-mean"),
                                      ("clipped", "token-mean"),
                                      ("reinforce", "seq-mean-token-sum")])
@pytest.mark.parametrize("attn", ["reference", "blockwise"])
def test_packed_step_equals_padded(kind, agg, attn):
  tx = optax.sgd(1.0)  # The update is then the gradient: equal updates <=> equal grads.
  cfg = CFG.replace(attention=attn, attention_block=8)
  loss_cfg = ts.LossConfig(kind=kind, agg=agg, temperature=0.9)
  batch = _with_copies(_batch())  # Copies are packed once (weighted), padded as given.
  s_pad, m_pad = ts.make_train_step(CFG, loss_cfg, tx, logits_chunk=50)(_state(tx),
                                                                           Batch(**batch))
  # Budgets of one and of several micro-batches.
  for budget in (256, 64):
    s_pk, m_pk = ts.make_train_step(cfg, loss_cfg, tx, max_tokens_per_micro=budget,
                                    logits_chunk=40)(_state(tx), Batch(**batch))
    assert abs(float(m_pad["loss"])) > 1e-3
    np.testing.assert_allclose(float(m_pk["loss"]), float(m_pad["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_pk["tokens"]), float(m_pad["tokens"]))
    np.testing.assert_allclose(float(m_pk["entropy"]), float(m_pad["entropy"]), rtol=1e-5)
    np.testing.assert_allclose(_flat(s_pk.params), _flat(s_pad.params), atol=2e-6)


@pytest.mark.devices(8)
def test_packed_step_on_a_mesh():
  mesh = sharding.make_mesh(dict(data=4, fsdp=2, tensor=1))
  tx = optax.sgd(1.0)
  state = _state(tx)
  st_sh = ts.state_shardings(state, mesh)
  batch = _batch()
  ref, m_ref = ts.make_train_step(CFG, ts.LossConfig(), tx, max_tokens_per_micro=64)(
      _state(tx), Batch(**batch))
  step = ts.make_train_step(CFG, ts.LossConfig(), tx, mesh=mesh, state_sharding=st_sh,
                            max_tokens_per_micro=64)
  out, m = step(jax.device_put(state, st_sh), Batch(**batch))
  np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-5)
  np.testing.assert_allclose(_flat(out.params), _flat(ref.params), atol=2e-6)


def test_chunked_logprobs_equal_full():
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(3, 7, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(16, 53)) * 0.3, jnp.float32)
  y = jnp.asarray(rng.integers(0, 53, (3, 7)))
  c = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)

  def full(h, w):
    logits = jnp.einsum("btd,dv->btv", h, w) / 0.7
    return losses.token_logprobs(logits, y), losses.entropy(logits)

  for chunk in (1, 5, 21, 4096):
    chunked = lambda h, w: losses.chunked_logprobs(h, w, y, temperature=0.7, chunk=chunk)
    for a, b in zip(chunked(h, w), full(h, w)):
      np.testing.assert_allclose(a, b, atol=1e-5)
    g_full = jax.grad(lambda h, w: jnp.sum(full(h, w)[0] * c), argnums=(0, 1))(h, w)
    g_chunk = jax.jit(jax.grad(lambda h, w: jnp.sum(chunked(h, w)[0] * c), argnums=(0, 1)))(h, w)
    for a, b in zip(g_chunk, g_full):
      np.testing.assert_allclose(a, b, atol=1e-5)


def _loop_bodies(hlo: str) -> dict:
  """{while-body computation name: its text} of an HLO module's text."""
  names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  return {m.group(1): m.group(2) for m in re.finditer(
      r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M) if m.group(1) in names}


@pytest.mark.devices(8)
@pytest.mark.parametrize("axes", [dict(fsdp=8), dict(data=2, fsdp=2, expert=2)])
def test_chunked_logprobs_on_a_mesh_gather_the_head_once(axes):
  """Under an FSDP mesh each device scores its rows against the head gathered once: the
  same log-probs, entropies and gradients as the plain chunked scoring, and neither the
  head's gather nor its gradient's reduce-scatter inside the chunk loop."""
  mesh = sharding.make_mesh(axes)
  params = models.init_params(CFG, jax.random.key(0))
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, CFG.vocab_size, (8, 12)))
  hidden, head = models.qwen3.hidden_and_head(
      CFG, params, tokens, jnp.broadcast_to(jnp.arange(12), tokens.shape))
  y = jnp.roll(tokens, -1, axis=1)
  c = jnp.asarray(np.random.RandomState(2).normal(size=y.shape), jnp.float32)

  def loss(h, w):
    logp, ent = losses.chunked_logprobs(h, w, y, temperature=0.8, chunk=16)
    return jnp.sum(logp * c), (logp, ent)

  grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
  (g_h, g_w), (logp, ent) = jax.jit(grad)(hidden, head)

  def on_mesh(h, w):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return grad(h, w)

  h_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH))
  w_sh = jax.sharding.NamedSharding(mesh, sharding.param_spec("lm_head", head.shape, mesh))
  jitted = jax.jit(on_mesh, in_shardings=(h_sh, w_sh))
  (m_h, m_w), (m_logp, m_ent) = jitted(hidden, head)
  for got, want in ((m_logp, logp), (m_ent, ent), (m_h, g_h), (m_w, g_w)):
    np.testing.assert_allclose(got, want, atol=1e-5)
  assert float(jnp.max(jnp.abs(g_w))) > 1e-3  # The head's gradient is not trivially zero.
  hlo = jitted.lower(hidden, head).compile().as_text()
  assert re.search(r"all-gather", hlo)  # The head is gathered once...
  for name, body in _loop_bodies(hlo).items():  # ...outside the chunk loop.
    assert not re.search(r"all-gather|reduce-scatter|all-reduce", body), name


def test_logits_chunk_from_megabytes():
  from mgrpo_jax import config_checks as checks
  from mgrpo_jax import trainable
  # 2 GiB of f32 logits over Qwen3's vocabulary: 2**31 // (4 * 151936) = 3533 tokens.
  assert trainable.logits_chunk_tokens(2048, 151_936) == 3533
  assert trainable.logits_chunk_tokens(1, 10**9) == 1
  with pytest.raises(checks.ConfigValueError, match="logits_chunk_mb=0"):
    trainable.logits_chunk_tokens(0, 384)
