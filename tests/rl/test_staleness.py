"""The objective with lag: rows sampled by older policies, versions carried with the data.

Every reference here is written in NumPy (float64) from the log-probs the models give: the
decoupled clipped surrogate weighted by min(pi_old / pi_behaviour, C), per aggregation, for
the main agent and for a sub-agent whose calls two of its versions served.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from configs import common
from mgrpo_jax import models, trainable
from mgrpo_jax.agents import protocol, rollout
from mgrpo_jax.config_checks import ConfigValueError
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import losses
from mgrpo_jax.rl import train_step as ts

CFG = models.Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)
CURRENT = 5  # The version of the policy being updated (pi_old).
CAP = 1.5
AGGS = ("seq-mean-token-mean", "token-mean")  # The paper's and the global token mean.


def _params_at(version: int, seed: int):
  """An agent's weights at `version`: older versions drift further from the current ones."""
  params = models.init_params(CFG, jax.random.key(seed))
  noise = models.init_params(CFG, jax.random.key(seed + 100))
  drift = 1.5 * (CURRENT - version)
  return jax.tree.map(lambda p, n: p + drift * n, params, noise)


def _logp(params, tokens_BxT):
  """log pi(token t | tokens < t) at positions 1.., as the train step scores them."""
  tokens = jnp.asarray(tokens_BxT)
  logits = models.logits(CFG, params, tokens, jnp.ones_like(tokens))[:, :-1]
  return np.asarray(losses.token_logprobs(logits, tokens[:, 1:]), np.float64)


def _episode(role, rng, *, version, params, call=-1):
  """A row sampled by `params` (its recorded log-probs are theirs) at `version`."""
  n = int(rng.integers(9, 14))
  tokens = rng.integers(0, CFG.vocab_size, n).tolist()
  start = int(rng.integers(3, 6))
  mask = [0] * start + [1] * (n - start)
  lp = _logp(params, np.asarray([tokens]))[0]
  logprobs = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp, mask[1:])]
  return rollout.Episode(role=role, q=0, k=0, call=call, task=None, tokens=tokens,
                         loss_mask=mask, logprobs=logprobs, validator=None,
                         policy_version=version)


def _np_objective(logp, old, behaviour, adv_B, mask, agg, *, eps_low=0.2, eps_high=0.28,
                  cap=CAP):
  """The decoupled clipped surrogate with the truncated IS weight, in float64 NumPy."""
  on = mask > 0
  ratio = np.exp(np.where(on, logp - old, 0.0))
  weight = np.minimum(np.exp(np.where(on, old - behaviour, 0.0)), cap)
  adv = np.broadcast_to(adv_B[:, None], mask.shape)
  per_token = weight * np.maximum(-ratio * adv, -np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
  per_token = np.where(on, per_token, 0.0)
  if agg == "token-mean":
    return per_token.sum() / on.sum()
  rows = on.sum(1) > 0
  return np.sum(per_token.sum(1)[rows] / on.sum(1)[rows]) / rows.sum()


def _lagged_rows(role: str, seed: int, versions):
  """Rows of `role` sampled by the agent at `versions`, and the agent's current weights."""
  rng = np.random.default_rng(seed)
  rows = [_episode(role, rng, version=v, params=_params_at(v, seed), call=i if role == "sub"
                   else -1) for i, v in enumerate(versions)]
  return rows, _params_at(CURRENT, seed)


@pytest.mark.parametrize("agg", AGGS)
def test_policy_loss_on_lagged_rows_matches_numpy(agg):
  """Away from pi_old (a later epoch's weights), clipping included: `policy_loss` with the
  behaviour log-probs of older versions equals the NumPy objective."""
  rows, current = _lagged_rows("main", 1, [3, 4, 5, 3])
  batch = batch_lib.make_batch(rows, np.asarray([1.0, -0.5, 0.8, -1.2]), max_len=64, pad_id=0,
                               minimum=16)
  tokens, mask = np.asarray(batch.tokens), np.asarray(batch.loss_mask)[:, 1:]
  old = np.where(mask > 0, _logp(current, tokens), 0.0)
  moved = jax.tree.map(lambda p, n: p + 1.0 * n, current,
                       models.init_params(CFG, jax.random.key(7)))
  logp = np.where(mask > 0, _logp(moved, tokens), 0.0)
  behaviour = np.asarray(batch.sampler_logp, np.float64)[:, 1:]
  assert np.abs(old - behaviour)[mask > 0].max() > 0.5  # Really lagged: weights far from 1.
  want = _np_objective(logp, old, behaviour, np.asarray(batch.adv, np.float64), mask, agg)
  loss, m = losses.policy_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
                               batch.adv, mask, agg=agg, sampler_logp=jnp.asarray(
                                   behaviour, jnp.float32), tis_cap=CAP)
  np.testing.assert_allclose(float(loss), want, atol=1e-6)
  assert 0 < float(m["tis_capped_frac"]) < 1  # Some weights capped, some not.
  assert float(m["clip_frac_low"]) + float(m["clip_frac_high"]) > 0  # The clip binds too.


def _step(agg: str, max_staleness: int):
  """The train step an agent gets from config (`trainable.loss_config`), SGD at lr 1."""
  lc = ml_collections.ConfigDict(dict(common.loss().to_dict(), agg=agg))
  loss_cfg = trainable.loss_config(lc, 1.0, max_staleness=max_staleness,
                                   staleness_tis_cap=CAP)
  return ts.make_train_step(CFG, loss_cfg, optax.sgd(1.0)), loss_cfg


def _flat(params):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(params))])


def _check_step(rows, adv_B, current, agg):
  """The config's step with lag on `rows`: its loss is the NumPy objective at pi_old (ratio
  1), its update the gradient of sum(-w * A * logp) aggregated, w from NumPy."""
  batch = batch_lib.make_batch(rows, adv_B, max_len=64, pad_id=0, minimum=16)
  tokens, mask = np.asarray(batch.tokens), np.asarray(batch.loss_mask)[:, 1:]
  old = _logp(current, tokens)
  behaviour = np.asarray(batch.sampler_logp, np.float64)[:, 1:]
  adv = np.asarray(batch.adv, np.float64)
  want = _np_objective(old, old, behaviour, adv, mask, agg)
  step, loss_cfg = _step(agg, max_staleness=2)
  assert loss_cfg.terms == "clipped_tis" and loss_cfg.tis_cap == CAP
  tx = optax.sgd(1.0)
  # The step donates its state: it gets a copy of the current weights.
  state = ts.init_state(jax.tree.map(jnp.copy, current), tx, jax.random.key(1))
  new_state, m = step(state, batch)
  np.testing.assert_allclose(float(m["loss"]), want, atol=1e-6)
  assert 0 < float(m["tis_capped_frac"]) < 1  # Lagged: some weights capped, some not.
  # The gradient: each token's -A * grad logp, weighted by the NumPy weight, aggregated.
  on = mask > 0
  w = np.where(on, np.minimum(np.exp(np.where(on, old - behaviour, 0.0)), CAP), 0.0)
  rows_on = on.sum(1) > 0

  def surrogate(p):
    x = jnp.where(on, -w * adv[:, None] * _jax_logp(p, tokens), 0.0)
    if agg == "token-mean":
      return x.sum() / on.sum()
    return jnp.sum(jnp.where(rows_on, x.sum(1) / np.maximum(on.sum(1), 1), 0.0)) / rows_on.sum()

  base = _flat(current)
  want_update = -_flat(jax.grad(surrogate)(current))
  got_update = _flat(new_state.params) - base
  assert np.abs(want_update).max() > 1e-4  # A real update.
  np.testing.assert_allclose(got_update, want_update, atol=2e-6)
  cos = got_update @ want_update / np.linalg.norm(got_update) / np.linalg.norm(want_update)
  assert cos > 1 - 1e-5
  return batch, m


def _jax_logp(params, tokens):
  tokens = jnp.asarray(tokens)
  logits = models.logits(CFG, params, tokens, jnp.ones_like(tokens))[:, :-1]
  return losses.token_logprobs(logits, tokens[:, 1:])


@pytest.mark.parametrize("agg", AGGS)
def test_main_agent_step_with_lag_matches_numpy(agg):
  rows, current = _lagged_rows("main", 2, [3, 5, 4, 3])
  batch, _ = _check_step(rows, np.asarray([0.7, -1.1, 1.3, -0.4]), current, agg)
  np.testing.assert_array_equal(batch.version, [3, 5, 4, 3])


@pytest.mark.parametrize("agg", AGGS)
def test_sub_agent_rows_served_by_two_versions_match_numpy(agg):
  """One main episode's delegations, served by sub-agent versions 3 and 4: its sub rows
  carry those versions and those versions' log-probs, and the step weighs each by its own."""
  seed = 3
  rng = np.random.default_rng(seed)
  served = [3, 4, 4, 3]
  service = _VersionedService(served)
  main = rollout.Episode(role="main", q=0, k=0, call=-1, task=None, tokens=[1], loss_mask=[0],
                         logprobs=[0.0], validator=None, policy_version=CURRENT)
  tool_fn = rollout.main_tool_fn(service, step=CURRENT, limits=rollout.Limits())
  for call in range(len(served)):  # One delegation per turn, as the main agent calls them.
    turn = protocol.Turn(ok=True, action="delegate", argument=f"subtask {call}")
    assert tool_fn([(main, turn)]) == [f"result {call}"]
  assert main.delegation_versions == served
  sub_rows = [_episode("sub", rng, version=v, params=_params_at(v, seed), call=i)
              for i, v in enumerate(main.delegation_versions)]
  batch, _ = _check_step(sub_rows + [None], np.asarray([0.9, -0.6, 1.2, -1.0, 0.0]),
                         _params_at(CURRENT, seed), agg)
  np.testing.assert_array_equal(batch.version, served + [-1])  # -1: a padding row.
  lag = batch_lib.staleness_metrics(batch.version, CURRENT, 2)
  assert lag == {"staleness/max": 2.0, "staleness/mean": 1.5, "staleness/count_0": 0.0,
                 "staleness/count_1": 2.0, "staleness/count_2": 2.0}


class _VersionedService:
  """A sub-agent whose calls are served, in turn, by the given policy versions."""

  def __init__(self, versions):
    self.versions, self.calls = list(versions), 0

  def delegate(self, requests):
    out = []
    for _ in requests:
      out.append(rollout.DelegationResult(f"result {self.calls}", self.versions[self.calls],
                                          True))
      self.calls += 1
    return out


def test_update_logs_the_staleness_histogram_and_k0_keeps_the_on_policy_step():
  """`update_agents` adds `{agent}/staleness/...` for rows with versions (zeros on-policy);
  with k = 0 the objective is the plain clipped surrogate, exactly as before."""
  _, loss0 = _step("seq-mean-token-mean", max_staleness=0)
  assert loss0 == ts.LossConfig(tis_cap=0.0) and loss0.terms == "clipped"
  rows, current = _lagged_rows("main", 4, [CURRENT] * 4)
  batch = batch_lib.make_batch(rows, np.asarray([1.0, -1.0, 0.5, -0.5]), max_len=64,
                               pad_id=0, minimum=16)
  step, lc = _step("seq-mean-token-mean", max_staleness=0)
  fresh = lambda: ts.init_state(jax.tree.map(jnp.copy, current), optax.sgd(1.0),
                               jax.random.key(1))
  agent = trainable.Agent("main", CFG, lc, fresh(), step, "raise")
  out = trainable.update_agents({"main": agent}, {"main": batch}, CURRENT)
  assert {k: v for k, v in out.items() if "/staleness/" in k} == {
      "main/staleness/max": 0.0, "main/staleness/mean": 0.0, "main/staleness/count_0": 4.0}
  # Rows without versions (demonstrations) log no staleness.
  agent.state = fresh()
  out = trainable.update_agents({"main": agent}, {"main": batch.replace(version=None)}, 0)
  assert not any("staleness" in k for k in out)


def test_lag_needs_behaviour_logprobs_and_a_positive_cap():
  lc = common.loss()
  lc.kind = "reinforce"
  with pytest.raises(ConfigValueError, match="max_staleness=1.*kind='reinforce'"):
    trainable.loss_config(lc, 1.0, max_staleness=1)
  assert trainable.loss_config(lc, 1.0, max_staleness=0).kind == "reinforce"
  with pytest.raises(ConfigValueError, match="staleness_tis_cap"):
    trainable.loss_config(common.loss(), 1.0, max_staleness=1, staleness_tis_cap=0.0)
  own = common.loss()
  own.tis_cap = 3.0  # A loss section's own cap wins: one weight corrects numerics and lag.
  assert trainable.loss_config(own, 1.0, max_staleness=1).tis_cap == 3.0
