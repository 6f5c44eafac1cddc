"""The main agent and the sub-agent as separate programs that share only an Exchange.

What crosses (PAPERS.md 1.6): delegation requests and their results (text, ids, the
sub-agent's policy version), one `wave` record per main-agent turn listing that turn's
requests, the per-rollout outcomes R_M[Q, K] and correct[Q, K] as arrays, and step
markers. The sub-agent keeps its own episodes.

Determinism is what makes a restart safe: the main agent issues the same waves with the
same requests, the sub-agent serves each wave as one batch with a key derived from (step,
wave), exactly as the colocated `ColocatedSubAgent` does, so a restarted program rewrites
identical records (`Exchange.put` returns False) and never double-counts a step; a record
that differs raises `ExchangeConflict` instead of passing silently.
"""

import time
from typing import Sequence

import numpy as np

from mgrpo_jax.agents import rollout
from mgrpo_jax.exchange import Exchange
from mgrpo_jax.rl import hierarchy


def _key(r: rollout.DelegationRequest) -> tuple[int, int, int, int]:
  return (r.step, r.q, r.k, r.call)


class ExchangeSubAgent:
  """The main agent's `SubAgentService` in a decoupled run: delegations go over the exchange."""

  def __init__(self, exchange: Exchange, *, step: int, timeout_s: float):
    self.exchange, self.step, self.timeout_s = exchange, step, timeout_s
    self.waves = 0

  def delegate(self, requests: Sequence[rollout.DelegationRequest]):
    keys = [_key(r) for r in requests]
    for r, key in zip(requests, keys):
      self.exchange.put("request", key, {"subtask": r.subtask, "context": r.context})
    # The wave record makes the sub-agent batch exactly this turn's requests together.
    self.exchange.put("wave", (self.step, self.waves), {"keys": [list(k) for k in keys]})
    self.waves += 1
    results = self.exchange.get_many("result", keys, timeout_s=self.timeout_s)
    return [rollout.DelegationResult(r["text"], r["policy_version"], r["format_ok"])
            for r in results]


def publish_outcome(exchange: Exchange, step: int, outcome: hierarchy.MainOutcome,
                    waves: int) -> None:
  """What the sub-agent needs to train on step `step`, then the marker that says it is there."""
  exchange.put_array("main_reward", step, outcome.reward)
  exchange.put_array("main_correct", step, outcome.correct)
  exchange.put_array("main_format", step, outcome.format_ok)
  exchange.mark("rollouts_done", step, {"waves": waves})


def serve_step(exchange: Exchange, service: rollout.ColocatedSubAgent, step: int, *,
               timeout_s: float, poll_s: float = 0.05) -> hierarchy.MainOutcome:
  """Serves every wave of `step` through `service` (which keeps the episodes).

  Returns the main agent's outcome for the step once it is published. Raises
  `ExchangeTimeout` naming what is missing when the main agent does not show up.
  """
  wave, deadline = 0, time.monotonic() + timeout_s
  while True:
    rec = exchange.try_get("wave", (step, wave))
    if rec is not None:
      keys = [tuple(k) for k in rec["keys"]]
      reqs = exchange.get_many("request", keys, timeout_s=timeout_s)
      requests = [rollout.DelegationRequest(*k, subtask=r["subtask"], context=r["context"])
                  for k, r in zip(keys, reqs)]
      for key, res in zip(keys, service.delegate(requests)):
        exchange.put("result", key, {"text": res.text, "policy_version": res.policy_version,
                                     "format_ok": res.format_ok})
      wave, deadline = wave + 1, time.monotonic() + timeout_s
      continue
    if step in exchange.marks("rollouts_done"):
      # All waves were issued before the marker: serve until the count it records.
      info = exchange.wait_mark("rollouts_done", step, timeout_s=timeout_s)
      if wave >= int(info["waves"]):
        break
    if time.monotonic() > deadline:
      raise TimeoutError(f"Sub-agent: no wave {wave} of step {step} and no rollouts_done "
                         f"marker within {timeout_s}s; is the main agent running?")
    time.sleep(poll_s)
  get = lambda name: np.asarray(exchange.get_array(name, step, timeout_s=timeout_s))
  return hierarchy.MainOutcome(get("main_reward"), get("main_correct"), get("main_format"))
