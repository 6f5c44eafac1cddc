"""The main agent and the sub-agent as separate programs that share only an Exchange.

What crosses (PAPERS.md 1.6): delegation requests and their results (text, ids, the
sub-agent's policy version), one `wave` record per main-agent turn listing that turn's
requests, the per-rollout outcomes R_M[Q, K] and correct[Q, K] as arrays, and step
markers. The sub-agent keeps its own episodes.

Determinism is what makes a restart safe: the main agent issues the same waves with the
same requests, the sub-agent serves each wave as one batch with a key derived from (step,
wave), exactly as the colocated `ColocatedSubAgent` does, so a restarted program rewrites
identical records (`Exchange.put` returns False) and never double-counts a step; a record
that differs raises `ExchangeConflict` instead of passing silently. The colocated trainer
runs the same code in one process over a fresh `memory://` store (`LoopbackSubAgent`).

One URL (any kvstore URL or JSON spec) holds a whole decoupled run:

  <run>/exchange/...            the exchange's records and arrays
  <run>/main/checkpoints/<step> the main agent's orbax checkpoints
  <run>/sub/checkpoints/<step>  the sub-agent's
"""

import time
from typing import Sequence

import jax
import numpy as np
import tensorstore as ts

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import metrics as metrics_lib
# train imports this module too (for LoopbackSubAgent); the cycle is safe because each
# side reads the other's attributes only when called.
from mgrpo_jax import sharding, train
from mgrpo_jax.agents import rollout
from mgrpo_jax.exchange import Exchange, ExchangeError, kvstore_spec
from mgrpo_jax.rl import hierarchy

EXCHANGE_DIR = "exchange"  # The exchange's namespace inside a run location.
EVAL_STEP_BASE = 10_000_000  # Exchange step ids of evaluation rollouts: base + step.


def open_exchange(run) -> Exchange:
  """The exchange of the run at `run` (a kvstore URL, JSON spec or local path)."""
  return Exchange(run, run=EXCHANGE_DIR)


def checkpoint_location(run, role: str) -> dict:
  """The kvstore spec of `role`'s checkpoints in the run at `run`."""
  return kvstore_spec(run, f"{role}/checkpoints")


def memory_exchange() -> Exchange:
  """A fresh in-memory exchange; its records go when the last reference to it does."""
  return Exchange("memory://", run=EXCHANGE_DIR, context=ts.Context())


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

  def _keys(self, requests) -> list[tuple[int, int, int, int]]:
    return [(self.step, r.q, r.k, r.call) for r in requests]

  def send(self, requests: Sequence[rollout.DelegationRequest]) -> int:
    """Writes the requests and their wave record; returns the wave's index."""
    keys = self._keys(requests)
    for r, key in zip(requests, keys):
      self.exchange.put("request", key, {"subtask": r.subtask, "context": r.context})
    # The wave record makes the sub-agent batch exactly this turn's requests together.
    self.exchange.put("wave", (self.step, self.waves), {"keys": [list(k) for k in keys]})
    self.waves += 1
    return self.waves - 1

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


class LoopbackSubAgent:
  """A sub-agent in this process behind an exchange: the colocated trainer's service.

  Every wave takes the decoupled path: the main side's `ExchangeSubAgent` writes the
  requests and the wave record, `serve_wave` serves that wave through `service` (which
  keeps the episodes), and the main side reads the results back. `relay_outcome` does
  the same for R_M. Nothing waits, since both sides are here.
  """

  def __init__(self, exchange: Exchange, service: rollout.ColocatedSubAgent, *, step: int):
    self.exchange, self.service, self.step = exchange, service, step
    self.main_side = ExchangeSubAgent(exchange, step=step, timeout_s=0.0)

  @property
  def episodes(self):
    return self.service.episodes

  @property
  def waves(self) -> int:
    return self.main_side.waves

  def delegate(self, requests: Sequence[rollout.DelegationRequest]):
    wave = self.main_side.send(requests)
    if not serve_wave(self.exchange, self.service, self.step, wave):
      raise ExchangeError(f"Wave {wave} of step {self.step} was sent but reads as absent "
                          f"in {self.exchange!r}.")
    return self.main_side.receive(requests)

  def relay_outcome(self, outcome: hierarchy.MainOutcome) -> hierarchy.MainOutcome:
    """Publishes the main agent's outcome and returns it as the sub-agent reads it."""
    publish_outcome(self.exchange, self.step, outcome, self.waves)
    return get_outcome(self.exchange, self.step, timeout_s=0.0)


# ------------------------------------------------------------------------ role programs

def _setup(c, workdir: str, run, role: str):
  """The parts of a role program that mirror the colocated trainer's set-up.

  Checkpoints go to the run location (`<run>/<role>/checkpoints`); where orbax cannot
  write there itself (s3://, see `checkpoint`), `<workdir>/checkpoints` is its cache.
  """
  if c.variant not in ("mgrpo", "frozen_sub"):
    raise train.ConfigValueError(f"config.variant={c.variant!r} has no separate sub-agent; "
                                 "decoupled runs need 'mgrpo' or 'frozen_sub'.")
  train.validate_config(c)
  mesh = sharding.make_mesh(dict(c.mesh))
  env = train.build_env(c)
  agents = train.build_agents(c, env, mesh, jax.random.fold_in(jax.random.key(c.seed), 0))
  agents = {role: agents[role]}  # Each program owns only its own model and optimizer.
  ckpt = ckpt_lib.Checkpointer(checkpoint_location(run, role),
                              cache_dir=f"{workdir}/checkpoints", max_to_keep=c.max_to_keep)
  start = train.restore_agents(ckpt, agents)
  writer = metrics_lib.MetricsWriter(workdir)
  writer.truncate_after(start - 1)
  return env, agents, ckpt, writer, start


def _is_eval(c, step: int) -> bool:
  return step % c.eval_every == 0 or step == c.num_steps


def run_main_agent(c, workdir: str, run, *, timeout_s: float = 600.0) -> None:
  """The main agent's program: rollouts that delegate over the exchange, then its update.

  `run` is the run location shared with the sub-agent (kvstore URL, JSON spec or path);
  `workdir` is this program's own directory (metrics, logs, final HF weights).
  """
  env, agents, ckpt, writer, start = _setup(c, workdir, run, "main")
  ex = open_exchange(run)
  for step in range(start, c.num_steps + 1):
    m = {}
    if _is_eval(c, step):
      svc = ExchangeSubAgent(ex, step=EVAL_STEP_BASE + step, timeout_s=timeout_s)
      m.update(train.evaluate(c, env, agents, step=step, service=svc))
      ex.mark("rollouts_done", EVAL_STEP_BASE + step, {"waves": svc.waves})
    if step == c.num_steps:
      writer.write(step, m)
      break
    key = train.step_key(c, step)
    questions = train._questions_for_step(env.train, step, c.num_queries, c.seed)
    policies = train.make_policies(c, env, agents, c.sampling, version=step)
    svc = ExchangeSubAgent(ex, step=step, timeout_s=timeout_s, version=step,
                           max_staleness=c.max_staleness)
    eps, _ = train.run_rollouts(c, env, policies, questions, num_rollouts=c.num_rollouts,
                                key=key, step=step, service=svc)
    batch, outcome, bm = train.main_batch(c, env, eps)
    publish_outcome(ex, step, outcome, svc.waves)
    m.update(bm)
    m.update(train._update(c, agents, {"main": batch}, step))
    writer.write(step, m)
    train.save_after_step(ckpt, agents, step, every=c.checkpoint_every, last=c.num_steps)
  _finish(workdir, ckpt, writer, agents, env.tokenizer)


def run_sub_agent(c, workdir: str, run, *, timeout_s: float = 600.0) -> None:
  """The sub-agent's program: serves every wave of a step, then trains on its own episodes."""
  env, agents, ckpt, writer, start = _setup(c, workdir, run, "sub")
  ex = open_exchange(run)
  for step in range(start, c.num_steps + 1):
    m = {}
    if _is_eval(c, step):
      policy = train.make_policies(c, env, agents, c.eval_sampling, version=step)["sub"]
      svc = train.colocated_sub_agent(c, env, policy, train.eval_key(c, step))
      serve_step(ex, svc, EVAL_STEP_BASE + step, timeout_s=timeout_s, read_outcome=False)
      if svc.episodes:
        m["eval/sub_format"] = float(np.mean([e.format_ok for e in svc.episodes]))
    if step == c.num_steps:
      writer.write(step, m)
      break
    key = train.step_key(c, step)
    policy = train.make_policies(c, env, agents, c.sampling, version=step)["sub"]
    svc = train.colocated_sub_agent(c, env, policy, key)
    outcome = serve_step(ex, svc, step, timeout_s=timeout_s)
    batch, sm = train.sub_batch(c, env, svc.episodes, outcome, jax.random.fold_in(key, 2))
    m.update(sm)
    if c.variant == "mgrpo":  # frozen_sub: the same service, never an update.
      m.update(train._update(c, agents, {"sub": batch}, step))
    writer.write(step, m)
    train.save_after_step(ckpt, agents, step, every=c.checkpoint_every, last=c.num_steps)
  _finish(workdir, ckpt, writer, agents, env.tokenizer)


def _finish(workdir, ckpt, writer, agents, tokenizer) -> None:
  ckpt.wait()
  ckpt.close()
  writer.close()
  train._save_final_hf(workdir, agents, tokenizer)
