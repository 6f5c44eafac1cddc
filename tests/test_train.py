"""Training programs end to end on the smoke config: variants, wiring, resume, bad configs."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import loopback
from configs import mgrpo, sft as sft_config
from experiments.hierarchy_ablation import rl_run_record
from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import models
from mgrpo_jax.models import lora
from mgrpo_jax import config_checks as checks
from mgrpo_jax import evaluate, metrics, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import colocated, hierarchy, play, setup, sft, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step
from mgrpo_jax.envs import search
from mgrpo_jax.envs import world as world_lib
from mgrpo_jax.rl import batch as batch_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(arg="smoke", **overrides):
  c = mgrpo.get_config(arg)
  c.update(overrides)
  return c


def _lines(workdir):
  return metrics.stable(metrics.read_metrics(workdir))


@pytest.mark.parametrize("variant", mgrpo.VARIANTS)
def test_two_steps_of_each_variant(variant, tmp_path):
  c = _config(f"smoke,variant={variant}")
  colocated.train_and_evaluate(c, str(tmp_path))
  lines = metrics.read_metrics(str(tmp_path))
  assert [m["step"] for m in lines] == [0, 1, 2]
  assert all("eval/accuracy" in m for m in lines)  # eval_every=1, step 0 included.
  role = "single" if variant == "single" else "main"
  assert f"{role}/reward" in lines[0] and f"{role}/loss" in lines[0]
  trained_sub = "sub/loss" in lines[0]
  # frozen_sub never runs the sub's step; unaligned runs it on unaligned rows.
  assert trained_sub == (variant in ("mgrpo", "unaligned"))
  hf = sorted(os.listdir(tmp_path / "hf"))
  assert hf == {"single": ["single"], "shared": ["main"]}.get(variant, ["main", "sub"])
  assert os.listdir(tmp_path / "tb")


def test_rl_worlds_train_on_other_worlds_with_their_tools(tmp_path, monkeypatch):
  """config.rl_worlds: the colocated program's rollouts ask each step's world with that
  world's tools (the noise-free experts answer them), and evaluate the task's questions."""
  c = _config("smoke,policy=expert", rl_worlds=2)
  c.limits.update(max_turns=6, max_new_tokens=160)
  calls, rollouts = [], play.run_rollouts

  def spy(c_, w, env, policies, questions, **kw):
    calls.append((env, questions, kw["step"], kw["num_rollouts"]))
    return rollouts(c_, w, env, policies, questions, **kw)

  monkeypatch.setattr(play, "run_rollouts", spy)
  colocated.train_and_evaluate(c, str(tmp_path))
  task = tasks.build_env(c)
  train = [(e, q, s) for e, q, s, k in calls if k == c.num_rollouts]
  assert [s for _, _, s in train] == [0, 1]
  assert train[0][0].documents != train[1][0].documents  # Two worlds.
  for env, questions, step in train:
    assert env.documents != task.documents and all(q in env.train for q in questions)
  assert all(e.documents == task.documents for e, _, _, k in calls if k == 1)  # Evaluations.
  lines = metrics.read_metrics(str(tmp_path))
  assert [m["main/accuracy"] for m in lines if "main/accuracy" in m] == [1.0, 1.0]
  # Every sub-agent call answered a hop of its own question, in its own step's world.
  assert [m["sub/call_accuracy"] for m in lines if "main/accuracy" in m] == [1.0, 1.0]
  # The hierarchy ablation's rl_run_record reads the run from its workdir alone.
  rec = rl_run_record.record(str(tmp_path), block=1)
  evals = [m for m in lines if "eval/accuracy" in m]
  assert [e["step"] for e in rec["evaluations"]] == [m["step"] for m in evals]
  for e, m in zip(rec["evaluations"], evals):
    with open(play.questions_path(str(tmp_path), m["step"])) as f:
      assert e["sub_call_accuracy"] == json.load(f)["sub_call_accuracy"] is not None
    assert e["accuracy"] == round(m["eval/accuracy"], 4)
  assert [(b["steps"], b["main_batch_accuracy"], b["sub_call_accuracy"])
          for b in rec["training_blocks"]] == [("0-0", 1.0, 1.0), ("1-1", 1.0, 1.0)]
  assert rec["settings"]["rl_worlds"] == 2


def test_rl_worlds_single_agent_reads_each_worlds_pages():
  """The single agent (full-context control) on an RL world's one- and two-page questions:
  the noise-free single expert answers each with that world's tools, the task's own would
  not serve its pages."""
  c = _config("task=multihop,smoke,variant=single,full_context", rl_worlds=2,
              rl_hop_weights=(1.0, 1.0, 0.0, 0.0))
  task = tasks.build_env(c)
  world = tasks.rl_world_env(c, 1, task)
  w = setup.WIRINGS[c.variant]
  questions = world.train[:4]
  for env, right in ((world, 1.0), (task, 0.0)):
    env_tools = dataclasses.replace(world, tools=env.tools)
    eps, _ = play.run_rollouts(c, w, env_tools, play.expert_policies(c, w, env_tools),
                               questions, num_rollouts=1, key=jax.random.key(0), step=0)
    outcome = hierarchy.main_outcomes(eps, [q.answers for q in questions], len(questions), 1)
    assert outcome.correct.mean() == right, env


def _expert_rollouts(c, w, env):
  """Valid main and sub episodes from the experts, so every update has real signal."""
  policies = play.expert_policies(c, w, env, noise=0.5, seed=3)
  questions = env.train[:c.num_queries]
  return play.run_rollouts(c, w, env, policies, questions, num_rollouts=c.num_rollouts,
                           key=jax.random.key(0), step=0)


def _flat(state):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(state.params))])


@pytest.mark.parametrize("variant", ["mgrpo", "frozen_sub", "shared"])
def test_wiring_decides_who_learns(variant):
  c = _config(f"smoke,variant={variant}")
  c.limits.max_new_tokens = 160
  c.limits.max_turns = 6
  w = setup.resolve_wiring(c)
  env = tasks.build_env(c)
  mesh = sharding.make_mesh(dict(c.mesh))
  agents = setup.build_agents(c, w, env, mesh, jax.random.key(0))
  before = {n: _flat(a.state) for n, a in agents.items()}
  eps, sub_eps = _expert_rollouts(c, w, env)
  assert sub_eps, "the experts delegate, so the sub-agent path is exercised"
  rollouts = play.Rollouts(env, env.train[:c.num_queries], eps, sub_eps)
  batches, m = mgrpo_step.batches(c, w, rollouts, jax.random.key(1))
  assert batches["sub"].tokens.shape[0] == c.num_queries * c.num_rollouts * c.align_d
  assert 0 <= m["align/duplicate_rate"] <= 1
  out = mgrpo_step.update(w, agents, batches, step=0)
  changed = {n: bool(np.any(_flat(a.state) != before[n])) for n, a in agents.items()}
  if variant == "mgrpo":
    assert changed == {"main": True, "sub": True} and "sub/loss" in out
  elif variant == "frozen_sub":
    assert changed == {"main": True, "sub": False} and "sub/loss" not in out
  else:  # One set of weights trained on both roles' rows.
    assert changed == {"main": True} and out["main/tokens"] > batches["main"].loss_mask.sum()


def test_colocated_step_equals_the_decoupled_protocol_over_an_in_memory_exchange():
  """The colocated program calls its sub-agent in process; behind the decoupled programs'
  exchange code (a `memory://` loopback), delegations, R_M and every batch are the same."""
  c = _config("smoke,policy=expert")
  c.limits.update(max_turns=6, max_new_tokens=160)
  w = setup.resolve_wiring(c)
  env = tasks.build_env(c)
  questions, key, step = env.train[:c.num_queries], jax.random.key(0), 3

  def rollouts(service_for):
    policies = play.expert_policies(c, w, env, noise=0.5, seed=3)
    service = service_for(policies["sub"])
    eps, sub_eps = play.run_rollouts(c, w, env, policies, questions,
                                     num_rollouts=c.num_rollouts, key=key, step=step,
                                     service=service)
    return eps, sub_eps, service

  eps_a, sub_a, _ = rollouts(lambda p: None)  # The colocated program's default service.
  eps_b, sub_b, loop = rollouts(lambda p: loopback.LoopbackSubAgent(
      loopback.memory_exchange(), play.colocated_sub_agent(c, env, p, key), step=step))
  assert sub_b, "the experts delegate, so requests and results cross the exchange"
  assert [e.tokens for e in eps_b] == [e.tokens for e in eps_a]
  assert [e.tokens for e in sub_b] == [e.tokens for e in sub_a]
  assert len(loop.exchange.list("result")) == len(sub_b)
  batches_a, m_a = mgrpo_step.batches(c, w, play.Rollouts(env, questions, eps_a, sub_a),
                                      jax.random.key(1))
  # The loopback's sub side trains on R_M as it comes back over the exchange.
  main_b, outcome, m_b = mgrpo_step.main_side(c, w, env, questions, eps_b)
  # As the decoupled sub program, which reads the step's questions (sub/call_accuracy).
  sub_batch_b, sub_m = mgrpo_step.sub_side(c, w, env, questions, sub_b,
                                           loop.relay_outcome(outcome), jax.random.key(1))
  m_b.update(sub_m)
  batches_b = {"main": main_b, "sub": sub_batch_b}
  assert loop.exchange.array_steps("main_reward") == [step]  # R_M went through it.
  assert m_a == m_b and m_b["main/delegations"] > 0
  for role in ("main", "sub"):
    for x, y in zip(jax.tree.leaves(batches_a[role]), jax.tree.leaves(batches_b[role])):
      np.testing.assert_array_equal(y, x)


def test_resume_is_bit_identical(tmp_path):
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  colocated.train_and_evaluate(_config(num_steps=4, eval_every=4), straight)
  colocated.train_and_evaluate(_config(num_steps=2, eval_every=4), resumed)
  colocated.train_and_evaluate(_config(num_steps=4, eval_every=4), resumed)
  assert _lines(straight) == _lines(resumed)
  assert [m["step"] for m in _lines(resumed)] == [0, 1, 2, 3, 4]
  ckpt_a = sorted(os.listdir(os.path.join(straight, "hf", "main")))
  assert ckpt_a == sorted(os.listdir(os.path.join(resumed, "hf", "main")))
  from mgrpo_jax import models
  for name in ("main", "sub"):
    _, pa = models.load_hf(os.path.join(straight, "hf", name))
    _, pb = models.load_hf(os.path.join(resumed, "hf", name))
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.devices(8)
def test_moe_step_on_an_expert_mesh_replays_the_samplers_routes(tmp_path):
  # The whole pipeline: the MoE sampler under the agent's 2 data x 4 expert mesh records
  # routes, episodes and the batch carry them, the sharded step replays them (the sub-agent,
  # never called by a random model, gets an all-padding batch with zero routes).
  c = _config("smoke,model=tiny_moe", num_steps=1)
  c.mesh.expert = 4
  c.main_model.routing_replay = c.sub_model.routing_replay = True
  colocated.train_and_evaluate(c, str(tmp_path))
  m = _lines(str(tmp_path))[0]
  assert m["main/tokens"] > 50 and m["main/mismatch_abs_logp"] < 1e-5
  assert m["main/mismatch_ratio_max"] < 1 + 1e-5


def test_sft_resume_is_bit_identical_and_learns(tmp_path):
  def cfg(steps):
    c = sft_config.get_config("smoke,variant=single")
    c.sft.update(num_steps=steps, eval_every=100, checkpoint_every=1, batch_size=8,
                 num_questions=6, other_worlds=1)  # Half the traces from another world.
    return c
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  sft.train_sft(cfg(4), straight)
  sft.train_sft(cfg(2), resumed)
  sft.train_sft(cfg(4), resumed)
  a, b = _lines(straight), _lines(resumed)
  assert [m["step"] for m in b] == [0, 1, 2, 3, 4] and a == b
  assert a[3]["sft/single/nll"] < a[0]["sft/single/nll"]


def test_trace_worlds_ask_questions_and_only_other_worlds_give_pages():
  """sft.trace_worlds: every one of those worlds asks its share of the questions (the
  training split one share too), and only the first sft.other_worlds give corpus rows."""
  c = sft_config.get_config("task=multihop,smoke")
  c.sft.update(num_questions=12, other_worlds=1, trace_worlds=3)
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  data, corpus = sft.warm_start_texts(c, w, env)
  others = [tasks.other_world_env(c, k, num_questions=3) for k in range(3)]
  asked = {e.task.text for e in data["main"]}
  for source, questions in [(env, env.train)] + [(o, o.train + o.test) for o in others]:
    assert len({q.text for q in questions} & asked) == 3
  text = lambda rows: [env.tokenizer.decode(r.tokens) for r in rows]
  assert text(corpus) == text(sft.corpus_rows(env, others[:1]))
  assert len(corpus) > len(sft.corpus_rows(env))
  unread = {d.title for o in others[1:] for d in o.documents} - {
      d.title for o in [env, others[0]] for d in o.documents}
  assert unread and not any(t in row for t in unread for row in text(corpus))


@pytest.mark.parametrize("value", [1, -2, tasks.RL_WORLD_BASE])
def test_trace_worlds_below_other_worlds_are_refused(tmp_path, value):
  c = sft_config.get_config("task=multihop,smoke")
  c.sft.update(other_worlds=2)
  c.sft.trace_worlds = value
  with pytest.raises(checks.ConfigValueError,
                     match=rf"sft\.trace_worlds={value!r}: expected -1 .*other_worlds=2"):
    sft.train_sft(c, str(tmp_path))
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("size", ["runlocal", "smoke"])
def test_single_warm_start_asks_each_world_as_many_questions_as_the_pairs(size):
  """The single agent's teacher solves SINGLE_QUESTIONS_FACTOR times the questions over as
  many times the worlds: the same share per world and the same pages as the pair's."""
  pair, single = (sft_config.get_config(f"task=multihop,{size},variant={v}")
                  for v in ("mgrpo", "single"))
  assert single.sft.num_questions == sft_config.SINGLE_QUESTIONS_FACTOR * pair.sft.num_questions
  assert sft.trace_worlds(single) + 1 == sft_config.SINGLE_QUESTIONS_FACTOR * (
      sft.trace_worlds(pair) + 1)
  assert sft.other_world_questions(single) == sft.other_world_questions(pair)
  assert single.sft.other_worlds == pair.sft.other_worlds and single.sft.only_correct


def test_other_worlds_need_a_generated_world():
  c = sft_config.get_config("task=qa,smoke")
  with pytest.raises(checks.ConfigValueError, match=r"sft\.other_worlds.*task=qa"):
    tasks.other_world_env(c, 0, num_questions=10)


@pytest.mark.parametrize("arg,overrides,match", [
    ("task=qa,smoke", dict(rl_worlds=2), r"config\.rl_worlds=2 needs a generated world"),
    ("smoke", dict(rl_hop_weights=(1.0, 1.0, 0.0)), r"rl_hop_weights=.*config\.rl_worlds=0"),
    ("smoke", dict(rl_worlds=2, rl_hop_weights=(1.0, 0.0)), r"one weight per chain length"),
    ("smoke", dict(rl_worlds=2, rl_hop_weights=(0.0, 0.0, 0.0)), r"positive sum"),
    ("runlocal", dict(rl_worlds=2), r"tokenizer='byte\+world'"),
    ("smoke", dict(rl_worlds=-1), r"config\.rl_worlds=-1; expected an integer >= 0"),
])
def test_rl_worlds_the_task_cannot_serve_are_refused(arg, overrides, match):
  with pytest.raises(checks.ConfigValueError, match=match):
    setup.resolve_wiring(_config(arg, **overrides))


def test_other_worlds_need_the_worlds_own_pages():
  c = _config("task=multihop,smoke", rl_worlds=2)
  c.retrieval.corpus = "/data/pages.jsonl"
  with pytest.raises(checks.ConfigValueError, match=r"config\.rl_worlds needs .*corpus="):
    tasks.other_world_env(c, 0, num_questions=10, field="rl_worlds")


def _adapter_bytes(workdir, name):
  return (Path(workdir) / "lora" / name / lora.ADAPTER_WEIGHTS).read_bytes()


def test_lora_resume_is_bit_identical_and_checkpoints_only_the_adapters(tmp_path):
  def cfg(steps):
    c = _config("smoke,lora=4", num_steps=steps, eval_every=4)
    c.sub_model.lora.rank = 0  # One LoRA agent beside a fully trained one.
    # The smoke model's rewards are all 0 (no advantage), so weight decay is what moves
    # the adapters here; test_sft_lora_resume_... has a gradient.
    c.main_optim.weight_decay = 1.0
    return c
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  colocated.train_and_evaluate(cfg(2), straight)
  colocated.train_and_evaluate(cfg(1), resumed)
  colocated.train_and_evaluate(cfg(2), resumed)
  assert _lines(straight) == _lines(resumed)
  assert _adapter_bytes(straight, "main") == _adapter_bytes(resumed, "main")
  assert not (Path(resumed) / "lora" / "sub").exists()  # The full agent has no adapter.
  with ckpt_lib.Checkpointer(os.path.join(resumed, "checkpoints")) as ckpt:
    states, _ = ckpt.restore()
  main = jax.tree_util.tree_leaves_with_path(states["main"]["params"])
  assert main and all("_lora_" in jax.tree_util.keystr(p) for p, _ in main)
  fresh = setup.build_agents(cfg(2), setup.resolve_wiring(cfg(2)),
                             tasks.build_env(cfg(2)),
                             sharding.make_mesh(dict(cfg(2).mesh)),
                             jax.random.fold_in(jax.random.key(0), 0), only="main")
  moved = [np.any(np.asarray(x) != np.asarray(y)) for (_, x), y in
           zip(main, jax.tree.leaves(fresh["main"].state.params))]
  assert len(moved) == len(main) and all(moved[::2])  # Every A factor (B starts at 0).
  for name in ("main", "sub"):
    _, pa = models.load_hf(os.path.join(straight, "hf", name))
    _, pb = models.load_hf(os.path.join(resumed, "hf", name))
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sft_lora_resume_is_bit_identical_and_learns(tmp_path):
  def cfg(steps):
    c = sft_config.get_config("smoke,variant=single,lora=8")
    c.sft.update(num_steps=steps, eval_every=100, checkpoint_every=1, batch_size=8,
                 num_questions=6, learning_rate=1e-2)
    return c
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  sft.train_sft(cfg(3), straight)
  sft.train_sft(cfg(1), resumed)
  sft.train_sft(cfg(3), resumed)
  a, b = _lines(straight), _lines(resumed)
  assert [m["step"] for m in b] == [0, 1, 2, 3] and a == b
  assert a[2]["sft/single/nll"] < a[0]["sft/single/nll"]
  assert _adapter_bytes(straight, "single") == _adapter_bytes(resumed, "single")


def test_sft_loss_weights_own_context_and_other_roles():
  class Row:  # Only the length of a row's tokens matters to the weights.
    def __init__(self, n):
      self.tokens = [0] * n
  mask = np.array([[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
  rows, weights = [Row(5), Row(3), Row(4)], [None, None, 0.5]
  got = sft._weights(mask, rows, weights, context_weight=0.25)
  want = np.array([[.25, .25, 1, 1, .25, 0],  # own row: generated 1, the rest of it 0.25
                   [.25, 1, .25, 0, 0, 0],
                   [.5, .5, .5, .5, 0, 0]],  # another role's row: all its tokens 0.5
                  np.float32)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(sft._weights(mask, rows[:2] + [Row(4)], [None] * 3, 0.0), mask)


def test_sft_corpus_rows_are_the_pages_as_visit_shows_them():
  c = sft_config.get_config("smoke")
  c.tokenizer = "byte+names"
  env = tasks.build_env(c)
  rows = sft.corpus_rows(env)
  assert len(rows) == len(env.documents) > 0
  for row, doc in zip(rows, env.documents):
    text = env.tokenizer.decode(row.tokens)
    hit, page = text.split("\n", 1)
    assert hit == search.format_hits(env.index.search(doc.title, k=1))  # the search reply
    # then the visit tool's reply, uncut
    assert page == f"[{doc.doc_id}] {doc.title}\n{env.index.visit(doc.doc_id, max_chars=10**6)}"
    assert row.loss_mask.sum() == len(row.tokens)
    # With the world's names as words, the page's title is one token.
    assert env.tokenizer.encode(doc.title) == [env.tokenizer.words.index(doc.title) +
                                               env.tokenizer.vocab_size - len(env.tokenizer.words)]


def test_visit_drills_are_episodes_cut_after_their_first_visit():
  """sft.visit_drill_weight: each visiting episode once more, cut after its first visit, the
  visit turn alone in the loss, at the drill's weight."""
  c = sft_config.get_config("task=multihop,smoke")
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  eps, sub_eps = play.run_rollouts(c, w, env, play.expert_policies(c, w, env, noise=0.0),
                                   env.train[:6], num_rollouts=1, key=jax.random.key(0), step=0)
  assert not sft.visit_drills(eps, env.tokenizer, 3.0)  # The main agent never visits.
  drills = sft.visit_drills(sub_eps, env.tokenizer, 3.0)
  visiting = [e for e in sub_eps if "<visit>" in env.tokenizer.decode(e.tokens)]
  assert len(drills) == len(visiting) > 0
  for d, e in zip(drills, visiting):
    n = len(d.tokens)
    np.testing.assert_array_equal(d.tokens, e.tokens[:n])  # a prefix of the episode
    weighted = np.flatnonzero(d.loss_mask)
    assert set(d.loss_mask[weighted]) == {3.0} and weighted[-1] == n - 1
    np.testing.assert_array_equal(weighted, np.arange(weighted[0], n))  # one turn
    assert np.all(np.asarray(e.loss_mask)[weighted] == 1)  # that the agent generated
    turn = env.tokenizer.decode(d.tokens[weighted[0]:])
    first_visit = re.search(r"<visit>.*?</visit>", env.tokenizer.decode(e.tokens)).group(0)
    assert turn.strip().startswith(first_visit), turn
    assert turn.count("<visit>") == 1 and "<visit>" not in env.tokenizer.decode(
        d.tokens[:weighted[0]])
  batch = batch_lib.make_batch(drills, np.ones(len(drills)), max_len=c.limits.max_len,
                               pad_id=env.tokenizer.pad_id, minimum=8)
  assert batch.loss_mask.sum() == 3.0 * sum(np.count_nonzero(d.loss_mask) for d in drills)


def test_report_turns_are_weighted_in_place():
  """sft.report_weight: the <result> and <answer> turns of the agents' own traces weigh
  more; every other token keeps its weight, the tokens are unchanged."""
  c = sft_config.get_config("task=multihop,smoke")
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  tok = env.tokenizer
  eps, sub_eps = play.run_rollouts(c, w, env, play.expert_policies(c, w, env, noise=0.0),
                                   env.train[:6], num_rollouts=1, key=jax.random.key(0), step=0)
  for before in (eps, sub_eps):
    after = sft.weigh_reports(before, tok, 7.0)
    tag = "<answer>" if before is eps else "<result>"
    for a, b in zip(after, before):
      assert a.tokens == b.tokens and a.role == b.role and a.q == b.q
      old, new = np.asarray(b.loss_mask, np.float32), np.asarray(a.loss_mask)
      changed = np.flatnonzero(new != old)
      assert len(changed) and set(new[changed]) == {7.0} and set(old[changed]) == {1.0}
      text = tok.decode([a.tokens[i] for i in changed])
      assert text.startswith(tag) and text.count(tag) == 1, text
      assert re.search(re.escape(tag) + r"(.*?)</", tok.decode(b.tokens)).group(1) in text
      np.testing.assert_array_equal(changed, np.arange(changed[0], changed[-1] + 1))


def test_byte_world_tokenizer_adds_phrases_roles_and_prompts():
  c = sft_config.get_config("smoke")
  c.tokenizer = "byte+world"
  env = tasks.build_env(c)
  words = env.tokenizer.words
  assert len(set(words)) == len(words)
  c_names = sft_config.get_config("smoke")
  c_names.tokenizer = "byte+names"
  names = tasks.build_env(c_names).tokenizer.words
  assert set(names) < set(words) and " counts as " in words
  tok = env.tokenizer
  word_id = lambda w: words.index(w) + tok.vocab_size - len(words)
  ids = tok.encode("<|im_start|>user\nQuestion: In which country is ")
  assert ids[1:] == [word_id("user\n"), word_id("Question: "), word_id("In which country is ")]
  assert tok.decode(ids) == "<|im_start|>user\nQuestion: In which country is "
  the_world = world_lib.generate_world(world_lib.WorldConfig())
  assert tasks.tokenizer_words("byte", the_world) == ()


def test_warm_start_from_another_tokenizer_is_refused(tmp_path):
  c = _config(tokenizer="byte+names")
  mesh = sharding.make_mesh(dict(c.mesh))
  env = tasks.build_env(c)
  w = setup.resolve_wiring(c)
  workdir_lib.save_final_hf(str(tmp_path), setup.build_agents(c, w, env, mesh,
                                                                jax.random.key(0)),
                         env.tokenizer)
  words_file = tmp_path / "hf" / "main" / "byte_tokenizer_words.json"
  assert json.loads(words_file.read_text())["words"] == list(env.tokenizer.words)
  start = lambda cfg: setup.build_agents(cfg, w, tasks.build_env(cfg), mesh,
                                         jax.random.key(0))
  start(_config(f"smoke,init={tmp_path}", tokenizer="byte+names"))  # the same tokenizer: fine
  with pytest.raises(ValueError, match=r"has \d+ token ids but the byte tokenizer \(\d+ ids\) "
                                       r"has more"):
    start(_config(f"smoke,init={tmp_path}", tokenizer="byte+world"))  # more ids
  words = json.loads(words_file.read_text())["words"]
  words_file.write_text(json.dumps({"words": words[1:] + ["Elsewhere"]}))  # same size, shifted
  with pytest.raises(ValueError, match="byte_tokenizer_words.json"):
    start(_config(f"smoke,init={tmp_path}", tokenizer="byte+names"))


def test_evaluate_writes_eval_json_for_experts(tmp_path):
  c = _config("smoke,policy=expert")
  c.limits.update(max_turns=6, max_new_tokens=160)
  result = evaluate.run(c, str(tmp_path))
  with open(tmp_path / "eval.json") as f:
    saved = json.load(f)
  assert saved["accuracy"] == result["accuracy"] == 1.0
  assert saved["format"] == 1.0 and saved["delegations"] >= 1


def test_bad_config_value_names_the_field(tmp_path):
  c = _config()
  c.main_loss.agg = "mean"
  with pytest.raises(checks.ConfigValueError, match=r"config\.main_loss\.agg"):
    colocated.train_and_evaluate(c, str(tmp_path))
  c = _config()
  c.limits.max_len = 0
  with pytest.raises(checks.ConfigValueError, match=r"config\.limits\.max_len"):
    colocated.train_and_evaluate(c, str(tmp_path))
  with pytest.raises(ValueError, match="variant"):
    mgrpo.get_config("variant=bogus")


def test_launcher_rejects_a_misspelt_field(tmp_path):
  """lock_config: an unknown field fails at start-up, naming it."""
  proc = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/mgrpo.py:smoke",
       f"--workdir={tmp_path}", "--config.num_step=3"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode != 0
  assert "num_step" in proc.stderr
