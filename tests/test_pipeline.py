"""The bounded-staleness pipeline: its schedule and bound (no JAX), the colocated program
pipelined end to end, k = 0 against the sequential loop, and the handoff to rollout devices."""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import mgrpo
from mgrpo_jax import config_checks, handoff, keys, metrics, models, pipeline, sharding
from mgrpo_jax.agents import rollout
from mgrpo_jax.models import decode
from mgrpo_jax.rl import alignment
from mgrpo_jax.mgrpo import colocated, play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step


class _Fake:
  """Phases that record what ran when: play(step, weights) -> (step, version)."""

  def __init__(self, *, play_s=0.0, train_s=0.0, fail_at=None):
    self.version, self.log, self.lock = 0, [], threading.Lock()
    self.play_s, self.train_s, self.fail_at = play_s, train_s, fail_at
    self.played, self.trained, self.ahead = [], [], []

  def publish(self, version):
    return {"v": version}

  def play(self, step, weights):
    if step == self.fail_at:
      raise ValueError(f"outage at {step}")
    time.sleep(self.play_s)
    with self.lock:
      self.played.append((step, weights["v"]))
    return step, weights["v"]

  def learn(self, step, rollouts):
    return {"rows": rollouts}, {"lag": step - rollouts[1]}

  def train(self, batches, step):
    time.sleep(self.train_s)
    with self.lock:  # How far the rollout thread got while this step updated.
      self.ahead.append(max(s for s, _ in self.played) - step)
    self.trained.append(step)
    return {}


def _pipe(f: _Fake, k: int, start: int = 0, num_steps: int = 8, versions=None):
  return pipeline.Pipeline(play=f.play, learn=f.learn, train=f.train, publish=f.publish, k=k,
                           start=start, num_steps=num_steps, versions=versions)


@pytest.mark.parametrize("k,start", [(1, 0), (2, 0), (3, 2)])
def test_step_s_plays_version_s_minus_k_and_no_row_lags_more(k, start):
  f = _Fake(play_s=0.002, train_s=0.02)
  p = _pipe(f, k, start)
  lags = [p(s)["lag"] for s in range(start, 8)]
  p.close()
  assert f.played == [(s, max(s - k, start)) for s in range(start, 8)]
  assert lags == [min(s - start, k) for s in range(start, 8)]
  # Updates are slow here: the rollouts of the next k steps are done while one updates, and
  # never more (the version gate).
  assert f.ahead[:8 - start - k] == [k] * (8 - start - k)
  assert max(f.ahead) == k
  assert f.trained == list(range(start, 8))


def test_the_next_rollout_runs_while_a_step_updates():
  f = _Fake()
  started = threading.Event()
  play = f.play
  f.play = lambda s, w: (started.set() if s == 2 else None, play(s, w))[1]
  f.train = lambda b, s: {"saw_next": float(started.wait(5.0) if s == 1 else 1.0)}
  p = _pipe(f, 1, num_steps=4)
  p(0)
  # Rollout 2 plays version 1, published when update 0 ended: it starts during update 1.
  assert p(1)["saw_next"] == 1.0
  p(2), p(3)
  p.close()


def test_a_rollout_error_raises_in_its_own_step_after_the_earlier_ones_train():
  f = _Fake(fail_at=3)
  p = _pipe(f, 2)
  for s in range(3):
    p(s)
  with pytest.raises(ValueError, match="outage at 3"):
    p(3)
  p.close()
  assert f.trained == [0, 1, 2]


def test_rows_recorded_beyond_the_bound_are_refused():
  f = _Fake()
  # A sub-agent version older than the bound allows served a delegation of step 3's rows.
  p = _pipe(f, 1, versions=lambda r: [r[1], r[0] - 2 if r[0] == 3 else r[1]])
  p(0), p(1), p(2)
  with pytest.raises(pipeline.StalenessError, match="step 3: recorded rows of policy version "
                     "1 are 2 versions behind; config.max_staleness=1"):
    p(3)
  p.close()
  assert f.trained == [0, 1, 2]
  pipeline.check(5, 2, [3, 4, 5])
  with pytest.raises(pipeline.StalenessError):
    pipeline.check(5, 2, [2, 5])


def test_every_version_a_step_recorded_is_checked_delegations_included():
  ep = lambda role, v, served=(): rollout.Episode(
      role=role, q=0, k=0, call=-1, task=None, tokens=[1], loss_mask=[1], logprobs=[0.0],
      validator=None, policy_version=v, delegation_versions=list(served))
  # A main episode of version 6 whose two delegations two sub-agent versions served.
  r = play.Rollouts(None, [], [ep("main", 6, served=(6, 4)), ep("main", 6)], [ep("sub", 5)])
  assert sorted(play.behaviour_versions(r)) == [4, 5, 6, 6, 6]
  pipeline.check(6, 2, play.behaviour_versions(r))
  with pytest.raises(pipeline.StalenessError, match="version 4 are 3 versions behind"):
    pipeline.check(7, 2, play.behaviour_versions(r))


def test_warm_runs_once_on_the_learner_while_the_first_step_plays():
  f, seen = _Fake(play_s=0.05), []
  warm = lambda: seen.append((threading.current_thread(), list(f.played), list(f.trained)))
  p = pipeline.Pipeline(play=f.play, learn=f.learn, train=f.train, publish=f.publish, k=1,
                        start=0, num_steps=3, warm=warm)
  p(0), p(1), p(2)
  p.close()
  # Once, before the first update, on the loop's thread, while step 0 was still playing.
  assert seen == [(threading.current_thread(), [], [])]
  assert [e["kind"] for e in p.timeline].count("warm") == 1


def test_close_stops_a_rollout_thread_waiting_for_a_version():
  f = _Fake()
  p = _pipe(f, 1, num_steps=50)
  p(0)  # The rollout thread then waits for a queue slot or for version 2.
  p.close()
  assert not p._thread.is_alive()


def _config(**overrides):
  c = mgrpo.get_config("smoke")
  c.update(dict(num_steps=3, eval_every=10) | overrides)
  return c


def _hf(workdir, name):
  return jax.tree.leaves(models.load_hf(os.path.join(workdir, "hf", name))[1])


def test_max_staleness_0_is_the_sequential_loop_bit_for_bit(tmp_path):
  # The program with k = 0 against the sequential step written out here: rollouts with the
  # current weights, both sides of the step, the updates; metrics and final weights.
  c = _config()
  colocated.train_and_evaluate(c, str(tmp_path / "run"))
  p = setup.start(c, str(tmp_path / "ref"))
  questions_of = tasks.TrainingQuestions(c, p.env)
  ref = []
  for step in range(c.num_steps):
    env, questions = questions_of(step)
    policies = play.make_policies(c, p.wiring, env, p.agents, c.sampling, version=step)
    eps, sub_eps = play.run_rollouts(c, p.wiring, env, policies, questions,
                                     num_rollouts=c.num_rollouts, key=keys.step_key(c, step),
                                     step=step)
    batches, m = mgrpo_step.batches(c, p.wiring, play.Rollouts(env, questions, eps, sub_eps),
                                    jax.random.fold_in(keys.step_key(c, step), 2))
    m.update(mgrpo_step.update(p.wiring, p.agents, batches, step))
    ref.append(m)
  lines = metrics.stable(metrics.read_metrics(str(tmp_path / "run")))
  assert "pipeline/version_lag" not in lines[0]
  assert len(lines) == len(ref) + 1
  for m, line in zip(ref, lines):
    m = metrics.stable([m])[0]
    assert {k: line[k] for k in m} == {k: float(v) for k, v in m.items()}
  # The checkpoint (weights, optimizer moments, step, key) restored, and the final export.
  restored = setup.start(c, str(tmp_path / "run"))
  assert restored.start == c.num_steps
  for name in ("main", "sub"):
    got, want = (jax.tree.leaves(a.state) for a in (restored.agents[name], p.agents[name]))
    assert len(got) == len(want)
    for x, y in zip(got, want):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x, y = jax.random.key_data(x), jax.random.key_data(y)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(_hf(str(tmp_path / "run"), name), jax.tree.leaves(p.agents[name].params)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_host_programs_compiled_ahead_are_the_ones_the_first_batches_run(tmp_path):
  # `compile_host` on dummy inputs, then a real step's `batches`: no new program to compile.
  c = _config()
  p = setup.start(c, str(tmp_path))
  env, questions = tasks.TrainingQuestions(c, p.env)(0)
  policies = play.make_policies(c, p.wiring, env, p.agents, c.sampling, version=0)
  eps, sub_eps = play.run_rollouts(c, p.wiring, env, policies, questions,
                                   num_rollouts=c.num_rollouts, key=keys.step_key(c, 0), step=0)
  programs = (mgrpo_step._group_advantages, alignment.align)
  for f in programs:
    f.clear_cache()
  key = jax.random.fold_in(keys.step_key(c, 0), 2)
  mgrpo_step.compile_host(c, p.wiring, key)
  compiled = [f._cache_size() for f in programs]
  assert compiled == [2, 1]  # [Q, K] and [Q, K, D] advantages, the alignment.
  mgrpo_step.batches(c, p.wiring, play.Rollouts(env, questions, eps, sub_eps), key)
  assert [f._cache_size() for f in programs] == compiled


@pytest.mark.devices(8)
def test_pipelined_run_is_deterministic_and_bounded_on_split_devices(tmp_path):
  # k = 1 with the sampler on devices 0-3 and training on 4-7: twice the same numbers.
  runs = [str(tmp_path / name) for name in ("a", "b")]
  for workdir in runs:
    colocated.train_and_evaluate(_config(max_staleness=1, rollout_devices=4), workdir)
  a, b = (metrics.stable(metrics.read_metrics(w)) for w in runs)
  assert a == b
  for name in ("main", "sub"):
    for x, y in zip(_hf(runs[0], name), _hf(runs[1], name)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Step s was played by version max(s - 1, 0); every row lags at most 1.
  assert [m["pipeline/version_lag"] for m in a[:3]] == [0.0, 1.0, 1.0]
  assert [m["main/staleness/max"] for m in a[:3]] == [0.0, 1.0, 1.0]
  assert all(m["main/staleness/count_1"] == (0 if m["step"] == 0 else 8) for m in a[:3])
  kinds = {line.split('"kind": "')[1].split('"')[0]
           for line in open(os.path.join(runs[0], pipeline.TIMELINE_FILE))}
  assert kinds == {"start", "warm", "rollout", "host", "update", "handoff"}


def test_two_steps_of_lag_on_shared_devices(tmp_path):
  colocated.train_and_evaluate(_config(max_staleness=2, num_steps=4), str(tmp_path))
  lines = metrics.read_metrics(str(tmp_path))[:4]
  assert [m["pipeline/version_lag"] for m in lines] == [0.0, 1.0, 2.0, 2.0]
  assert [m["main/staleness/max"] for m in lines] == [0.0, 1.0, 2.0, 2.0]
  assert all(m["main/staleness/count_2"] == (8 if m["step"] >= 2 else 0) for m in lines)


def test_a_resumed_pipeline_plays_from_the_restored_version(tmp_path):
  # Versions before the checkpoint are not kept: steps 2 and 3 play the restored version 2.
  colocated.train_and_evaluate(_config(max_staleness=1, num_steps=2), str(tmp_path))
  colocated.train_and_evaluate(_config(max_staleness=1, num_steps=4), str(tmp_path))
  lines = metrics.read_metrics(str(tmp_path))
  assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
  assert [m["pipeline/version_lag"] for m in lines[:4]] == [0.0, 1.0, 0.0, 1.0]
  assert [m["main/staleness/max"] for m in lines[:4]] == [0.0, 1.0, 0.0, 1.0]


def test_a_split_needs_the_pipeline_and_devices_left_to_train(tmp_path):
  with pytest.raises(config_checks.ConfigValueError, match="rollout_devices=4 .*max_staleness"):
    setup.meshes(_config(rollout_devices=4))
  with pytest.raises(config_checks.ConfigValueError, match="rollout_devices=8 with"):
    setup.meshes(_config(rollout_devices=8, max_staleness=1))
  with pytest.raises(config_checks.ConfigValueError, match="only the colocated program"):
    setup.meshes(_config(rollout_devices=4, max_staleness=1), pipelined=False)  # decoupled
  train, rollout = setup.meshes(_config(rollout_devices=2, max_staleness=1))
  assert list(rollout.devices.flat) == jax.devices()[:2]
  assert list(train.devices.flat) == jax.devices()[2:]
  with pytest.raises(config_checks.ConfigValueError, match="config.rollout_devices=-1"):
    setup.start(_config(rollout_devices=-1), str(tmp_path))


def _agent(mesh, compute="bfloat16"):
  cfg = models.Qwen3Config(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=3,
                           num_heads=4, num_kv_heads=2, head_dim=12, param_dtype="float32",
                           compute_dtype=compute)
  params = models.init_params(cfg, jax.random.key(0), mesh=mesh)

  class Agent:  # What `Handoff` reads of a `trainable.Agent`.
    model_config, mesh = cfg, None
  a = Agent()
  a.params, a.mesh = params, mesh
  return a


@pytest.mark.devices(8)
def test_handoff_moves_the_bf16_layers_shard_to_shard_and_keeps_the_old_version():
  rollout, train = handoff.split_devices(4)
  mesh_t, mesh_r = (sharding.make_mesh({"fsdp": 2, "tensor": 2}, d) for d in (train, rollout))
  agent = _agent(mesh_t)
  h = handoff.Handoff({"main": agent}, mesh_r)
  # Nothing goes through the host: a gather onto it would raise here.
  with jax.transfer_guard_device_to_host("disallow_explicit"):
    v1 = h.publish(1)["main"]
  want = decode.decode_params(agent.model_config, agent.params)
  assert v1.version == 1 and v1.mesh is mesh_r
  dst = handoff.sampler_shardings(agent.model_config, agent.params, mesh_r)
  for x, w, s in zip(jax.tree.leaves(v1.params), jax.tree.leaves(want), jax.tree.leaves(dst)):
    assert x.dtype == jnp.bfloat16 and x.sharding == s
    assert x.sharding.device_set == set(rollout)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(w))
  # Half the float32 masters' bytes, each device holding its own shard of the split ones.
  masters = sum(x.nbytes for x in jax.tree.leaves(agent.params))
  assert v1.nbytes == h.bytes_per_version()["main"] == masters // 2
  per_device = handoff.shard_bytes(v1.params, dst)
  assert per_device.sum() < 2 * v1.nbytes and per_device.max() < v1.nbytes
  # Version 2 is published while version 1 is still in the sampler's hands.
  agent.params = jax.tree.map(lambda p: p + 1.0, agent.params)
  v2 = h.publish(2)["main"]
  for x, w in zip(jax.tree.leaves(v1.params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(w))
  assert not np.array_equal(np.asarray(v2.params.embed_VxD), np.asarray(v1.params.embed_VxD))


def test_shared_devices_publish_a_copy_that_outlives_a_donated_state():
  mesh = sharding.make_mesh({"data": -1})
  agent = _agent(mesh, compute="float32")  # The cast changes no dtype: still a copy.
  h = handoff.Handoff({"main": agent}, fixed=())
  v0 = h.publish(0)["main"]
  # The published weights are a pytree of their arrays: waiting for them waits for the copy.
  assert [id(x) for x in jax.tree.leaves({"main": v0})] == [
      id(x) for x in jax.tree.leaves(v0.params)]
  want = [np.asarray(x) for x in jax.tree.leaves(v0.params)]
  jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)(agent.params)
  for x, w in zip(jax.tree.leaves(v0.params), want):
    np.testing.assert_array_equal(np.asarray(x), w)
  assert v0.mesh is mesh


def test_a_fixed_agent_is_published_once():
  mesh = sharding.make_mesh({"data": -1})
  h = handoff.Handoff({"main": _agent(mesh), "sub": _agent(mesh)}, fixed=("sub",))
  a, b = h.publish(0), h.publish(1)
  assert b["sub"] is a["sub"] and b["main"] is not a["main"] and b["main"].version == 1


def test_the_demo_passes_max_staleness_to_its_m_grpo_stage(tmp_path):
  # The demo's two stages replaced by recorders: what config and workdir the RL stage gets.
  out = tmp_path / "seen.json"
  code = "\n".join([
      "import json, runpy, sys",
      "from mgrpo_jax.mgrpo import colocated, sft",
      "sft.train_sft = lambda c, w: None",
      "def rl(c, w):",
      f"  json.dump(dict(k=c.max_staleness, workdir=w), open({str(out)!r}, 'w'))",
      "  raise SystemExit(0)",
      "colocated.train_and_evaluate = rl",
      f"sys.argv = ['demo.py', '--workdir={tmp_path}', '--max_staleness=1']",
      "runpy.run_path('launch/demo.py', run_name='__main__')"])
  subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert json.loads(out.read_text()) == dict(k=1, workdir=str(tmp_path / "mgrpo-k1"))
