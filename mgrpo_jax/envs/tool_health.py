"""Tool health: what each tool did in a step, retries of a failing service, the outage stop.

Every tool (search, visit, python, delegate) records its calls, the replies that were tool
errors (code that raised, a document that does not exist) and each call's latency; a tool
behind a service (the Search-R1 retriever, the sandbox) also records its requests, its
failed ones (`failures`) and the retries. `step_metrics()` returns the step's counts as
`tools/<tool>/{calls,errors,requests,retries,failures}` and the latencies as
`time/tools/<tool>/latency_ms_{p50,p90,max}`, and starts the next step's.

A service's transient failure (HTTP 5xx, 408 or 429, a reset or refused connection, a
timeout, a malformed answer) is retried with exponential back-off and jitter; the agent
never sees it. A call still failing after `outage_s` seconds means the service is down:
`ToolOutage`, one line naming the tool, the URL and the last error. So does a step in which
more than `max_error_rate` of a service's requests failed (`check_error_rate`, checked when
a batch of episodes ends: during the rollout, before the step updates anything). The
programs let it end the run before the step's update, metrics line or checkpoint, so a
restart resumes from the last checkpoint as if the failed step never began.

Many processes: every process calls the tools and process 0's replies are kept
(`agents.rollout.run_episodes`). An outage is therefore raised where process 0 meets one
(`shared_outcome`): another process's own outage turns into an error reply that is
replaced by process 0's, so the processes' collective calls never diverge.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from typing import Callable, TypeVar

import jax
import numpy as np
from absl import logging

from mgrpo_jax import config_checks as checks
from mgrpo_jax import distributed

T = TypeVar("T")


class ToolOutage(RuntimeError):
  """A tool's service failed past the run's limits (`config.tools`): the run stops."""


@dataclasses.dataclass(frozen=True)
class Policy:
  """How failing services are retried and when the run stops (`config.tools`)."""

  outage_s: float = 300.0  # A call still failing after this long: the service is down.
  max_error_rate: float = 0.5  # Failed / all requests of a service in a step, at most.
  min_requests: int = 20  # Requests in a step before its error rate is judged.
  backoff_s: float = 0.25  # The first retry's delay; doubled per retry, jittered.
  max_backoff_s: float = 8.0  # The longest delay between two requests of one call.


def policy_from_config(c) -> Policy:
  """The `config.tools` block's policy; a config from before the block gets the defaults."""
  tools = c.get("tools") if c is not None and hasattr(c, "get") else None
  if not tools:
    return Policy()
  checks.check_config(c, {}, {"tools.outage_s": checks.POSITIVE,
                              "tools.max_error_rate": checks.PROBABILITY})
  return Policy(outage_s=float(tools.get("outage_s", Policy.outage_s)),
                max_error_rate=float(tools.get("max_error_rate", Policy.max_error_rate)))


@dataclasses.dataclass
class _Counts:
  calls: int = 0
  errors: int = 0
  requests: int = 0
  retries: int = 0
  failures: int = 0
  latency_ms: list = dataclasses.field(default_factory=list)
  service: str = ""
  last_error: str = ""


class Health:
  """Per-tool counts of the current step (thread-safe), and the retry policy."""

  def __init__(self, policy: Policy | None = None):
    self.policy = policy or Policy()
    self._lock = threading.Lock()
    self._counts: dict[str, _Counts] = collections.defaultdict(_Counts)
    self._rng = random.Random(0)  # Jitter only: no reply depends on it.

  def reset(self, policy: Policy | None = None) -> None:
    """Forgets the counts (a new run); `policy` replaces the current one when given."""
    with self._lock:
      self._counts.clear()
      if policy is not None:
        self.policy = policy

  def record_call(self, tool: str, seconds: float, *, error: bool = False) -> None:
    """One call of `tool` that took `seconds`; `error`: its reply was a tool error."""
    with self._lock:
      c = self._counts[tool]
      c.calls += 1
      c.errors += int(error)
      c.latency_ms.append(1e3 * seconds)

  def _request(self, tool: str, service: str, error: str | None, retry: bool) -> None:
    with self._lock:
      c = self._counts[tool]
      c.service = service
      c.requests += 1
      c.retries += int(retry)
      if error is not None:
        c.failures += 1
        c.last_error = error

  def request(self, tool: str, service: str, attempt: Callable[[float], T], *,
              transient: Callable[[BaseException], bool], timeout_s: float) -> T:
    """`attempt(timeout)` retried while it fails transiently, for at most `outage_s`.

    Each attempt gets `timeout_s`, cut to what is left of the deadline. A failure that is
    not transient (the service answered with an error of its own) is counted and raised.
    Raises `ToolOutage` when the deadline passes.
    """
    start, tries = time.monotonic(), 0
    while True:
      left = self.policy.outage_s - (time.monotonic() - start)
      try:
        out = attempt(max(min(timeout_s, left), 0.01))
      except Exception as e:  # noqa: BLE001 - classified just below
        what = describe(e)
        self._request(tool, service, what, tries > 0)
        if not transient(e):
          raise
        waited = time.monotonic() - start
        delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2**tries)
        delay *= 0.5 + 0.5 * self._rng.random()  # Jitter: many clients do not retry in step.
        if waited >= self.policy.outage_s:
          raise ToolOutage(f"{tool}: the service at {service} failed for {waited:.0f} s "
                           f"(config.tools.outage_s={self.policy.outage_s:g}); last error: "
                           f"{what}") from None  # fmt: skip
        # At most a line every 10 s: a flaky service at scale fails many requests a second.
        logging.log_every_n_seconds(logging.WARNING, "%s: %s failed (%s); retry %d in %.2f s.",
                                    10, tool, service, what, tries + 1, delay)  # fmt: skip
        time.sleep(min(delay, max(self.policy.outage_s - waited, 0.0)))
        tries += 1
        continue
      self._request(tool, service, None, tries > 0)
      return out

  def check_error_rate(self) -> None:
    """Raises `ToolOutage` (process 0's verdict, on every process) when a service's failed
    requests in this step pass `max_error_rate` (judged from `min_requests` requests on)."""
    verdict = None
    with self._lock:
      for tool, c in sorted(self._counts.items()):
        if c.requests >= self.policy.min_requests and \
            c.failures > self.policy.max_error_rate * c.requests:
          verdict = (f"{tool}: the service at {c.service} failed {c.failures} of "
                     f"{c.requests} requests in this step (config.tools.max_error_rate="
                     f"{self.policy.max_error_rate:g}); last error: {c.last_error}")
          break
    verdict = distributed.broadcast_object(verdict)
    if verdict is not None:
      raise ToolOutage(verdict)

  def step_metrics(self) -> dict[str, float]:
    """The step's counts per tool called in it (see the module doc); starts the next step."""
    with self._lock:
      counts, self._counts = self._counts, collections.defaultdict(_Counts)
    m = {}
    for tool, c in sorted(counts.items()):
      p = f"tools/{tool}/"
      m.update({p + "calls": c.calls, p + "errors": c.errors})
      if c.requests:
        m.update({p + "requests": c.requests, p + "retries": c.retries,
                  p + "failures": c.failures})
      if c.latency_ms:  # Under time/: wall-clock figures, which no rerun repeats.
        ms, t = np.asarray(c.latency_ms), f"time/{p}"
        m.update({t + "latency_ms_p50": float(np.percentile(ms, 50)),
                  t + "latency_ms_p90": float(np.percentile(ms, 90)),
                  t + "latency_ms_max": float(ms.max())})
    return m


# The process's tools record here; a program's set-up calls `configure`.
HEALTH = Health()


def configure(c=None) -> None:
  """A new run: counts forgotten, the policy of `c.tools` (defaults without one)."""
  HEALTH.reset(policy_from_config(c))


def step_metrics() -> dict[str, float]:
  """`HEALTH.step_metrics()`: the step's tool counts, to merge into its metrics."""
  return HEALTH.step_metrics()


def check_error_rate() -> None:
  HEALTH.check_error_rate()


def describe(e: BaseException) -> str:
  """An exception as one short line: its type and message."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def timed(tool: str, run: Callable[[], str], is_error: Callable[[str], bool]) -> str:
  """`run()`'s reply, its call recorded under `tool` (an outage propagates, not recorded)."""
  start = time.perf_counter()
  reply = run()
  HEALTH.record_call(tool, time.perf_counter() - start, error=is_error(reply))
  return reply


def shared_outcome(fn: Callable[..., T], *args) -> T:
  """`fn(*args)` on every process with process 0's outcome kept: its value, or its
  `ToolOutage` raised on every process (see the module doc)."""
  try:
    outcome = ("ok", fn(*args))
  except ToolOutage as e:
    if jax.process_count() == 1:
      raise
    outcome = ("outage", str(e))
  kind, value = distributed.broadcast_object(outcome)
  if kind == "outage":
    raise ToolOutage(value)
  return value


def raise_here() -> bool:
  """Whether this process raises its own `ToolOutage` (process 0), rather than letting it
  become an error reply that process 0's replaces."""
  return distributed.is_primary()
