"""Delegations and the main agent's outcome over an Exchange: the decoupled protocol.

The main agent and the sub-agent as separate programs share only an Exchange
(`decoupled.py` runs them); this module is what they say to each other.

What crosses (algorithm.md 1.6): delegation requests and their results (text, ids, the
sub-agent's policy version), the per-rollout outcomes R_M[Q, K] and correct[Q, K] as
arrays, and step markers: `requests_done` once a step's rollouts are over (no request of
it will come), `rollouts_done` once its outcome is published. The sub-agent keeps its own
episodes.

Streaming: the main agent writes each delegation's request as its turn ends
(`ExchangeSubAgent.submit`) and its episode goes on as soon as that one result is back;
the sub-agent admits requests into its running engine as they appear and writes each
result as its episode ends (`serve_step`). Nothing waits for a batch.

Determinism is what makes a restart safe: a request is keyed by (step, q, k, call) and its
sub-agent episode samples from a key derived from the step and its own stream, exactly as
the colocated `ColocatedSubAgent` does, whatever else runs beside it, so a restarted program
rewrites identical records (`Exchange.put` returns False) and never double-counts a step; a
record that differs raises `ExchangeConflict` instead of passing silently. With
`max_staleness >= 1` a restarted program plays from another version than the one that
played before. A restarted sub-agent reads back the episodes behind results already
written (`sub_episode`). A restarted main program reads back the episodes of the steps
whose outcome was published (`main_episode`: the sub-agent may have trained on them), and
plays the others again as a new attempt in a namespace of its own (`Attempts`), which the
sub-agent program follows: it serves and trains those steps again (`MainRestarted`).

One URL (any kvstore URL or JSON spec) holds a whole decoupled run:

  <run>/exchange/...             the exchange's records and arrays (the main's attempt 0)
  <run>/exchange/attempt-<a>/... those of the main program's attempt a >= 1 (`Attempts`)
  <run>/main/checkpoints/<step>  the main agent's orbax checkpoints
  <run>/sub/checkpoints/<step>   the sub-agent's
"""

import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np
from absl import logging

from mgrpo_jax.agents import native, rollout, subagent
from mgrpo_jax.envs import tool_health
from mgrpo_jax.exchange import (Exchange, ExchangeConflict, ExchangeError, ExchangeTimeout,
                                kvstore_spec)
from mgrpo_jax.mgrpo import hierarchy

EXCHANGE_DIR = "exchange"  # The exchange's namespace inside a run location.
EVAL_STEP_BASE = 10_000_000  # Exchange step ids of evaluation rollouts: base + step.
POLL_S = 0.005  # First wait between polls for results or requests; it grows while none come.
MAX_POLL_S = 0.5  # Its cap: object stores bill per request.
BUSY_POLL_S = 0.02  # While its engine decodes, the sub-agent looks for requests this often.
WAIT_SLICE_S = 1.0  # The longest one look for requests waits (the engine then looks again).
ATTEMPT = "main_attempt"  # Marker kind: the main program's attempt a -> the first step it plays.


def open_exchange(run) -> Exchange:
  """The exchange of the run at `run` (a kvstore URL, JSON spec or local path)."""
  return Exchange(run, run=EXCHANGE_DIR)


def checkpoint_location(run, role: str) -> dict:
  """The kvstore spec of `role`'s checkpoints in the run at `run`."""
  return kvstore_spec(run, f"{role}/checkpoints")


class MainRestarted(RuntimeError):
  """The main program restarted and plays step `step` (or evaluates it) again, as another
  attempt: what this program did of that step is void, and it does the step again."""

  def __init__(self, step: int):
    super().__init__(f"The main program restarted: step {step} is played again in its new "
                     f"attempt's namespace.")
    self.step = step


class Attempts:
  """The main program's attempts on a run (with max_staleness >= 1), each with a namespace
  of its own on the exchange: attempt 0 the exchange itself, attempt a `<exchange>/attempt-a`.

  A restarted main program plays from its restored version, not from the ones that played
  before, so a step it plays again makes other requests than its killed attempt's. A new
  attempt (`begin`) reads back the steps whose outcome was published (the sub-agent may
  have trained on them; `read_main_episodes`) and plays from the first other one, `first`:
  it owns the training steps >= first and the evaluations of steps > first (the weights
  evaluated at `first` are those every attempt had there), until a later attempt takes
  over. Only the main program (under its lease) writes attempts.
  """

  def __init__(self, run):
    self.run, self.base = run, open_exchange(run)
    self._open = {0: self.base}

  def firsts(self) -> dict[int, int]:
    """{attempt: its first step}, as the main program registered them."""
    return {a: self.base.wait_mark(ATTEMPT, a, timeout_s=0)["first"]
            for a in self.base.marks(ATTEMPT)}

  def owner(self, step: int, *, evaluation: bool = False) -> int:
    """The attempt whose records of training step `step` (of its evaluation) count."""
    firsts = self.firsts()
    return max([a for a, f in firsts.items() if (f < step if evaluation else f <= step)],
               default=0)

  def exchange(self, attempt: int) -> Exchange:
    if attempt not in self._open:
      self._open[attempt] = Exchange(self.run, run=f"{EXCHANGE_DIR}/attempt-{attempt}")
    return self._open[attempt]

  def check(self, step: int, attempt: int, *, evaluation: bool = False) -> None:
    """Raises `MainRestarted` if another attempt than `attempt` now owns `step`."""
    if self.owner(step, evaluation=evaluation) != attempt:
      raise MainRestarted(step)

  def published(self, start: int, num_steps: int) -> int:
    """The first step from `start` whose outcome no attempt published."""
    step = start
    while step < num_steps and self.exchange(self.owner(step)).try_mark(
        "rollouts_done", step) is not None:
      step += 1
    return step

  def begin(self, first: int) -> int:
    """Registers a new attempt that plays from step `first`; returns its number."""
    attempt = max(self.base.marks(ATTEMPT), default=-1) + 1
    self.base.mark(ATTEMPT, attempt, {"first": first})
    return attempt


class StaleResultError(RuntimeError):
  """A sub-agent result was produced by a policy older than the staleness bound allows."""


class ExchangeSubAgent:
  """The main agent's `SubAgentService` in a decoupled run: delegations go over the exchange.

  Records are keyed by (step, q, k, call) with this service's `step`, which namespaces
  them: a training step's own, or `EVAL_STEP_BASE + step` for an evaluation's. `submit`
  streams (each result handed back as it arrives, by one polling thread); `delegate` waits
  for a whole batch (several processes, whose schedules must line up).
  """

  def __init__(self, exchange: Exchange, *, step: int, timeout_s: float,
               version: int | None = None, max_staleness: int = 0):
    self.exchange, self.step, self.timeout_s = exchange, step, timeout_s
    # Results from a sub-agent policy older than version - max_staleness are refused.
    self.version, self.max_staleness = version, max_staleness
    self.waves = 0  # Batches sent (one per decode call whose turns delegated).
    self.requests = 0
    self.polls = 0  # Round trips of the results' polling (each reads every pending key).
    # Batches are sent from threads of their own (the engine's tool threads, `submit`'s).
    self._cond = threading.Condition()
    self._pending: dict[tuple, tuple] = {}  # key -> (index, on_result, deadline)
    self._poller: threading.Thread | None = None

  def _keys(self, requests) -> list[tuple[int, int, int, int]]:
    return [(self.step, r.q, r.k, r.call) for r in requests]

  def send(self, requests: Sequence[subagent.DelegationRequest]) -> int:
    """Writes the requests; returns the batch's index (counted before its records appear)."""
    with self._cond:
      wave, self.waves = self.waves, self.waves + 1
      self.requests += len(requests)
    for r, key in zip(requests, self._keys(requests)):
      self.exchange.put("request", key, {"subtask": r.subtask, "context": r.context})
    return wave

  def _result(self, key, r: dict) -> subagent.DelegationResult:
    if self.version is not None and r["policy_version"] < self.version - self.max_staleness:
      raise StaleResultError(
          f"Result {key} came from sub-agent policy version {r['policy_version']}, more than "
          f"config.max_staleness={self.max_staleness} behind version {self.version}.")
    return subagent.DelegationResult(r["text"], r["policy_version"], r["format_ok"])

  def receive(self, requests: Sequence[subagent.DelegationRequest]):
    """The results of `requests`, waiting for them up to `timeout_s`."""
    keys = self._keys(requests)
    results = self.exchange.get_many("result", keys, timeout_s=self.timeout_s)
    return [self._result(key, r) for key, r in zip(keys, results)]

  def delegate(self, requests: Sequence[subagent.DelegationRequest]):
    self.send(requests)
    return self.receive(requests)

  def submit(self, requests: Sequence[subagent.DelegationRequest],
             on_result: Callable[[int, object], None]) -> None:
    """Writes the requests (in a thread: an object store's writes would hold up the caller's
    engine); `on_result(i, result or exception)` is called (from a thread of this service)
    for request i as soon as its own result is read."""

    def write():
      try:
        self.send(requests)
      except BaseException as e:  # E.g. ExchangeConflict: each request's episode raises it.
        for i in range(len(requests)):
          on_result(i, e)
        return
      deadline = time.monotonic() + self.timeout_s
      with self._cond:
        for i, key in enumerate(self._keys(requests)):
          self._pending[key] = (i, on_result, deadline)
        self._cond.notify()
        if self._poller is None:
          self._poller = threading.Thread(target=self._poll, name="results", daemon=True)
          self._poller.start()

    threading.Thread(target=write, name="requests", daemon=True).start()

  def _poll(self) -> None:
    delay = POLL_S
    while True:
      with self._cond:
        if not self._pending:
          self._poller = None  # Under the lock: `submit` starts a new one when needed.
          return
        keys = list(self._pending)
      records = self.exchange.try_get_many("result", keys)
      self.polls += 1
      now, arrived = time.monotonic(), []
      with self._cond:
        for key, rec in zip(keys, records):
          i, on_result, deadline = self._pending[key]
          if rec is not None:
            try:
              arrived.append((i, on_result, self._result(key, rec)))
            except StaleResultError as e:
              arrived.append((i, on_result, e))
          elif now > deadline:
            arrived.append((i, on_result, ExchangeTimeout(
                f"No result for {key} within {self.timeout_s} s in {self.exchange!r}; is "
                f"the sub-agent running?", [str(key)])))
          else:
            continue
          del self._pending[key]
      for i, on_result, res in arrived:
        on_result(i, res)
      if arrived:
        delay = POLL_S
        continue
      with self._cond:
        self._cond.wait(delay)  # A new submission wakes it.
      delay = min(delay * 1.5, MAX_POLL_S)

  def close(self) -> None:
    """Marks the step's requests as all sent: the sub-agent's `serve_step` may end it."""
    try:
      self.exchange.mark("requests_done", self.step, {"waves": self.waves,
                                                       "requests": self.requests})
    except ExchangeConflict as e:
      # An evaluation played again (by a restarted main program) sends the same requests,
      # each checked by its own record, but may batch them otherwise: their count agrees.
      if self.step < EVAL_STEP_BASE or e.existing.get("requests") != self.requests:
        raise


def publish_outcome(exchange: Exchange, step: int, outcome: hierarchy.MainOutcome,
                    waves: int) -> None:
  """What the sub-agent needs to train on step `step`, then the marker that says it is there."""
  exchange.put_array("main_reward", step, outcome.reward)
  exchange.put_array("main_correct", step, outcome.correct)
  exchange.put_array("main_format", step, outcome.format_ok)
  exchange.mark("rollouts_done", step, {"waves": waves})


def get_outcome(exchange: Exchange, step: int, *, timeout_s: float,
                check: Callable[[], None] | None = None) -> hierarchy.MainOutcome:
  """The main agent's outcome of `step`, as `publish_outcome` wrote it.

  With `check` (which raises when the step's records no longer count: `Attempts.check`)
  its marker is awaited first, `check` called between looks: a main program killed while
  publishing leaves arrays but no marker, and its next attempt plays the step again.
  """
  if check is not None:
    deadline, delay = time.monotonic() + timeout_s, POLL_S
    while exchange.try_mark("rollouts_done", step) is None:
      check()
      if time.monotonic() > deadline:
        raise ExchangeTimeout(f"No outcome of step {step} within {timeout_s} s in "
                              f"{exchange!r}; is the main agent running?", [str(step)])
      time.sleep(delay)
      delay = min(delay * 1.5, MAX_POLL_S)
  get = lambda name: np.asarray(exchange.get_array(name, step, timeout_s=timeout_s))
  return hierarchy.MainOutcome(get("main_reward"), get("main_correct"), get("main_format"))


def _put_result(exchange: Exchange, key, res: subagent.DelegationResult) -> None:
  exchange.put("result", key, {"text": res.text, "policy_version": res.policy_version,
                               "format_ok": res.format_ok})


def serve_requests(exchange: Exchange, service, keys, *, timeout_s: float = 0.0) -> None:
  """Serves the requests under `keys` as one batch through `service`; writes their results."""
  keys = [tuple(k) for k in keys]
  reqs = exchange.get_many("request", keys, timeout_s=timeout_s)
  requests = [subagent.DelegationRequest(*k, subtask=r["subtask"], context=r["context"])
              for k, r in zip(keys, reqs)]
  for key, res in zip(keys, service.delegate(requests)):
    _put_result(exchange, key, res)


def _issued(exchange: Exchange, step: int) -> bool:
  """Whether the main agent has sent every request of `step`."""
  return any(exchange.try_mark(kind, step) is not None
             for kind in ("requests_done", "rollouts_done"))


def serve_step(exchange: Exchange, service: rollout.ColocatedSubAgent, step: int, *,
               timeout_s: float, poll_s: float = POLL_S, read_outcome: bool = True,
               rows: int = 8, stored: bool = False,
               check: Callable[[], None] | None = None) -> hierarchy.MainOutcome | None:
  """Serves every delegation of `step` through `service` (which keeps the episodes), each
  admitted into one running engine as its request appears and answered as it ends.

  `rows`: the episodes that may run at once (the main agent's Q * K: the slots of its
  engine's sub-agent lane). `stored`: each served episode is also written to the exchange
  (`sub_episode`), and one already there is read back rather than played again (the
  episodes of a restarted sub-agent whose version differs from the one that served them).
  `check()` is called while no request comes (it raises when the step's requests no longer
  count: `Attempts.check`). Returns the main agent's outcome for the step once it is
  published (None for evaluation steps, `read_outcome=False`, which publish no outcome).
  Raises `TimeoutError` naming what is missing when the main agent does not show up for
  `timeout_s`.
  """
  seen: set = set()
  # When the requests were last listed; since when nothing came while idle; the next wait.
  last, idle_since, delay = [-BUSY_POLL_S], [None], [poll_s]

  def discover(wait: bool):
    """(new keys, their requests, their stored episodes, whether the step is over).

    An idle engine's call waits for requests, up to WAIT_SLICE_S: several processes wait
    for process 0's answer in a collective, which should not last long.
    """
    now = time.monotonic()
    if not wait:
      idle_since[0], delay[0] = None, poll_s
      if now - last[0] < BUSY_POLL_S:
        return [], [], [], False  # Not a round trip per decode call of a busy engine.
    elif idle_since[0] is None:
      idle_since[0] = now
    slice_end = now + WAIT_SLICE_S
    while True:
      last[0] = time.monotonic()
      # The marker first: a listing made after it holds every request of the step. Only an
      # idle engine ends the step.
      over = wait and _issued(exchange, step)
      keys = [k for k in exchange.list("request", (step,)) if k not in seen]
      if keys:
        idle_since[0], delay[0] = None, poll_s
        reqs = exchange.get_many("request", keys, timeout_s=timeout_s)
        eps = exchange.try_get_many("sub_episode", keys) if stored else [None] * len(keys)
        return keys, reqs, eps, False
      if wait and check is not None and not over:
        check()  # A main program's next attempt may play this step again elsewhere.
      if over or not wait or time.monotonic() > slice_end:
        if wait and time.monotonic() - idle_since[0] > timeout_s:
          raise TimeoutError(f"Sub-agent: no new request of step {step} and no "
                             f"requests_done marker within {timeout_s}s; is the main agent "
                             f"running?")
        return [], [], [], over
      time.sleep(delay[0])
      delay[0] = min(delay[0] * 1.5, MAX_POLL_S)

  def feed(idle: bool):
    # Every process of a multi-host program admits what process 0 found, at the same pass.
    keys, reqs, eps, over = (tool_health.shared_outcome(discover, idle)
                             if jax.process_count() > 1 else discover(idle))
    if over:
      return None
    seen.update(keys)
    if any(ep is not None for ep in eps):
      logging.info("Sub-agent: step %d: %d stored episodes read back (served before a "
                   "restart).", step, sum(ep is not None for ep in eps))
    out = []
    for key, r, ep in zip(keys, reqs, eps):
      req = subagent.DelegationRequest(*key, subtask=r["subtask"], context=r["context"])
      out.append(service.new_episode(req) if ep is None else episode_of(ep, req, service))
    return out

  def done(ep) -> None:
    key = (step, ep.q, ep.k, ep.call)
    if stored:  # Before its result: a result always has its episode.
      exchange.put("sub_episode", key, episode_record(ep))
    _put_result(exchange, key, subagent.result_of(ep))

  service.serve(feed, rows=rows, done=done)
  if not read_outcome:
    return None
  return get_outcome(exchange, step, timeout_s=timeout_s, check=check)


_EPISODE_FIELDS = ("tokens", "loss_mask", "logprobs", "policy_version", "protocol", "turns",
                   "observations", "actions", "gen_seconds", "tool_seconds",
                   "delegation_versions", "delegations")


def episode_record(ep) -> dict:
  """A finished episode (of either agent) as a JSON record (`episode_of` and
  `read_main_episodes` read it back)."""
  rec = {f: getattr(ep, f) for f in _EPISODE_FIELDS}
  rec["failure"] = ep.failure
  rec["experts"] = None if ep.experts is None else {"dtype": str(ep.experts.dtype),
                                                    "ids": ep.experts.tolist()}
  return rec


def episode_of(rec: dict, req: subagent.DelegationRequest, service) -> rollout.Episode:
  """The sub-agent episode `episode_record` wrote: its turns replayed through a fresh
  validator."""
  return _episode_of(rec, "sub", req.q, req.k, req.call, req, service.limits.max_turns)


def put_main_episodes(exchange: Exchange, step: int, episodes) -> None:
  """Stores step `step`'s main episodes (before its outcome: `read_main_episodes`)."""
  for ep in episodes:
    exchange.put("main_episode", (step, ep.q, ep.k), episode_record(ep))


def read_main_episodes(exchange: Exchange, step: int, questions, num_rollouts: int,
                       max_turns: int) -> list[rollout.Episode]:
  """Step `step`'s main episodes in (q, k) order, as `put_main_episodes` stored them."""
  keys = [(step, q, k) for q in range(len(questions)) for k in range(num_rollouts)]
  recs = exchange.try_get_many("main_episode", keys)
  if any(rec is None for rec in recs):
    raise ExchangeError(f"Step {step}'s outcome is published in {exchange!r} without its "
                        f"main episodes: was it written with max_staleness=0?")
  return [_episode_of(rec, "main", q, k, -1, questions[q], max_turns)
          for (_, q, k), rec in zip(keys, recs)]


def _episode_of(rec: dict, role: str, q: int, k: int, call: int, task,
                max_turns: int) -> rollout.Episode:
  ep = rollout.Episode(role=role, q=q, k=k, call=call, task=task, tokens=[], loss_mask=[],
                       logprobs=[], validator=native.Dialect(rec["protocol"]).validator(
                           role, max_turns))
  for f in _EPISODE_FIELDS:
    setattr(ep, f, rec[f])
  for turn in ep.turns:
    ep.validator.step(turn)
  if (rec["failure"] or "").startswith("aborted: "):  # E.g. a context overflow.
    ep.validator.abort(rec["failure"][len("aborted: "):])
  if rec["experts"] is not None:
    ep.experts = np.asarray(rec["experts"]["ids"], rec["experts"]["dtype"])
  if ep.failure != rec["failure"]:
    raise ValueError(f"Stored {role} episode {(q, k, call)} replays to failure "
                     f"{ep.failure!r}, stored {rec['failure']!r}.")
  return ep
