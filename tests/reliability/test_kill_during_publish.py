"""SIGKILL during a publish, again and again: no reader ever sees a partial record or array.

A child process publishes what a step of a role program does (per-request records, an
array and the step's marker, in that order) for several steps. It is killed at a random
moment, its exchange is checked as a reader would see it, and it is restarted; after the
loop it runs to the end. Every record a reader can list decodes and equals what was
meant; every committed array passes its checksum; a marker is never visible before its
step's data; and the restarted writers finish with exactly the full set, each key once.
"""

import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from mgrpo_jax.exchange import Exchange

STEPS, REQUESTS = 6, 24
# The child: publishes every step in order; a restart re-puts what is there (no-ops).
_CHILD = """
import json, sys
import numpy as np
from mgrpo_jax.exchange import Exchange
ex = Exchange(json.loads(sys.argv[1]))
print("ready", flush=True)
for step in range({steps}):
  for i in range({requests}):
    ex.put("result", (step, i // 4, i % 4, 0), {{"text": "r" * (100 * i), "step": step}})
  ex.put_array("main_reward", step, np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + step)
  ex.mark("rollouts_done", step, {{"waves": step}})
""".format(steps=STEPS, requests=REQUESTS)


def _expected_array(step):
  return np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + step


def _check_as_reader(ex: Exchange) -> int:
  """Everything visible is whole and right; returns the number of marked steps."""
  results = ex.list("result")
  for key in results:
    record = ex.get("result", key, timeout_s=0)
    assert record == {"text": "r" * (100 * (key[1] * 4 + key[2])), "step": key[0]}
  assert len(results) == len(set(results))
  for step in ex.array_steps("main_reward"):
    np.testing.assert_array_equal(ex.get_array("main_reward", step, timeout_s=0),
                                  _expected_array(step))
  marks = ex.marks("rollouts_done")
  for step in marks:  # The marker comes last: its step's data is all there.
    assert ex.wait_mark("rollouts_done", step, timeout_s=0) == {"waves": step}
    assert len(ex.list("result", (step,))) == REQUESTS
    assert step in ex.array_steps("main_reward")
  return len(marks)


def _start(cmd, env) -> tuple[subprocess.Popen, float]:
  """The child, once it has opened its exchange and is about to publish (and that time)."""
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  line = proc.stdout.readline()
  assert line.strip() == "ready", (line, proc.stderr.read()[-3000:])
  return proc, time.perf_counter()


def _kill_loop(spec: dict, env: dict | None, trials: int, seed: int) -> int:
  """`trials` fresh runs, each killed twice mid-publish, checked, then finished.

  Kill times are drawn within the publishing time of a whole fresh run measured here first
  (start-up excluded), so that kills land mid-publish on a fast machine as on a loaded one.
  """
  rng = random.Random(seed)
  calibrate = [sys.executable, "-c", _CHILD, json.dumps({**spec, "path": f"{spec['path']}c/"})]
  proc, t0 = _start(calibrate, env)
  assert proc.wait(120) == 0, proc.stderr.read()[-3000:]
  publish_s = time.perf_counter() - t0
  kills = 0
  for trial in range(trials):
    run = {**spec, "path": f"{spec['path']}{trial}/"}
    cmd = [sys.executable, "-c", _CHILD, json.dumps(run)]
    ex = Exchange(run)
    for _ in range(2):
      proc, t0 = _start(cmd, env)
      time.sleep(max(0.0, rng.uniform(0.05, 0.7) * publish_s - (time.perf_counter() - t0)))
      if proc.poll() is None:
        proc.kill()
        kills += 1
      proc.wait()
      _check_as_reader(ex)
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr[-3000:]
    assert _check_as_reader(ex) == STEPS
    assert len(ex.list("result")) == STEPS * REQUESTS
    assert ex.array_steps("main_reward") == list(range(STEPS))
  return kills


def test_kill_during_publish_file(tmp_path):
  spec = {"driver": "file", "path": f"{tmp_path}/run/"}
  kills = _kill_loop(spec, None, trials=5, seed=0)
  assert kills >= 5  # The loop did kill writers mid-run (not only finished ones).


def test_kill_during_publish_s3(s3_endpoint, tmp_path, monkeypatch):
  spec = {"driver": "s3", "bucket": "exchange", "path": f"kill/{tmp_path.name}/",
          "endpoint": s3_endpoint, "aws_region": "us-east-1"}
  for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                      ("AWS_REGION", "us-east-1")):
    monkeypatch.setenv(name, value)  # For this process's reader and the child writers.
  env = dict(os.environ)
  kills = _kill_loop(spec, env, trials=3, seed=1)
  assert kills >= 3
