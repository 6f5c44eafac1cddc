"""Rollout engine: experts through the engine, random tiny LLMs, masks, ids and limits."""

import collections

import jax
import numpy as np
import pytest

from mgrpo_jax import byte_tokenizer, kv_cache_plan, models
from mgrpo_jax.agents import experts, protocol, rollout
from mgrpo_jax.envs import retrieval, search, world
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import rewards

TOK = byte_tokenizer.ByteTokenizer()
LIMITS = rollout.Limits(max_turns=6, max_new_tokens=160, max_len=2048, max_delegations=4)


@pytest.fixture(scope="module")
def env():
  w = world.generate_world(world.WorldConfig(seed=3))
  qs = world.make_questions(w, num=30, seed=1)
  return qs, retrieval.Bm25Retriever.from_documents(w.documents)


@pytest.fixture(scope="module")
def tiny():
  cfg = models.get_preset("tiny", vocab_size=TOK.vocab_size)
  return cfg, models.init_params(cfg, jax.random.key(0))


def _service(policy, index, limits=LIMITS):
  return rollout.ColocatedSubAgent(policy, TOK, search.local_tools(index), limits=limits,
                                   key=jax.random.key(7))




def test_experts_through_the_engine_answer_and_keep_format(env, check_sequence):
  qs, index = env
  main = rollout.ExpertPolicy(experts.MainExpert(), TOK)
  service = _service(rollout.ExpertPolicy(experts.SubExpert(), TOK), index)
  eps = rollout.rollout_main(main, service, qs, num_rollouts=2, tokenizer=TOK, limits=LIMITS,
                             key=jax.random.key(0))
  assert [(e.q, e.k) for e in eps] == [(q, k) for q in range(len(qs)) for k in range(2)]
  correct = [rewards.exact_match(e.final or "", qs[e.q].answer) for e in eps]
  assert np.mean(correct) >= 0.95
  assert all(e.format_ok for e in eps)
  assert all(s.format_ok for s in service.episodes)
  for ep in eps + service.episodes:
    check_sequence(ep)
  # Ids and counts: each main rollout's delegations are its sub-episodes, calls 0..d-1.
  calls = collections.defaultdict(list)
  for s in service.episodes:
    calls[(s.q, s.k)].append(s.call)
  for e in eps:
    assert sorted(calls[(e.q, e.k)]) == list(range(e.delegations))
    assert e.delegations == len(qs[e.q].hops)  # Noise-free: one delegation per hop.


def test_random_llm_rollouts_complete_with_consistent_records(env, tiny, check_sequence):
  qs, index = env
  cfg, params = tiny
  limits = rollout.Limits(max_turns=3, max_new_tokens=24, max_len=1024, max_delegations=2)
  # Expert main so that delegations happen; the random sub-agent then runs real episodes.
  main = rollout.ExpertPolicy(experts.MainExpert(), TOK)
  sub = rollout.LLMPolicy(cfg, params, TOK, "sub", limits=limits, temperature=1.0)
  service = _service(sub, index, limits)
  eps = rollout.rollout_main(main, service, qs[:4], num_rollouts=2, tokenizer=TOK,
                             limits=limits, key=jax.random.key(1))
  assert len(service.episodes) == sum(e.delegations for e in eps) > 0
  for s in service.episodes:
    check_sequence(s)
    assert 1 <= s.num_generated <= limits.max_turns * limits.max_new_tokens
    assert np.all(np.asarray(s.logprobs)[np.asarray(s.loss_mask, bool)] <= 0)
  # A random sub-agent almost never keeps the format, and M then sees NO_RESULT.
  failed = [s for s in service.episodes if not s.format_ok]
  assert failed and all(s.validator.failure for s in failed)
  assert any(rollout.NO_RESULT in o for e in eps for o in e.observations)
  # And a random main agent: every episode ends (here: by a format failure) cleanly.
  llm_main = rollout.LLMPolicy(cfg, params, TOK, "main", limits=limits, temperature=1.0)
  eps = rollout.rollout_main(llm_main, _service(sub, index, limits), qs[:3], num_rollouts=2,
                             tokenizer=TOK, limits=limits, key=jax.random.key(2))
  for e in eps:
    assert e.done
    check_sequence(e)
  batch = batch_lib.make_batch(eps, np.ones(len(eps), np.float32), max_len=1024,
                               pad_id=TOK.pad_id, minimum=1024)
  assert batch.tokens.shape == (6, 1024)
  assert batch.loss_mask.sum() == sum(e.num_generated for e in eps)


def test_llm_policy_under_a_kv_budget_gives_the_same_turns(tiny, multi_turn_episodes):
  cfg, params = tiny
  run = lambda budget: multi_turn_episodes(cfg, params, temperature=1.0,
                                           kv_cache_budget_bytes=budget)
  free = run(None)
  per_slot = kv_cache_plan.kv_cache_bytes(cfg, 1, 512)
  # Four episodes in two slots, then in one (`multi_turn_episodes` runs them to 512
  # positions): the others wait, their KV saved off the slots.
  for slots in (2, 1):
    budget = slots * per_slot
    policy = rollout.LLMPolicy(cfg, params, TOK, "sub", kv_cache_budget_bytes=budget,
                               limits=rollout.Limits(max_turns=3, max_new_tokens=12,
                                                     max_len=512))
    assert policy.slots_for(4) == slots
    for a, b in zip(free, run(budget)):
      assert a.tokens == b.tokens and a.loss_mask == b.loss_mask
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_context_overflow_ends_episode_as_format_failure(env):
  qs, index = env
  limits = rollout.Limits(max_turns=6, max_new_tokens=160, max_len=700, max_delegations=4)
  main = rollout.ExpertPolicy(experts.MainExpert(), TOK)
  service = _service(rollout.ExpertPolicy(experts.SubExpert(), TOK), index, limits)
  eps = rollout.rollout_main(main, service, qs[:3], num_rollouts=1, tokenizer=TOK,
                             limits=limits, key=jax.random.key(0))
  aborted = [e for e in eps + service.episodes if "context" in (e.validator.failure or "")]
  assert aborted and not any(e.format_ok for e in aborted)
  assert all(len(e.tokens) <= limits.max_len for e in eps + service.episodes)


def test_delegation_limit_is_enforced(env):
  qs, index = env
  three_hop = [q for q in qs if len(q.hops) == 3][:2]
  limits = rollout.Limits(max_turns=6, max_new_tokens=160, max_len=4096, max_delegations=1)
  service = _service(rollout.ExpertPolicy(experts.SubExpert(), TOK), index, limits)
  eps = rollout.rollout_main(rollout.ExpertPolicy(experts.MainExpert(), TOK), service, three_hop,
                             num_rollouts=1, tokenizer=TOK, limits=limits, key=jax.random.key(0))
  assert all(e.delegations == 1 for e in eps)
  assert len(service.episodes) == len(eps)
  assert all("limit" in e.observations[-1] for e in eps)


def test_limits_reject_bad_values():
  with pytest.raises(ValueError, match="Limits.max_len"):
    rollout.Limits(max_len=0)


def test_protocol_stop_ids_are_single_tokens_for_the_byte_tokenizer():
  ids = protocol.stop_token_ids(TOK, "sub")
  assert TOK.token_id("</search>") in ids and TOK.eos_id in ids


def test_a_sub_prompt_longer_than_the_context_is_aborted_not_raised(env, tiny, check_sequence):
  """A delegated subtask too long for the sub-agent's context fails that episode alone."""
  _, index = env
  cfg, params = tiny
  limits = rollout.Limits(max_turns=2, max_new_tokens=16, max_len=1024, max_delegations=2)
  service = _service(rollout.LLMPolicy(cfg, params, TOK, "sub", limits=limits), index, limits)
  requests = [rollout.DelegationRequest(0, 0, 0, 0, "x" * 2000, None),
              rollout.DelegationRequest(0, 1, 0, 0, "find the river", None)]
  results = service.delegate(requests)
  long_ep, short_ep = service.episodes
  assert "context" in long_ep.validator.failure and long_ep.num_generated == 0
  assert len(long_ep.tokens) == limits.max_len  # Cut to fit a batch row; nothing trained.
  assert results[0].text == rollout.NO_RESULT
  assert short_ep.num_generated > 0
  check_sequence(short_ep)
