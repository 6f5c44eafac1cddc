"""Bounded staleness: the rollouts of the next k steps play while a step updates.

With `config.max_staleness = k >= 1` a program's update (`loop.step_driver`) is a `Pipeline`:
a rollout thread plays step s with policy version s - k (the weights after update s - k - 1;
never older than the run's first step, whose weights are the restored ones), and the
learner (the loop's thread) trains step t on the rollouts of step t, then publishes
version t + 1. So while update t runs, the rollouts of steps t + 1 .. t + k are in flight
or waiting in a queue of at most k, and every row trained at step t was sampled by version
t - k or newer: its lag is at most k, for every agent (`check`; `StalenessError` else).

JAX dispatches asynchronously, so even on one device the update's device work overlaps
the next rollout's host work (tool calls, tokenising, rewards); with the devices split
(`config.rollout_devices`, `handoff.py`) the two run on their own devices.

Determinism: the rollout of step s always uses version s - k and the key of step s, so a
run is a function of its seed and its first step. A resumed run starts its rollouts from
the restored version (the k versions before it are not checkpointed): it is not
bit-identical to an uninterrupted one, though every row still lags at most k.
"""

import dataclasses
import json
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable

import jax
from absl import logging

TIMELINE_FILE = "timeline.jsonl"
_POLL_S = 0.1  # How often a blocked thread checks for a stop.


class StalenessError(RuntimeError):
  """A trajectory would be trained on more versions behind than `max_staleness` allows."""


def behaviour_version(step: int, k: int, start: int) -> int:
  """The policy version that plays step `step` with bound `k` in a run started at `start`."""
  return max(step - k, start)


def check(step: int, k: int, versions: Iterable[int], what: str = "rollouts") -> None:
  """Refuses rows whose behaviour version lags the version trained at `step` by more than k."""
  versions = list(versions)
  if versions and step - min(versions) > k:
    raise StalenessError(f"step {step}: {what} of policy version {min(versions)} are "
                         f"{step - min(versions)} versions behind; config.max_staleness={k}.")


@dataclasses.dataclass(frozen=True)
class _Played:
  step: int
  version: int
  rollouts: Any
  start_s: float
  end_s: float
  error: BaseException | None = None


class _Versions:
  """Published policy versions; a reader waits for the one it needs, older ones are let go."""

  def __init__(self):
    self._cond, self._weights = threading.Condition(), {}

  def put(self, version: int, weights) -> None:
    with self._cond:
      self._weights[version] = weights
      self._cond.notify_all()

  def take(self, version: int, stopped: threading.Event):
    """Version `version` once published (None after a stop); drops every older one."""
    with self._cond:
      while version not in self._weights:
        if stopped.is_set():
          return None
        self._cond.wait(_POLL_S)
      for v in [v for v in self._weights if v < version]:
        del self._weights[v]  # No later step plays an older version: its buffers can go.
      return self._weights[version]


class Pipeline:
  """A pipelined update: `update(step)` as `loop.step_driver` returns it, plus `close()`.

  `play(step, weights)` plays a step with the published `weights` of its behaviour version
  (in the rollout thread); `learn(step, rollouts)` and `train(batches, step)` are the
  sequential step's phases; `publish(version)` snapshots the agents' current weights for
  the sampler (`handoff.Handoff.publish`); `versions(rollouts)` lists the behaviour
  versions the rows recorded (checked against the bound; None: only the version played).
  `warm()` (optional) compiles the learner's host programs ahead: it runs on the learner
  while the first step plays, time the learner would spend waiting, so that the first
  batches are ready when the first rollouts are. Steps `start .. num_steps - 1` are played;
  `timeline_dir` (process 0's workdir) gets the intervals of every phase of this process's
  steps (`TIMELINE_FILE`) at `close`.
  """

  def __init__(self, *, play: Callable[[int, Any], Any], learn, train,
               publish: Callable[[int], Any], k: int, start: int, num_steps: int,
               versions: Callable[[Any], Iterable[int]] | None = None,
               warm: Callable[[], Any] | None = None, timeline_dir: str = ""):
    if k < 1:
      raise ValueError(f"A pipeline needs max_staleness >= 1, got {k}.")
    self._play, self._learn, self._train, self._publish = play, learn, train, publish
    self.k, self.start, self.num_steps, self._versions_of = k, start, num_steps, versions
    self._warm = warm
    self._timeline_dir, self.timeline, self._t0 = timeline_dir, [], time.perf_counter()
    self._stopped, self._published = threading.Event(), _Versions()
    # At most k finished rollouts wait: the version gate allows no more (see the module doc).
    self._queue: queue.Queue = queue.Queue(maxsize=k)
    self._put_version(start)
    self._thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
    self._thread.start()

  def _now(self) -> float:
    return time.perf_counter() - self._t0

  def _event(self, kind: str, step: int, start_s: float, end_s: float) -> None:
    self.timeline.append(dict(kind=kind, step=step, start_s=round(start_s, 6),
                              end_s=round(end_s, 6)))

  def _put_version(self, version: int) -> None:
    t0 = self._now()
    weights = self._publish(version)  # Dispatched: the copy lands while the sampler decodes.
    self._published.put(version, weights)

    def landed():  # The handoff's interval ends when its arrays are ready.
      jax.block_until_ready(weights)
      self._event("handoff", version, t0, self._now())
    threading.Thread(target=landed, name=f"handoff-{version}", daemon=True).start()

  def _produce(self) -> None:
    for step in range(self.start, self.num_steps):
      version = behaviour_version(step, self.k, self.start)
      weights = self._published.take(version, self._stopped)
      if weights is None:
        return
      t0 = self._now()
      try:
        played = _Played(step, version, self._play(step, weights), t0, self._now())
      except BaseException as e:  # Raised in the learner at this step (`update`).
        played = _Played(step, version, None, t0, self._now(), error=e)
      while not self._stopped.is_set():
        try:
          self._queue.put(played, timeout=_POLL_S)
          break
        except queue.Full:
          pass
      if played.error is not None or self._stopped.is_set():
        return

  def _next(self, step: int) -> _Played:
    while True:
      try:
        return self._queue.get(timeout=_POLL_S)
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          raise RuntimeError(f"step {step}: the rollout thread stopped without its rollouts.")

  def __call__(self, step: int) -> dict:
    if self._warm is not None:
      t0, self._warm = self._now(), self._warm()  # Once, while the first step plays.
      self._event("warm", step, t0, self._now())
    t_wait = self._now()
    played = self._next(step)
    if played.error is not None:
      raise played.error
    if played.step != step:
      raise RuntimeError(f"The rollout thread played step {played.step}; step {step} is due.")
    # Both the version played and every version the rows recorded (delegations included).
    check(step, self.k, [played.version], "rollouts")
    lag = step - played.version
    if self._versions_of is not None:
      recorded = list(self._versions_of(played.rollouts))
      check(step, self.k, recorded, "recorded rows")
      lag = max([lag] + [step - v for v in recorded])
    t_host = self._now()
    batches, m = self._learn(step, played.rollouts)
    t_train = self._now()
    m.update(self._train(batches, step))
    t_end = self._now()
    if step + 1 + self.k < self.num_steps:
      self._put_version(step + 1)  # Played by step + 1 + k: published only if that step runs.
    self._event("rollout", step, played.start_s, played.end_s)
    self._event("host", step, t_host, t_train)
    self._event("update", step, t_train, t_end)
    dt = played.end_s - played.start_s
    m.update({"time/rollout_s": dt, "time/rollout_wait_s": t_host - t_wait,
              "time/host_s": t_train - t_host, "time/update_s": t_end - t_train,
              "pipeline/version_lag": float(step - played.version),
              "pipeline/max_lag": float(lag)})  # The most any row trained here lags.
    if hasattr(played.rollouts, "num_generated"):
      m["tokens_per_s"] = played.rollouts.num_generated / max(dt, 1e-9)
    return m

  def close(self) -> None:
    """Stops the rollout thread and writes the timeline."""
    self._stopped.set()
    self._thread.join(timeout=60)
    if self._thread.is_alive():
      logging.warning("The rollout thread did not stop within 60 s; leaving it (a daemon).")
    if self._timeline_dir:
      os.makedirs(self._timeline_dir, exist_ok=True)
      with open(os.path.join(self._timeline_dir, TIMELINE_FILE), "w") as f:
        # Times are seconds since the first line's `perf_counter_s` (this process's clock).
        f.write(json.dumps(dict(kind="start", step=self.start, start_s=0.0, end_s=0.0,
                                perf_counter_s=self._t0)) + "\n")
        for e in sorted(list(self.timeline), key=lambda e: e["start_s"]):
          f.write(json.dumps(e) + "\n")
