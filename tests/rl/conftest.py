"""Shared pieces of the RL tests."""

import jax
import pytest

from mgrpo_jax import byte_tokenizer
from mgrpo_jax.agents import rollout


def _multi_turn_episodes(cfg, params, *, temperature: float, top_k: int = 20, **policy_kw):
  """Three turns of four episodes through the KV-cache sampler, tool replies in between.

  As the rollout engine builds them: generated tokens (loss mask 1, the sampler's
  log-probs), then a tool reply (mask 0) that the policy appends to its live cache.
  """
  tok = byte_tokenizer.ByteTokenizer()
  limits = rollout.Limits(max_turns=3, max_new_tokens=12, max_len=512)
  policy = rollout.LLMPolicy(cfg, params, tok, "sub", limits=limits, temperature=temperature,
                             top_k=top_k, **policy_kw)
  prompts = ["find the river", "who built it?", "why not", "find the river"]
  eps = [rollout.new_episode(tok, "sub", [{"role": "user", "content": p}], q=i, k=0, call=0,
                             task=None, max_turns=3) for i, p in enumerate(prompts)]
  policy.begin(eps)
  for turn, rows in enumerate([[0, 1, 2, 3], [0, 2, 3], [1, 3]]):
    appended = {}
    for r, (ids, logps) in zip(rows, policy.act(rows, jax.random.fold_in(jax.random.key(3),
                                                                         turn))):
      reply = tok.encode(f"tool reply {r}-{turn}")
      eps[r].tokens += ids + reply
      eps[r].loss_mask += [1] * len(ids) + [0] * len(reply)
      eps[r].logprobs += logps + [0.0] * len(reply)
      appended[r] = reply
    policy.append(appended)
  return eps


@pytest.fixture(scope="session")
def multi_turn_episodes():
  """`multi_turn_episodes(cfg, params, temperature=..., top_k=..., **LLMPolicy kwargs)`."""
  return _multi_turn_episodes
