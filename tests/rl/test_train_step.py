"""Train step: exact gradient accumulation, on-policy ratio 1, non-finite handling, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mgrpo_jax import models, sampling, sharding
from mgrpo_jax.rl import losses
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.rl.batch import Batch

CFG = models.Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)


def _batch(b=8, t=13, seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CFG.vocab_size, (b, t)).astype(np.int32)
  # Prompt of 3..5 tokens, then generated tokens, then right padding.
  mask = np.zeros((b, t), np.float32)
  for i in range(b):
    start, end = rng.randint(3, 6), rng.randint(8, t + 1)
    mask[i, start:end] = 1
  mask[1] = 0  # A row with nothing to learn from (e.g. an invalid aligned row).
  old_logp = np.where(mask > 0, -rng.uniform(1, 5, (b, t)), 0).astype(np.float32)
  adv = rng.randn(b).astype(np.float32)
  return Batch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask),
               old_logp=jnp.asarray(old_logp), adv=jnp.asarray(adv))


def _state(tx, seed=0):
  return ts.init_state(models.init_params(CFG, jax.random.key(seed)), tx, jax.random.key(1))


def _flat(params):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(params))])


@pytest.mark.parametrize("agg,micro", [("seq-mean-token-mean", (1, 2, 4)),
                                       ("token-mean", (1, 4)), ("seq-mean-token-sum", (1, 4))])
def test_accumulation_matches_full_batch(agg, micro):
  # SGD makes the update a linear function of the gradient, so equal updates <=> equal grads.
  tx = optax.sgd(1.0)
  loss_cfg = ts.LossConfig(agg=agg)
  batch = _batch()
  outs = []
  for m in micro:
    step = ts.make_train_step(CFG, loss_cfg, tx, num_micro=m)
    state, metrics = step(_state(tx), batch)
    outs.append((_flat(state.params), float(metrics["loss"]), float(metrics["clip_frac_high"])))
  base = _flat(_state(tx).params)
  assert np.abs(outs[0][0] - base).max() > 1e-4  # The update is not trivially zero.
  for p, loss, clip in outs[1:]:
    np.testing.assert_allclose(p, outs[0][0], atol=2e-6)
    np.testing.assert_allclose(loss, outs[0][1], rtol=1e-5)
    np.testing.assert_allclose(clip, outs[0][2], atol=1e-6)


def test_loss_equals_policy_loss_on_logits():
  tx = optax.sgd(0.0)
  batch = _batch(seed=3)
  cfg = ts.LossConfig(temperature=0.7)
  _, metrics = ts.make_train_step(CFG, cfg, tx)(_state(tx), batch)
  params = _state(tx).params
  logits = models.logits(CFG, params, batch.tokens, jnp.ones_like(batch.tokens))
  logp = losses.token_logprobs(logits[:, :-1] / 0.7, batch.tokens[:, 1:])
  want, _ = losses.policy_loss(logp, batch.old_logp[:, 1:], batch.adv,
                               batch.loss_mask[:, 1:])
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)


def test_on_policy_ratio_is_one():
  """Behaviour log-probs from the sampler make the first update's ratio exactly 1."""
  tx = optax.sgd(0.0)
  params = models.init_params(CFG, jax.random.key(0))
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
  res = sampling.generate(CFG, params, prompts, max_new_tokens=9, temperature=0.8, top_k=20,
                          key=jax.random.key(5))
  t = max(len(p) for p in prompts) + 9
  tokens, mask, old = (np.zeros((4, t), np.int32), np.zeros((4, t), np.float32),
                       np.zeros((4, t), np.float32))
  for i, p in enumerate(prompts):
    n = res.lengths[i]
    tokens[i, :len(p) + n] = p + list(res.tokens[i, :n])
    mask[i, len(p):len(p) + n] = 1
    old[i, len(p):len(p) + n] = res.logprobs[i, :n]
  batch = Batch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask),
                old_logp=jnp.asarray(old), adv=jnp.asarray([1.0, -1.0, 0.5, -0.5]))
  state = ts.init_state(params, tx, jax.random.key(0))
  _, metrics = ts.make_train_step(CFG, ts.LossConfig(temperature=0.8), tx)(state, batch)
  assert abs(float(metrics["ratio_mean"]) - 1) < 1e-4
  assert abs(float(metrics["ratio_max"]) - 1) < 1e-4
  assert float(metrics["clip_frac_low"]) == 0 and float(metrics["clip_frac_high"]) == 0


def test_nonfinite_is_skipped_and_reported_with_step():
  tx = ts.make_optimizer(learning_rate=1e-2)
  step = ts.make_train_step(CFG, ts.LossConfig(), tx)
  state = _state(tx)
  before = _flat(state.params)
  bad = _batch().replace(adv=jnp.full((8,), jnp.nan))
  state, metrics = step(state, bad)
  assert not bool(metrics["finite"])
  np.testing.assert_array_equal(_flat(state.params), before)  # Update not applied.
  with pytest.raises(ts.NonFiniteError, match="step 7 for agent 'sub'"):
    ts.check_finite(jax.device_get(metrics), 7, agent="sub")
  assert ts.check_finite(jax.device_get(metrics), 7, policy="skip") is False
  state, metrics = step(state, _batch())
  assert bool(metrics["finite"])
  assert np.abs(_flat(state.params) - before).max() > 0


def test_compiles_once_and_adamw_moves_params():
  tx = ts.make_optimizer(learning_rate=1e-2)
  step = ts.make_train_step(CFG, ts.LossConfig(), tx)
  state = _state(tx)
  for seed in range(3):
    state, metrics = step(state, _batch(seed=seed))
  assert int(state.step) == 3
  assert step.jitted._cache_size() == 1
  assert float(metrics["grad_norm"]) > 0 and float(metrics["entropy"]) > 0


def test_bf16_first_moment_halves_it_and_tracks_float32():
  f32, bf16 = (ts.make_optimizer(learning_rate=1e-2, mu_dtype=d) for d in ("float32", "bfloat16"))
  a, b = _state(f32), _state(bf16)
  mu = lambda st: [x for x in jax.tree.leaves(st.opt_state) if x.ndim >= 2]
  # The moments of every matrix: mu in bfloat16, nu still float32 (a pair per matrix).
  assert sorted({x.dtype.name for x in mu(b)}) == ["bfloat16", "float32"]
  assert sum(x.nbytes for x in mu(b)) * 4 == sum(x.nbytes for x in mu(a)) * 3
  step_a = ts.make_train_step(CFG, ts.LossConfig(), f32)
  step_b = ts.make_train_step(CFG, ts.LossConfig(), bf16)
  before = _flat(a.params)
  for seed in range(3):
    a, _ = step_a(a, _batch(seed=seed))
    b, _ = step_b(b, _batch(seed=seed))
  moved, diff = np.abs(_flat(a.params) - before), np.abs(_flat(b.params) - _flat(a.params))
  # Three Adam steps of lr 1e-2 move weights by ~3e-2; bfloat16 rounding of mu (2^-8
  # relative) changes them by far less.
  assert moved.max() > 1e-2 and diff.max() < 0.05 * moved.max(), (moved.max(), diff.max())


@pytest.mark.devices(8)
def test_sharded_step_matches_unsharded():
  tx = ts.make_optimizer(learning_rate=1e-2)
  batch = _batch()
  ref_state, ref_metrics = ts.make_train_step(CFG, ts.LossConfig(), tx)(_state(tx), batch)
  mesh = sharding.make_mesh((2, 2, 2))
  state = _state(tx)
  st_sh = ts.state_shardings(state, mesh)
  state = jax.device_put(state, st_sh)
  step = ts.make_train_step(CFG, ts.LossConfig(), tx, mesh=mesh, state_sharding=st_sh)
  new_state, metrics = step(state, batch)
  q = new_state.params["layers"]["attn"]["q"][...]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  np.testing.assert_allclose(_flat(new_state.params), _flat(ref_state.params), atol=1e-5)
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)


def test_reinforce_kind_uses_no_ratio():
  tx = optax.sgd(0.0)
  batch = _batch().replace(old_logp=jnp.zeros((8, 13)))  # Would give a wild ratio if used.
  _, metrics = ts.make_train_step(CFG, ts.LossConfig(kind="reinforce", agg="seq-mean-token-sum"),
                                  tx)(_state(tx), batch)
  params = _state(tx).params
  logits = models.logits(CFG, params, batch.tokens, jnp.ones_like(batch.tokens))
  logp = losses.token_logprobs(logits[:, :-1], batch.tokens[:, 1:])
  want, _ = losses.reinforce_loss(logp, batch.adv, batch.loss_mask[:, 1:])
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)


def test_bad_loss_config_names_field():
  with pytest.raises(ValueError, match="LossConfig.agg"):
    ts.LossConfig(agg="mean")
  with pytest.raises(ValueError, match="LossConfig.kind"):
    ts.LossConfig(kind="ppo2")
  with pytest.raises(ValueError, match="LossConfig.tis_cap"):
    ts.LossConfig(tis_cap=-1.0)
  with pytest.raises(ValueError, match="LossConfig.tis_cap"):
    ts.LossConfig(kind="reinforce", tis_cap=2.0)


def test_tis_step_weights_the_policy_gradient():
  """With tis_cap, the step's update is −Σ w·A·∇logp (aggregated), w = min(π_old/π_s, C).

  The ratio's denominator is the trainer's own log-prob under the sampling weights, so
  the ratio is 1 and nothing is clipped: the reference below is that weighted REINFORCE
  gradient, written directly from the model's logits.
  """
  tx, cap = optax.sgd(1.0), 1.3
  batch = _batch(seed=4)
  params = _state(tx).params
  tokens, mask = batch.tokens, np.asarray(batch.loss_mask)[:, 1:]

  def logp_of(p):
    return losses.token_logprobs(models.logits(CFG, p, tokens, jnp.ones_like(tokens))[:, :-1],
                                 tokens[:, 1:])

  logp = np.asarray(logp_of(params))
  # The sampler off by -0.5 .. +0.5 nats: weights e^0.5 = 1.65 are capped at 1.3.
  offset = np.resize(np.linspace(-0.5, 0.5, 7), logp.shape)
  sampler = np.pad(np.where(mask > 0, logp - offset, 0.0), ((0, 0), (1, 0)))
  w = np.minimum(np.exp(offset), cap)
  adv = np.asarray(batch.adv)[:, None]
  tokens_B = mask.sum(1)

  def seq_mean_token_mean(x_BxT):
    per_row = jnp.sum(jnp.where(mask > 0, x_BxT, 0.0), 1)
    return jnp.sum(jnp.where(tokens_B > 0, per_row / np.maximum(tokens_B, 1), 0.0)) / (
        tokens_B > 0).sum()

  grads = jax.grad(lambda p: seq_mean_token_mean(-w * adv * logp_of(p)))(params)
  want = _flat(jax.tree.map(lambda p, g: p - g, params, grads))
  step = ts.make_train_step(CFG, ts.LossConfig(tis_cap=cap), tx)
  new_state, m = step(_state(tx), batch.replace(sampler_logp=jnp.asarray(sampler, jnp.float32)))
  np.testing.assert_allclose(_flat(new_state.params), want, atol=2e-6)
  assert np.abs(want - _flat(params)).max() > 1e-4  # A real update.
  # Its value: the surrogate −w·A·ratio at ratio 1.
  np.testing.assert_allclose(float(m["loss"]), float(seq_mean_token_mean(-w * adv)), rtol=1e-5)
  on = mask > 0
  assert float(m["tis_capped_frac"]) == pytest.approx((w[on] == cap).mean())
  assert float(m["mismatch_abs_logp"]) == pytest.approx(np.abs(offset[on]).mean(), rel=1e-4)
  assert float(m["mismatch_ratio_max"]) == pytest.approx(np.exp(offset[on].max()), rel=1e-4)
  # TIS off: the same batch trains on the sampler's log-probs as the ratio's denominator.
  _, m_off = ts.make_train_step(CFG, ts.LossConfig(), tx)(
      _state(tx), batch.replace(sampler_logp=jnp.asarray(sampler, jnp.float32)))
  assert "tis_weight" not in m_off
  assert float(m_off["mismatch_abs_logp"]) == pytest.approx(float(m["mismatch_abs_logp"]))
