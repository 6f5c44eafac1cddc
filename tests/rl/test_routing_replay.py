"""Routing replay (MoE): the sampler records every token's experts, the batch carries them,
and the train step replays them, so its log-probs are the sampler's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mgrpo_jax import byte_tokenizer, models, sharding
from mgrpo_jax.magrpo import rollout as magrpo_rollout
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import losses
from mgrpo_jax.rl import train_step as ts

TOK = byte_tokenizer.ByteTokenizer()
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def moe():
  cfg = models.get_preset("tiny_moe", vocab_size=TOK.vocab_size)
  return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def sampled(moe, multi_turn_episodes):
  cfg, params = moe
  eps = multi_turn_episodes(cfg, params, temperature=TEMPERATURE)
  batch = batch_lib.make_batch(eps, np.asarray([1.0, -1.0, 0.5, -0.5], np.float32),
                               max_len=512, pad_id=TOK.pad_id, minimum=64)
  return eps, batch


def _real(eps, batch):
  lengths = np.asarray([len(e.tokens) for e in eps])
  return np.arange(batch.length)[None, :] < lengths[:, None]


def _ref_logp(cfg, params, batch, real, experts_BxTxLxK=None):
  """Log-probs of tokens 1.. from one uncached forward (routes given or re-routed)."""
  given = None if experts_BxTxLxK is None else jnp.transpose(experts_BxTxLxK, (2, 0, 1, 3))
  positions = np.broadcast_to(np.arange(batch.length), batch.tokens.shape)
  logits, _, routing = models.forward(cfg, params, batch.tokens, positions, None, real,
                                      experts_LxBxTxK=given, return_routing=True)
  logp = losses.token_logprobs(logits[:, :-1] / TEMPERATURE, batch.tokens[:, 1:])
  return np.asarray(logp), np.asarray(jnp.transpose(routing.experts_LxBxTxK, (1, 2, 0, 3)))


def _step_metrics(cfg, params, batch, *, packed=False):
  tx = optax.sgd(0.0)
  step = ts.make_train_step(cfg, ts.LossConfig(temperature=TEMPERATURE, tis_cap=2.0), tx,
                            max_tokens_per_micro=256 if packed else None)
  state = ts.init_state(jax.tree.map(np.array, params), tx, jax.random.key(0))
  return step(state, batch)[1]


def test_sampler_records_the_routes_of_every_token(moe, sampled):
  cfg, params = moe
  eps, batch = sampled
  for e in eps:  # Prompt, generated tokens and tool replies: one route per token.
    assert e.experts.dtype == np.uint8 and e.experts.shape == (len(e.tokens), 2, 2)
  assert batch.experts.shape == (4, batch.length, 2, 2) and batch.experts.dtype == np.uint8
  real = _real(eps, batch)
  # The routes equal those of one uncached forward over the whole sequences (f32).
  _, routes = _ref_logp(cfg, params, batch, real)
  np.testing.assert_array_equal(batch.experts[real], routes[real])
  assert np.all(batch.experts[~real] == 0) and len(np.unique(routes[real])) == 8


@pytest.mark.parametrize("packed", [False, True])
def test_replayed_train_step_recomputes_the_samplers_logprobs(moe, sampled, packed):
  cfg, params = moe
  _, batch = sampled
  on = batch.loss_mask[:, 1:] > 0
  assert on.sum() >= 60 and np.all(batch.sampler_logp[:, 1:][on] < 0)
  m = _step_metrics(cfg.replace(routing_replay=True), params, batch, packed=packed)
  assert float(m["mismatch_abs_logp"]) < 1e-5
  assert 1 - 1e-5 < float(m["mismatch_ratio_min"]) <= float(m["mismatch_ratio_max"]) < 1 + 1e-5
  assert float(m["tokens"]) == on.sum()


def test_replay_uses_the_samplers_routes_when_the_router_drifts(moe, sampled):
  """A router perturbed after sampling re-routes some tokens; replay keeps the sampler's."""
  cfg, params = moe
  eps, batch = sampled
  noise = lambda x: x + 0.01 * jax.random.normal(jax.random.key(7), x.shape, x.dtype)
  drifted = jax.tree_util.tree_map_with_path(
      lambda p, x: noise(x) if "router" in sharding.path_str(p) else x, params)
  real = _real(eps, batch)
  on = batch.loss_mask[:, 1:] > 0
  replayed, _ = _ref_logp(cfg, drifted, batch, real, batch.experts)
  rerouted, routes = _ref_logp(cfg, drifted, batch, real)
  flipped = np.any(routes != batch.experts, axis=(2, 3)) & real
  assert flipped.sum() >= 20
  assert np.abs(replayed - rerouted)[on].max() > 1e-3  # The two are far apart...
  # ...and the step's log-probs are the replayed ones with replay on, else the re-routed
  # ones (the metric compares them with whatever `sampler_logp` holds).
  for replay, ref in [(True, replayed), (False, rerouted)]:
    probe = batch.replace(sampler_logp=np.pad(ref, ((0, 0), (1, 0))).astype(np.float32))
    m = _step_metrics(cfg.replace(routing_replay=replay), drifted, probe)
    assert float(m["mismatch_abs_logp"]) < 1e-5, replay
  # Replay brings the drifted trainer closer to the sampler than re-routing does.
  err = lambda logp: np.abs(logp - batch.sampler_logp[:, 1:])[on].mean()
  assert err(replayed) < err(rerouted)


@pytest.mark.devices(8)
def test_routes_through_one_slot_and_on_an_expert_mesh_equal_the_resident_ones(
    moe, sampled, multi_turn_episodes):
  cfg, params = moe
  eps, _ = sampled
  # A budget of one slot's cache: the episodes take turns in it, a waiting one's KV (and
  # routes) saved off the slot and restored.
  queued = multi_turn_episodes(cfg, params, temperature=TEMPERATURE,
                               kv_cache_budget_bytes=200_000)
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, tensor=1, expert=4))
  meshed = multi_turn_episodes(cfg, jax.device_put(params, sharding.param_shardings(params, mesh)),
                               temperature=TEMPERATURE, mesh=mesh)
  for a, b, c in zip(eps, queued, meshed):
    assert a.tokens == b.tokens == c.tokens
    assert len(a.experts) == len(a.tokens)
    np.testing.assert_array_equal(b.experts, a.experts)
    np.testing.assert_array_equal(c.experts, a.experts)
    np.testing.assert_allclose(c.logprobs, a.logprobs, atol=2e-5)


def test_routes_with_shared_prompts_equal_the_resident_ones(moe, sampled,
                                                            multi_turn_episodes):
  # Two episodes start from one prompt: held once in a pool row, its positions' routes are
  # read from there, the rest from each slot (one slot for all: own positions evicted and
  # restored). Every token keeps its route, the same as with the prompt in each slot.
  cfg, params = moe
  eps, _ = sampled
  shared = multi_turn_episodes(cfg, params, temperature=TEMPERATURE, share_prompts=True)
  queued = multi_turn_episodes(cfg, params, temperature=TEMPERATURE, share_prompts=True,
                               kv_cache_budget_bytes=200_000)
  for a, b, c in zip(eps, shared, queued):
    assert a.tokens == b.tokens == c.tokens
    assert len(b.experts) == len(b.tokens) == len(c.experts)
    np.testing.assert_array_equal(b.experts, a.experts)
    np.testing.assert_array_equal(c.experts, a.experts)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
    np.testing.assert_allclose(c.logprobs, a.logprobs, atol=2e-5)


@pytest.mark.devices(8)
def test_routes_with_shared_prompts_on_an_expert_mesh_equal_the_resident_ones(
    moe, sampled, multi_turn_episodes):
  # The pool of shared prompts under the expert-parallel mesh a MoE policy samples on.
  cfg, params = moe
  eps, _ = sampled
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, tensor=1, expert=4))
  meshed = multi_turn_episodes(cfg, jax.device_put(params, sharding.param_shardings(params, mesh)),
                               temperature=TEMPERATURE, mesh=mesh, share_prompts=True)
  for a, c in zip(eps, meshed):
    assert a.tokens == c.tokens
    np.testing.assert_array_equal(c.experts, a.experts)
    np.testing.assert_allclose(c.logprobs, a.logprobs, atol=2e-5)


def test_replay_needs_recorded_routes(moe, sampled):
  cfg, params = moe
  _, batch = sampled
  with pytest.raises(ValueError, match="routing_replay is on but the batch has no `experts`"):
    _step_metrics(cfg.replace(routing_replay=True), params, batch.replace(experts=None))
  # The host-side step (packed here) gives an all-padding batch zero routes, and refuses
  # real rows without them.
  replay = cfg.replace(routing_replay=True)
  empty = batch.replace(experts=None, loss_mask=np.zeros_like(batch.loss_mask))
  assert float(_step_metrics(replay, params, empty, packed=True)["tokens"]) == 0
  with pytest.raises(ValueError, match="routing_replay is on but the batch has no `experts`"):
    _step_metrics(replay, params, batch.replace(experts=None), packed=True)
  with pytest.raises(models.ConfigError, match="routing_replay=True needs a mixture"):
    models.get_preset("tiny", routing_replay=True)


def test_magrpo_completions_carry_their_routes(moe):
  cfg, params = moe
  policy = magrpo_rollout.Policy(cfg, params, TOK, max_new_tokens=10, max_len=128,
                                 temperature=TEMPERATURE)
  prompts = [TOK.encode("a prompt"), TOK.encode("another, longer prompt")]
  comps = policy.complete(prompts, jax.random.key(1))
  batch = batch_lib.make_batch(comps, np.ones(2, np.float32), max_len=128, pad_id=TOK.pad_id,
                               minimum=32)
  real = _real(comps, batch)
  for c in comps:
    assert c.experts.shape == (len(c.tokens), 2, 2)
  _, routes = _ref_logp(cfg, params, batch, real)
  np.testing.assert_array_equal(batch.experts[real], routes[real])
