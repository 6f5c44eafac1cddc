"""launch/main_agent.py and launch/sub_agent.py as real processes: equality, SIGKILL, buckets.

Each pair shares one run location (--exchange): the exchange under `<run>/exchange`,
each role's checkpoints under `<run>/<role>/checkpoints`; launch/evaluate.py --run
evaluates the latest pair from it.

Every program runs as a subprocess on one CPU device (the fake device count of
conftest.py is dropped), the colocated reference too, through launch/train.py, so
all of them build the same mesh. They share a persistent XLA compilation cache
(a temporary directory of this module) so that restarts do not pay for compiling
again; the cache stores the same executables, so it changes no number.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

from configs import mgrpo as mgrpo_config
from mgrpo_jax import checkpoint, keys, metrics
from mgrpo_jax.mgrpo import delegation, tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/mgrpo.py:smoke"  # num_steps=2: steps 0 and 1 train, 0..2 evaluate.
STEPS = [0, 1, 2]
TIMEOUT_S = 150  # Per program; --timeout_s (waiting for the peer) is below it.
# One pytest-xdist worker runs the whole module (.ci/run's --dist loadgroup), so the
# `colocated` reference (about a minute) runs once: spread over two workers, both ran it.
pytestmark = pytest.mark.xdist_group("decoupled_programs")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """The programs' environment: 1 CPU device and a shared compilation cache."""
  e = dict(os.environ)
  flags = [f for f in e.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  e["XLA_FLAGS"] = " ".join(flags)
  e.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
           JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  return e


@pytest.fixture(scope="module")
def colocated(env, tmp_path_factory):
  """The colocated run's metrics (launch/train.py, same config, same device count)."""
  workdir = tmp_path_factory.mktemp("colocated")
  log = workdir / "log.txt"
  # Its own cache through the launcher flag (not the environment): the flag is obeyed.
  cache = tmp_path_factory.mktemp("colocated_xla_cache")
  env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  with open(log, "w") as f:
    rc = subprocess.run([sys.executable, "launch/train.py", f"--config={CONFIG}",
                         f"--workdir={workdir}", f"--compilation_cache_dir={cache}"],
                        cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                        timeout=TIMEOUT_S).returncode
  assert rc == 0, log.read_text()[-3000:]
  assert len(list(cache.iterdir())) > 5
  rows = metrics.stable(metrics.read_metrics(str(workdir)))
  assert [r["step"] for r in rows] == STEPS
  return rows


class Pair:
  """A main-agent and a sub-agent process sharing one run location."""

  def __init__(self, root, run, env, extra=(), config=CONFIG):
    self.root, self.run, self.env, self.extra = root, run, env, list(extra)
    self.config = config
    self.procs, self.logs, self.starts = {}, {}, {"main": 0, "sub": 0}

  def workdir(self, role):
    return os.path.join(self.root, role)

  def start(self, role):
    self.starts[role] += 1
    log = os.path.join(self.root, f"{role}.{self.starts[role]}.log")
    self.logs[role] = log
    with open(log, "w") as f:  # A file, not a pipe: nothing blocks on a full buffer.
      self.procs[role] = subprocess.Popen(
          [sys.executable, f"launch/{role}_agent.py", f"--config={self.config}",
           f"--workdir={self.workdir(role)}", f"--exchange={self.run}",
           "--timeout_s=120", *self.extra],
          cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT)

  def kill(self, role):
    proc = self.procs[role]
    proc.send_signal(signal.SIGKILL)
    proc.wait()

  def wait(self):
    deadline = time.monotonic() + TIMEOUT_S
    try:
      for role, proc in self.procs.items():
        try:
          proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          pytest.fail(f"{role} did not finish in {TIMEOUT_S}s:\n{self.tail(role)}")
        assert proc.returncode == 0, f"{role} exited {proc.returncode}:\n{self.tail(role)}"
    finally:
      for proc in self.procs.values():
        if proc.poll() is None:
          proc.kill()
          proc.wait()

  def tail(self, role):
    with open(self.logs[role]) as f:
      return f.read()[-4000:]

  def merged(self):
    main = metrics.stable(metrics.read_metrics(self.workdir("main")))
    sub = metrics.stable(metrics.read_metrics(self.workdir("sub")))
    assert [r["step"] for r in main] == [r["step"] for r in sub]
    return [{**a, **b} for a, b in zip(main, sub)]


def _steps_in_file(workdir):
  with open(os.path.join(workdir, metrics.METRICS_FILE)) as f:
    return [json.loads(line)["step"] for line in f if line.strip()]


def _assert_exactly_once(pair):
  for role in ("main", "sub"):  # Each step's metrics line exactly once, in order.
    assert _steps_in_file(pair.workdir(role)) == STEPS, role
  ex = delegation.open_exchange(pair.run)
  requests, results = ex.list("request"), ex.list("result")
  assert len(set(requests)) == len(requests) and len(set(results)) == len(results)
  assert set(requests) == set(results)  # Every request answered, no stray result.
  for step in (0, 1):  # Training steps: markers counting the requests and batches sent.
    sent = ex.wait_mark("requests_done", step, timeout_s=0)
    assert sent["requests"] == len([k for k in requests if k[0] == step])
    assert ex.wait_mark("rollouts_done", step, timeout_s=0)["waves"] == sent["waves"]
  assert ex.array_steps("main_reward") == ex.array_steps("main_correct") == [0, 1]
  for record in results:
    assert ex.get("result", record)["policy_version"] is not None


def _evaluate_run(env, run, workdir, extra=()):
  """launch/evaluate.py --run: the latest pair of a decoupled run, colocated; eval.json."""
  proc = subprocess.run([sys.executable, "launch/evaluate.py", f"--config={CONFIG}",
                         f"--workdir={workdir}", f"--run={run}", *extra], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "eval.json")) as f:
    return json.load(f)


def _assert_eval_matches(saved, row):
  """eval.json holds the same evaluation as the metrics row of that step."""
  want = {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
  assert saved["step"] == row["step"] and "accuracy" in want
  assert {k: saved[k] for k in want} == want
  assert ("sub_format" in saved) == ("sub_format" in want)


def test_programs_match_the_colocated_run(env, colocated, tmp_path):
  run = f"file://{tmp_path}/run"
  pair = Pair(str(tmp_path), run, env)
  pair.start("sub")
  pair.start("main")
  pair.wait()
  assert pair.merged() == colocated
  _assert_exactly_once(pair)
  for role in ("main", "sub"):  # One URL holds the run; workdirs hold no checkpoints.
    with checkpoint.Checkpointer(f"{run}/{role}/checkpoints") as ckpt:
      assert ckpt.all_steps() == [1, 2]
    assert not os.path.exists(os.path.join(pair.workdir(role), "checkpoints"))
  # The final weights (step 2, both roles) evaluated in one process: the final
  # evaluation of the colocated run, number for number.
  saved = _evaluate_run(env, run, str(tmp_path / "eval"))
  _assert_eval_matches(saved, colocated[-1])


def _wait_for_lines(pair, role, n, timeout_s=TIMEOUT_S):
  """Waits until `role` has written `n` metrics lines (a step done, its checkpoint next)."""
  path = os.path.join(pair.workdir(role), metrics.METRICS_FILE)
  deadline = time.monotonic() + timeout_s
  while not (os.path.exists(path) and len(_steps_in_file(pair.workdir(role))) >= n):
    assert pair.procs[role].poll() is None, f"{role} exited early:\n{pair.tail(role)}"
    assert time.monotonic() < deadline, f"{role} wrote no step {n - 1}"
    time.sleep(0.02)


# The README's decoupled example: the scripted experts delegate from the first step (a
# random smoke model never does, and its pair would exchange no request at all).
README_CONFIG = "configs/mgrpo.py:smoke,policy=expert"


def test_readme_example_moves_records_across_the_exchange(env, tmp_path):
  run = f"file://{tmp_path}/run"
  pair = Pair(str(tmp_path), run, env, config=README_CONFIG)
  pair.start("sub")
  pair.start("main")
  pair.wait()
  ex = delegation.open_exchange(run)
  requests, results = ex.list("request"), ex.list("result")
  # Measured at this commit: 41 requests over the 2 training steps and 3 evaluations.
  assert len(requests) >= 10, len(requests)
  assert sorted(requests) == sorted(results)  # Each request answered exactly once.
  assert {0, 1} <= {key[0] for key in requests}  # Both training steps delegated.
  answers = [ex.get("result", key) for key in results]
  assert all(a["text"] for a in answers)  # The sub-agent answered every delegation...
  assert sum(a["format_ok"] for a in answers) > len(answers) // 2  # ...mostly well formed.
  for role in ("main", "sub"):
    assert _steps_in_file(pair.workdir(role)) == STEPS
    with open(pair.logs[role]) as f:
      assert f"mgrpo:{role} done: steps 0-2" in f.read()  # The summary line.


def test_rl_worlds_pair_reads_each_steps_world(env, tmp_path):
  """config.rl_worlds: the sub-agent program serves each training step with the tools of the
  world the main program asks about (the noise-free experts then answer every question;
  with the task's own tools they would find none of the other world's pages)."""
  pair = Pair(str(tmp_path), f"file://{tmp_path}/run", env, config=README_CONFIG,
              extra=["--config.rl_worlds=2", "--config.limits.max_turns=6",
                     "--config.limits.max_new_tokens=160"])  # Room for every expert episode.
  pair.start("sub")
  pair.start("main")
  pair.wait()
  main = metrics.stable(metrics.read_metrics(pair.workdir("main")))
  assert [r["main/accuracy"] for r in main if "main/accuracy" in r] == [1.0, 1.0]
  # The sub program judges its calls against the questions of the step's world.
  sub = metrics.stable(metrics.read_metrics(pair.workdir("sub")))
  assert [r["sub/call_accuracy"] for r in sub if "sub/reward" in r] == [1.0, 1.0]
  # Each training step's subtasks name the entities of that step's world's questions.
  c = mgrpo_config.get_config("smoke,policy=expert")
  c.rl_worlds = 2
  task = tasks.build_env(c)
  ex = delegation.open_exchange(pair.run)
  for step in (0, 1):  # Worlds 0 and 1, each asked for the first time.
    world = tasks.rl_world_env(c, step, task)
    asked = keys.examples_for_step(world.train, 0, c.num_queries, c.seed)
    names = {h.entity for q in asked for h in q.hops}
    subtasks = [ex.get("request", k)["subtask"] for k in ex.list("request") if k[0] == step]
    assert subtasks and all(any(n in s for n in names) for s in subtasks), (step, subtasks)


# (victim, metrics lines written before the random delay starts). 0 lands in start-up,
# step 0's evaluation or rollouts (nothing checkpointed yet: restarts from scratch); 1 in
# step 0's checkpoint save, step 1 or the final evaluation; 2 in step 1's checkpoint
# save or the final evaluation (always resumes from a checkpoint).
@pytest.mark.parametrize("victim,after_lines", [("main", 0), ("sub", 1), ("main", 1),
                                                ("sub", 2)])
def test_sigkill_and_restart_one_program(env, colocated, tmp_path, victim, after_lines):
  rng = random.Random(f"{victim}{after_lines}")
  pair = Pair(str(tmp_path), f"file://{tmp_path}/run", env)
  pair.start("sub")
  pair.start("main")
  if after_lines:
    _wait_for_lines(pair, victim, after_lines)
    delay = rng.uniform(0.0, 0.3)  # A warm step takes ~0.3 s.
  else:
    delay = rng.uniform(2.0, 6.0)  # Start-up takes ~4 s with a warm compilation cache.
  time.sleep(delay)
  alive = pair.procs[victim].poll() is None
  pair.kill(victim)
  pair.start(victim)  # Same flags: resumes from its own checkpoint.
  pair.wait()
  assert alive, f"{victim} had finished before the kill ({delay:.2f}s); kill earlier"
  assert pair.merged() == colocated
  _assert_exactly_once(pair)
  if after_lines == 2:  # Step 0's checkpoint was committed: the restart resumed from one.
    with open(pair.logs[victim]) as f:
      assert "Restored" in f.read(), pair.tail(victim)


# ------------------------------------------------- object stores: S3 (moto), GCS (fake)


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_pair_over_an_object_store(store, env, request, tmp_path, monkeypatch):
  """One training step (steps 0 and 1 evaluated) of the pair on a bucket: short, but every
  kind of record and both roles' checkpoints cross it."""
  if store == "gcs":  # Orbax writes there itself (tensorstore's gcs driver, gcsfs).
    run = f"gs://exchange/runs/{uuid.uuid4().hex}"
    store_env = {**env, **request.getfixturevalue("gcs_endpoint")}
  else:  # Orbax cannot write to s3: checkpoints are copied there from each program's cache.
    run = json.dumps({"driver": "s3", "bucket": "exchange", "path": f"runs/{uuid.uuid4().hex}",
                      "endpoint": request.getfixturevalue("s3_endpoint"),
                      "aws_region": "us-east-1"})  # fmt: skip
    store_env = {**env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_REGION": "us-east-1"}  # fmt: skip
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
  pair = Pair(str(tmp_path), run, store_env, extra=["--config.num_steps=1"])
  pair.start("sub")
  pair.start("main")
  pair.wait()
  for role in ("main", "sub"):
    assert _steps_in_file(pair.workdir(role)) == [0, 1]
  ex = delegation.open_exchange(run)
  assert ex.marks("rollouts_done")[:1] == [0]
  assert ex.array_steps("main_reward") == [0]
  assert set(ex.list("request")) == set(ex.list("result"))
  for role in ("main", "sub"):  # Read back from the bucket (an empty cache for s3).
    ckpt = checkpoint.Checkpointer(delegation.checkpoint_location(run, role),
                                   cache_dir=str(tmp_path / "probe"))
    assert ckpt.all_steps() == [1]
    ckpt.close()
  # Evaluated from the bucket alone: step 1's evaluation of the pair.
  saved = _evaluate_run(store_env, run, str(tmp_path / "eval"), extra=["--config.num_steps=1"])
  _assert_eval_matches(saved, pair.merged()[-1])


def _pipelined_pair_restarted(env, tmp_path, role: str, *, seed: str) -> "Pair":
  """The pair with config.max_staleness=1, `role`'s program SIGKILLed after its first
  metrics line (plus a seeded jitter) and restarted; returns it once both have ended."""
  pair = Pair(str(tmp_path), f"file://{tmp_path}/run", env, config=README_CONFIG,
              extra=["--config.max_staleness=1"])
  pair.start("sub")
  pair.start("main")
  _wait_for_lines(pair, role, 1)
  time.sleep(random.Random(seed).uniform(0.0, 0.3))
  alive = pair.procs[role].poll() is None
  pair.kill(role)
  pair.start(role)
  pair.wait()
  assert alive, f"the {role} program had finished before the kill; kill earlier"
  return pair


def _trained_within_one_version(pair) -> dict:
  """Asserts that each program's metrics hold every step once and no trained row lags
  more than one version; returns each role's trained rows."""
  out = {}
  for role in ("main", "sub"):
    assert _steps_in_file(pair.workdir(role)) == STEPS, role  # No step lost or repeated.
    trained = [r for r in metrics.read_metrics(pair.workdir(role)) if r["step"] < STEPS[-1]]
    for r in trained:  # Every row of the step, delegations' serving versions included.
      assert r["pipeline/version_lag"] <= r["pipeline/max_lag"] <= 1, (role, r["step"])
      assert r[f"{role}/staleness/max"] <= 1, (role, r["step"])
    out[role] = trained
  return out


def test_pipelined_pair_survives_a_sub_agent_restart(env, tmp_path):
  """config.max_staleness=1: each program plays step t + 1 while step t updates; the
  sub-agent program, killed mid-run and restarted from its checkpoint (another policy
  version than the one that served), loses no step, and no row of either agent is trained
  more than one version behind (what it had answered is answered by the stored episodes
  that answered it, not played again)."""
  pair = _pipelined_pair_restarted(env, tmp_path, "sub", seed="pipelined")
  for role, trained in _trained_within_one_version(pair).items():
    assert max(r["pipeline/max_lag"] for r in trained) == 1, role  # Step 1 by version 0.
  ex = delegation.open_exchange(pair.run)
  requests, results = ex.list("request"), ex.list("result")
  assert sorted(requests) == sorted(results) and {0, 1} <= {k[0] for k in requests}
  for key in results:
    if key[0] < delegation.EVAL_STEP_BASE:  # Training: served at most one version behind.
      assert ex.get("result", key)["policy_version"] >= key[0] - 1, key
  # Each training answer's episode is stored before the answer is written.
  assert {k for k in results if k[0] < delegation.EVAL_STEP_BASE} == set(ex.list("sub_episode"))
  # The main program's step 1 rollouts began before its step 0 update ended.
  with open(os.path.join(pair.workdir("main"), "timeline.jsonl")) as f:
    spans = {(e["kind"], e["step"]): e for e in map(json.loads, f)}
  assert spans["rollout", 1]["start_s"] < spans["update", 0]["end_s"]


def test_pipelined_pair_survives_a_main_program_restart(env, tmp_path):
  """config.max_staleness=1, the main program killed after its first step and restarted
  from its checkpoint (another policy version than the one that played): it reads back
  the steps whose outcome it had published and plays the others again as a new attempt,
  in a namespace of its own that the sub-agent program follows. No step is lost or
  repeated in either metrics file, and no row of either agent lags more than one version."""
  pair = _pipelined_pair_restarted(env, tmp_path, "main", seed="pipelined main")
  _trained_within_one_version(pair)
  attempts = delegation.Attempts(pair.run)
  firsts = attempts.firsts()
  assert sorted(firsts) == [0, 1] and firsts[0] == 0, firsts
  for step in (0, 1):  # The attempt that owns a training step: all of it there, answered.
    ex = attempts.exchange(attempts.owner(step))
    requests = [k for k in ex.list("request") if k[0] == step]
    assert requests and requests == [k for k in ex.list("result") if k[0] == step], step
    assert ex.wait_mark("rollouts_done", step, timeout_s=0)
    assert len(ex.list("main_episode", (step,))) == 8  # Q * K, stored before the outcome.
  for a in firsts:  # Every answer of every attempt: at most one version behind.
    ex = attempts.exchange(a)
    for key in ex.list("result"):
      if key[0] < delegation.EVAL_STEP_BASE:
        assert ex.get("result", key)["policy_version"] >= key[0] - 1, (a, key)
  with open(pair.logs["main"]) as f:  # The restart's own account of what it read back.
    assert "main: attempt 1 plays from step" in f.read(), pair.tail("main")
