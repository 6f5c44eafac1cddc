"""The one training loop: evaluate, update, write metrics, checkpoint, resume, final export.

Every program (colocated M-GRPO, the decoupled main and sub programs, SFT, MAGRPO) resumes
with `resume`, builds its update with `step_driver` from its own phases, and runs
`train_loop` with it and its own `evaluate(step)`. Step s evaluates before its update (step
0 = the starting weights) and the last step evaluates once more on its own line, so a
resumed run rewrites exactly the lines an uninterrupted one writes.
"""

import dataclasses
import os
import time
from typing import Any, Callable

import jax
from absl import logging

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import metrics as metrics_lib
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.envs import tool_health


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How many steps, and how often to evaluate and to checkpoint."""

  num_steps: int
  eval_every: int
  checkpoint_every: int
  log_every: int = 1  # Steps between plain log lines when no terminal shows the bar.

  def evaluates(self, step: int) -> bool:
    return step % self.eval_every == 0 or step == self.num_steps

  def saves_after(self, step: int) -> bool:
    return (step + 1) % self.checkpoint_every == 0 or step + 1 == self.num_steps

  @classmethod
  def of(cls, c) -> "Schedule":
    """The schedule of a config's top-level `num_steps`, `*_every` fields."""
    return cls(c.num_steps, c.eval_every, c.checkpoint_every, c.log_every)


# A program's phases (`step_driver`): step -> its rollouts; (step, rollouts) -> (a batch per
# role or agent, metrics); (batches, step) -> the train step's metrics.
Rollout = Callable[[int], Any]
Learn = Callable[[int, Any], tuple[dict, dict]]
Train = Callable[[dict, int], dict]


def resume(ckpt: ckpt_lib.Checkpointer, agents: dict, workdir: str, c) -> int:
  """The first step: the latest checkpoint's, restored into `agents` (0 without one).

  A fresh run writes its config `c` to `workdir` here, after the program's start-up checks:
  a refused start leaves nothing behind.
  """
  fresh = ckpt.latest_step() is None
  start = workdir_lib.restore_agents(ckpt, agents)
  if fresh:
    workdir_lib.write_config(workdir, c)
  return start


def step_driver(*, rollout: Rollout | None, learn: Learn, train: Train) -> Callable[[int], dict]:
  """The update of every program, from its phases: rollouts, learning, training.

  `rollout(step)` plays the step (None: a program without rollouts, SFT); `learn(step,
  rollouts)` turns them into batches and metrics; `train(batches, step)` runs the train
  steps. Rollouts with `num_generated` (tokens) also give the engine's `tokens_per_s`.
  This is the sequential step (`max_staleness = 0`); `pipeline.Pipeline` is the pipelined
  one, built from the same phases.
  """

  def update(step: int) -> dict:
    t0 = time.perf_counter()
    # An exception before `train` (a tool outage during the rollouts) escapes the loop with
    # no metrics line, no trained update and no checkpoint for this step: a restart redoes it.
    rollouts = rollout(step) if rollout is not None else None
    t_roll = time.perf_counter() - t0
    batches, m = learn(step, rollouts)
    t_train = time.perf_counter()
    m.update(train(batches, step))
    # The phases' wall-clock (host work: rewards, advantages, batching; then the update).
    m["time/host_s"] = t_train - t0 - t_roll
    m["time/update_s"] = time.perf_counter() - t_train
    if rollout is not None:
      m["time/rollout_s"] = t_roll
    if hasattr(rollouts, "num_generated"):
      m["tokens_per_s"] = rollouts.num_generated / t_roll
    return m

  return update


def train_loop(workdir: str, agents: dict, ckpt: ckpt_lib.Checkpointer, schedule: Schedule, *,
               start: int, evaluate: Callable[[int], dict], update: Callable[[int], dict],
               tokenizer=None, desc: str = "", show=(), first: dict | None = None) -> dict:
  """Runs steps `start ... schedule.num_steps` and returns the last update's metrics.

  `evaluate(step)` and `update(step)` return metrics to write (`update` also changes the
  agents' states); `first` is merged into the first line this call writes (MAGRPO's warm
  start). `show` names the metrics on the progress bar. After the loop the checkpoints are
  committed and the agents' final weights exported under `workdir/hf`.
  """
  writer = metrics_lib.open_writer(workdir)  # The sinks of the run's config.log_to.
  writer.truncate_after(start - 1)  # A restart rewrites the lines after its checkpoint.
  progress = metrics_lib.Progress(schedule.num_steps, initial=start, desc=desc,
                                  log_every=schedule.log_every)
  name, t_start = desc or "run", time.perf_counter()
  last, first, shown = {}, dict(first or {}), {}
  tool_health.step_metrics()  # The set-up's tool calls (a warm start's traces) are no step's.
  for step in range(start, schedule.num_steps + 1):
    m, first = first, {}
    if schedule.evaluates(step):
      if step == start:
        logging.info("%s: evaluating step %d (the first evaluation compiles the sampler).",
                     name, step)
      m.update(evaluate(step))
    if step == schedule.num_steps:
      writer.write(step, {**m, **tool_health.step_metrics()})
      break
    if step == start:
      logging.info("%s: step %d of %d; the first update compiles the step (minutes for a "
                   "large model), later steps reuse it.", name, step, schedule.num_steps)
    t0 = time.perf_counter()
    m.update(update(step))
    m["time/step_s"] = time.perf_counter() - t0
    m.update(tool_health.step_metrics())  # The step's tool calls, its evaluation's included.
    m.update(metrics_lib.device_memory())  # GPU only: the allocator's peak so far.
    writer.write(step, m)
    last = m
    shown.update({k: m[k] for k in show if k in m})  # Evaluation keys keep their last value.
    progress.update(1, shown)
    if schedule.saves_after(step):
      ckpt.save(step + 1, {n: a.state for n, a in agents.items()}, {"step": step + 1})
  logging.info("%s: writing the last checkpoint.", name)
  ckpt.wait()
  ckpt.close()
  writer.close()
  progress.close()
  logging.info("%s: exporting the final weights to %s.", name, os.path.join(workdir, "hf"))
  workdir_lib.save_final_hf(workdir, agents, tokenizer)
  if jax.process_index() == 0:
    print(summary(name, workdir, start, schedule.num_steps, time.perf_counter() - t_start,
                  {**shown, **{k: v for k, v in m.items() if k == "eval/accuracy"}}), flush=True)
  return last


def summary(name: str, workdir: str, start: int, num_steps: int, seconds: float,
            metrics: dict) -> str:
  """The line a program ends with: what ran, how long, the main metrics, where it went."""
  ran = f"steps {start}-{num_steps}" if start < num_steps else f"step {num_steps} (already done)"
  parts = [f"{name} done: {ran} in {seconds:.0f} s"]
  if metrics:
    parts.append(" ".join(f"{k}={metrics_lib.format_value(v)}"
                          for k, v in sorted(metrics.items())))
  parts.append(f"metrics in {os.path.join(workdir, metrics_lib.METRICS_FILE)}, final weights "
               f"in {os.path.join(workdir, 'hf')}")
  return "; ".join(parts) + "."
