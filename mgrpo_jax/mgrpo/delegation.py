"""Delegations and the main agent's outcome over an Exchange: the decoupled protocol.

The main agent and the sub-agent as separate programs share only an Exchange
(`decoupled.py` runs them); this module is what they say to each other.

What crosses (algorithm.md 1.6): delegation requests and their results (text, ids, the
sub-agent's policy version), one `wave` record per main-agent turn listing that turn's
requests, the per-rollout outcomes R_M[Q, K] and correct[Q, K] as arrays, and step
markers. The sub-agent keeps its own episodes.

Determinism is what makes a restart safe: the main agent issues the same waves with the
same requests, the sub-agent serves each wave as one batch with a key derived from (step,
wave), exactly as the colocated `ColocatedSubAgent` does, so a restarted program rewrites
identical records (`Exchange.put` returns False) and never double-counts a step; a record
that differs raises `ExchangeConflict` instead of passing silently.

One URL (any kvstore URL or JSON spec) holds a whole decoupled run:

  <run>/exchange/...            the exchange's records and arrays
  <run>/main/checkpoints/<step> the main agent's orbax checkpoints
  <run>/sub/checkpoints/<step>  the sub-agent's
"""

import threading
import time
from typing import Sequence

import numpy as np

from mgrpo_jax.agents import rollout
from mgrpo_jax.exchange import Exchange, kvstore_spec
from mgrpo_jax.mgrpo import hierarchy

EXCHANGE_DIR = "exchange"  # The exchange's namespace inside a run location.
EVAL_STEP_BASE = 10_000_000  # Exchange step ids of evaluation rollouts: base + step.


def open_exchange(run) -> Exchange:
  """The exchange of the run at `run` (a kvstore URL, JSON spec or local path)."""
  return Exchange(run, run=EXCHANGE_DIR)


def checkpoint_location(run, role: str) -> dict:
  """The kvstore spec of `role`'s checkpoints in the run at `run`."""
  return kvstore_spec(run, f"{role}/checkpoints")


class StaleResultError(RuntimeError):
  """A sub-agent result was produced by a policy older than the staleness bound allows."""


class ExchangeSubAgent:
  """The main agent's `SubAgentService` in a decoupled run: delegations go over the exchange.

  Records are keyed by (step, q, k, call) with this service's `step`, which namespaces
  them: a training step's own, or `EVAL_STEP_BASE + step` for an evaluation's.
  """

  def __init__(self, exchange: Exchange, *, step: int, timeout_s: float,
               version: int | None = None, max_staleness: int = 0):
    self.exchange, self.step, self.timeout_s = exchange, step, timeout_s
    # Results from a sub-agent policy older than version - max_staleness are refused.
    self.version, self.max_staleness = version, max_staleness
    self.waves = 0
    # The engine sends each decode call's delegations from a thread of their own.
    self._lock = threading.Lock()

  def _keys(self, requests) -> list[tuple[int, int, int, int]]:
    return [(self.step, r.q, r.k, r.call) for r in requests]

  def send(self, requests: Sequence[rollout.DelegationRequest]) -> int:
    """Writes the requests and their wave record; returns the wave's index."""
    keys = self._keys(requests)
    for r, key in zip(requests, keys):
      self.exchange.put("request", key, {"subtask": r.subtask, "context": r.context})
    with self._lock:  # Wave indices are handed out once each, in order.
      wave, self.waves = self.waves, self.waves + 1
      # The wave record makes the sub-agent batch exactly these requests together.
      self.exchange.put("wave", (self.step, wave), {"keys": [list(k) for k in keys]})
    return wave

  def receive(self, requests: Sequence[rollout.DelegationRequest]):
    """The results of `requests`, waiting for them up to `timeout_s`."""
    keys = self._keys(requests)
    results = self.exchange.get_many("result", keys, timeout_s=self.timeout_s)
    for key, r in zip(keys, results):
      if self.version is not None and r["policy_version"] < self.version - self.max_staleness:
        raise StaleResultError(
            f"Result {key} came from sub-agent policy version {r['policy_version']}, more than "
            f"config.max_staleness={self.max_staleness} behind version {self.version}.")
    return [rollout.DelegationResult(r["text"], r["policy_version"], r["format_ok"])
            for r in results]

  def delegate(self, requests: Sequence[rollout.DelegationRequest]):
    self.send(requests)
    return self.receive(requests)


def publish_outcome(exchange: Exchange, step: int, outcome: hierarchy.MainOutcome,
                    waves: int) -> None:
  """What the sub-agent needs to train on step `step`, then the marker that says it is there."""
  exchange.put_array("main_reward", step, outcome.reward)
  exchange.put_array("main_correct", step, outcome.correct)
  exchange.put_array("main_format", step, outcome.format_ok)
  exchange.mark("rollouts_done", step, {"waves": waves})


def get_outcome(exchange: Exchange, step: int, *, timeout_s: float) -> hierarchy.MainOutcome:
  """The main agent's outcome of `step`, as `publish_outcome` wrote it."""
  get = lambda name: np.asarray(exchange.get_array(name, step, timeout_s=timeout_s))
  return hierarchy.MainOutcome(get("main_reward"), get("main_correct"), get("main_format"))


def serve_wave(exchange: Exchange, service, step: int, wave: int, *,
               timeout_s: float = 0.0) -> bool:
  """Serves wave `wave` of `step` through `service` if its record is there (else False)."""
  rec = exchange.try_get("wave", (step, wave))
  if rec is None:
    return False
  keys = [tuple(k) for k in rec["keys"]]
  reqs = exchange.get_many("request", keys, timeout_s=timeout_s)
  requests = [rollout.DelegationRequest(*k, subtask=r["subtask"], context=r["context"])
              for k, r in zip(keys, reqs)]
  for key, res in zip(keys, service.delegate(requests)):
    exchange.put("result", key, {"text": res.text, "policy_version": res.policy_version,
                                 "format_ok": res.format_ok})
  return True


def serve_step(exchange: Exchange, service: rollout.ColocatedSubAgent, step: int, *,
               timeout_s: float, poll_s: float = 0.05,
               read_outcome: bool = True) -> hierarchy.MainOutcome | None:
  """Serves every wave of `step` through `service` (which keeps the episodes).

  Returns the main agent's outcome for the step once it is published (None for
  evaluation steps, `read_outcome=False`, which publish no outcome). Raises
  `ExchangeTimeout` naming what is missing when the main agent does not show up.
  """
  wave, deadline = 0, time.monotonic() + timeout_s
  while True:
    if serve_wave(exchange, service, step, wave, timeout_s=timeout_s):
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
  if not read_outcome:
    return None
  return get_outcome(exchange, step, timeout_s=timeout_s)
