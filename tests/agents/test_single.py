"""Single-agent baseline: the "single" role, its scripted expert and its rollouts."""

import collections
import random

import jax
import numpy as np
import pytest

from mgrpo_jax import byte_tokenizer, chat_format, models
from mgrpo_jax.agents import experts as ex
from mgrpo_jax.agents import prompts, validator
from mgrpo_jax.agents import protocol as pr
from mgrpo_jax.agents import rollout
from mgrpo_jax.envs import retrieval, search
from mgrpo_jax.envs import world as wd
from mgrpo_jax.rl.rewards import exact_match

TOK = byte_tokenizer.ByteTokenizer()
# A 3-hop episode is 7 turns; its byte sequence stays under 4k (see the rollout test).
LIMITS = rollout.Limits(max_turns=8, max_new_tokens=160, max_len=8192)

_CONFIGS = {
  "plain": wd.WorldConfig(seed=2, distractors_per_doc=3),
  "lookalike": wd.WorldConfig(seed=5, distractors_per_doc=5, name_similarity=0.5),
}


@pytest.fixture(scope="module", params=sorted(_CONFIGS))
def setting(request):
  world = wd.generate_world(_CONFIGS[request.param])
  questions = wd.make_questions(world, num=150, seed=1)  # 50 per hop count
  return world, retrieval.Bm25Retriever.from_documents(world.documents), questions


@pytest.fixture(scope="module")
def env():
  w = wd.generate_world(wd.WorldConfig(seed=3))
  return wd.make_questions(w, num=30, seed=1), retrieval.Bm25Retriever.from_documents(w.documents)


def _actions(turns):
  return [pr.parse_turn(t, "single").action for t in turns]


# ----------------------------------------------------------------------------------- protocol


def test_single_role_has_every_tool_and_answers():
  assert "single" in pr.ROLES and pr.FINAL_ACTION["single"] == "answer"
  assert set(pr.ACTIONS["single"]) == {"search", "visit", "python", "answer"}
  for action in pr.ACTIONS["single"]:
    turn = pr.parse_turn(pr.render_action(action, "x", think="t"), "single")
    assert (turn.ok, turn.action, turn.argument, turn.think) == (True, action, "x", "t")
  texts = ["<search>a</search>", "<visit>doc001</visit>", "<python>print(1)</python>",
           "<answer>b</answer>"]  # fmt: skip
  v = validator.EpisodeValidator("single", max_turns=4)
  for text in texts:
    assert not v.done and v.step(text).ok
  assert v.format_ok and v.final.argument == "b"
  assert not validator.format_ok(texts[:3], "single", 20)  # no final answer


@pytest.mark.parametrize("role,text,error", [
  ("single", "<delegate>x</delegate>", "<delegate> is an action of the main agent, not the single"),
  ("single", "<result>x</result>", "<result> is an action of the sub agent, not the single"),
  ("single", "<delegate>x<context>c</context></delegate>", "<delegate> is an action of the main"),
  ("main", "<search>x</search>", "<search> is an action of the sub agent, not the main agent"),
  ("main", "<visit>x</visit>", "<visit> is an action of the sub agent, not the main agent"),
  ("sub", "<answer>x</answer>", "<answer> is an action of the main agent, not the sub agent"),
  ("sub", "<python>x</python>", "<python> is an action of the main agent, not the sub agent"),
])  # fmt: skip
def test_each_role_rejects_the_others_actions(role, text, error):
  turn = pr.parse_turn(text, role)
  assert not turn.ok and error in turn.error


def test_main_and_sub_are_unchanged_by_the_single_role():
  assert pr.ACTIONS["main"] == ("delegate", "python", "answer")
  assert pr.ACTIONS["sub"] == ("search", "visit", "result")
  assert (pr.FINAL_ACTION["main"], pr.FINAL_ACTION["sub"]) == ("answer", "result")
  # The single role adds no tag: TAGS are those of main and sub, each once (in the order of
  # their token ids, chat_format.PROTOCOL_TAGS).
  names = ("think", "delegate", "python", "answer", "search", "visit", "result", "context",
           "tool_response")  # fmt: skip
  assert sorted(pr.TAGS) == sorted(f"<{s}{n}>" for n in names for s in ("", "/"))
  assert pr.TAGS == chat_format.PROTOCOL_TAGS
  assert pr.stop_strings("main")[:3] == ("</delegate>", "</python>", "</answer>")
  assert pr.stop_strings("sub")[:3] == ("</search>", "</visit>", "</result>")


def test_single_prompt_and_stop_tokens():
  system, user = prompts.single_messages("Who wrote <x>?")
  assert (system["role"], user["role"]) == ("system", "user")
  assert user["content"] == prompts.main_user_prompt("Who wrote <x>?")
  for action in pr.ACTIONS["single"]:
    assert f"<{action}>" in system["content"]
  assert "<delegate>" not in system["content"] and "<result>" not in system["content"]
  assert pr.stop_strings("single") == ("</search>", "</visit>", "</python>", "</answer>",
                                       *pr.END_OF_TURN)  # fmt: skip
  ids = pr.stop_token_ids(TOK, "single")
  assert TOK.token_id("</python>") in ids and TOK.eos_id in ids
  assert TOK.token_id("</delegate>") not in ids and TOK.token_id("</result>") not in ids


# ------------------------------------------------------------------------------------- expert


def test_noise_free_single_expert_answers_through_the_real_tools(setting):
  _, index, questions = setting
  results = [ex.solve_single(q, index) for q in questions]
  by_hops = collections.defaultdict(list)
  for q, r in zip(questions, results):
    by_hops[len(q.hops)].append(r["correct"])
  accuracy = {h: float(np.mean(v)) for h, v in sorted(by_hops.items())}
  assert set(accuracy) == {1, 2, 3} and min(accuracy.values()) >= 0.95, accuracy
  for q, r in zip(questions, results):
    assert all(pr.parse_turn(t, "single").ok for t in r["turns"]), r["turns"]
    assert r["format_ok"] and validator.format_ok(r["turns"], "single", 20)
    assert r["correct"] == exact_match(r["answer"], q.answer)
    assert _actions(r["turns"]) == ["search", "visit"] * len(q.hops) + ["answer"]
    if r["correct"]:  # then it walked the world's own chain, one page per hop
      args = [pr.parse_turn(t, "single").argument for t in r["turns"]]
      assert args[:-1:2] == [h.entity for h in q.hops]
      assert args[1::2] == [h.doc_id for h in q.hops]
  # It reads pages as the sub-agent does: the same answers as the multi-agent experts.
  multi = [ex.solve(q, index)["answer"] for q in questions]
  assert multi == [r["answer"] for r in results]


def test_single_expert_is_stateless(setting):
  _, index, questions = setting
  expert, rng = ex.SingleExpert(), random.Random(0)
  for q in questions[::10]:
    r = ex.solve_single(q, index)
    # Any prefix of the tool replies gives back the turn that followed it, in any call order.
    for i in reversed(range(len(r["turns"]))):
      assert expert.turn(q, r["observations"][:i], rng) == r["turns"][i]


def test_noise_hurts_accuracy_but_never_format_or_the_chain(setting):
  _, index, questions = setting
  rng = np.random.default_rng(0)
  noisy = [ex.solve_single(q, index, noise=0.5, rng=rng, think=i % 2 == 0)
           for i, q in enumerate(questions)]  # fmt: skip
  assert np.mean([r["correct"] for r in noisy]) < 0.5
  for q, r in zip(questions, noisy):
    assert r["format_ok"] and len(r["turns"]) <= 2 * len(q.hops) + 1
    # Rereading is noise-free, so each later hop searches what the page before it stated,
    # even on a wrong page (its own subject's fact) and with every draw since.
    args = [pr.parse_turn(t, "single").argument for t in r["turns"]]
    for j in range(1, (len(r["observations"]) + 1) // 2):
      _, title, text = ex.parse_visit(r["observations"][2 * j - 1])
      stated = {a: v for a, v, _ in ex.extract_facts(text, title)}
      assert args[2 * j] == stated[q.hops[j - 1].attribute]


@pytest.mark.parametrize("make_rng", [random.Random, np.random.default_rng])
def test_seeded_rng_is_deterministic(setting, make_rng):
  _, index, questions = setting

  def run(seed, noise):
    rng = make_rng(seed)
    return [ex.solve_single(q, index, noise=noise, rng=rng) for q in questions[:30]]

  assert run(3, 0.5) == run(3, 0.5)
  assert run(3, 0.5) != run(4, 0.5)
  assert run(3, 0.0) == run(4, 0.0)  # no noise: the rng is not even drawn from


def test_single_expert_fails_softly(setting):
  world, index, questions = setting
  tools, expert, rng = search.local_tools(index), ex.SingleExpert(think=False), random.Random(0)
  unknown = "<answer>unknown</answer>"
  assert expert.turn("Tell me a story.", [], rng) == unknown
  q = next(q for q in questions if len(q.hops) == 2)
  assert expert.turn(q, [], rng) == f"<search>{q.hops[0].entity}</search>"
  assert expert.turn(q, ["No results found."], rng) == unknown
  assert expert.turn(q, ["x", "Error: no document 'x'."], rng) == unknown
  # The right page, but without the asked attribute (an organisation's page, asked a birthplace).
  org = next(e for e in world.entities if e.kind == "organisation")
  plain = f"Where was {org.name} born?"
  assert expert.turn(plain, ["x", tools["visit"](org.doc_id)], rng) == unknown
  # A plain one-hop question in the world's wording is looked up like a chain of one.
  person = next(e for e in world.entities if e.kind == "person")
  plain = f"Where was {person.name} born?"
  observations = [tools["search"](person.name), tools["visit"](person.doc_id)]
  assert expert.turn(plain, observations[:1], rng) == f"<visit>{person.doc_id}</visit>"
  assert expert.turn(plain, observations, rng) == (
    f"<answer>{person.attributes['birthplace']}</answer>")


# ------------------------------------------------------------------------------------ rollout




def test_expert_rollouts_reproduce_the_plain_driver(env, check_sequence):
  qs, index = env
  policy = rollout.ExpertPolicy(ex.SingleExpert(), TOK)
  eps = rollout.rollout_single(policy, qs, num_rollouts=2, tokenizer=TOK, limits=LIMITS,
                               key=jax.random.key(0), tools=search.local_tools(index))
  assert [(e.role, e.q, e.k, e.call) for e in eps] == [
    ("single", q, k, -1) for q in range(len(qs)) for k in range(2)]
  assert np.mean([exact_match(e.final or "", qs[e.q].answer) for e in eps]) >= 0.95
  for e in eps:
    assert e.format_ok and e.delegations == 0
    check_sequence(e)
    assert e.num_generated == sum(len(TOK.encode(t)) for t in e.turns)
    assert TOK.decode(e.tokens).startswith("<|im_start|>system\n" + prompts.single_system_prompt())
    # The engine and the plain driver run the same episode.
    r = ex.solve_single(qs[e.q], index)
    assert (e.turns, e.observations, e.final) == (r["turns"], r["observations"], r["answer"])
    assert e.actions == _actions(r["turns"])
  assert max(len(e.tokens) for e in eps) < 4096


class _Scripted:
  """An expert that plays fixed turns, one per tool reply seen."""

  def __init__(self, turns):
    self.turns = turns

  def turn(self, task, observations, rng):
    del task, rng
    return self.turns[len(observations)]


def test_rollout_single_dispatches_tools_by_name(env, check_sequence):
  qs, index = env
  calls = []

  def python(code):
    calls.append(code)
    return "3"

  turns = ["<python>print(1 + 2)</python>", "<search>x</search>", "<answer>3</answer>"]
  tools = {"python": python}  # no search tool: its call gets an error reply
  eps = rollout.rollout_single(rollout.ExpertPolicy(_Scripted(turns), TOK), qs[:2],
                               num_rollouts=1, tokenizer=TOK, limits=LIMITS,
                               key=jax.random.key(0), tools=tools, system_prompt=False)
  assert calls == ["print(1 + 2)"] * 2
  for e in eps:
    assert e.format_ok and e.actions == ["python", "search", "answer"]
    assert e.observations == ["3", "Error: no search tool here."]
    assert TOK.decode(e.tokens).startswith("<|im_start|>user\nQuestion: ")
    check_sequence(e)


def test_random_llm_single_rollouts_end_cleanly(env, check_sequence):
  qs, index = env
  cfg = models.get_preset("tiny", vocab_size=TOK.vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  limits = rollout.Limits(max_turns=3, max_new_tokens=24, max_len=1024)
  policy = rollout.LLMPolicy(cfg, params, TOK, "single", limits=limits, temperature=1.0)
  eps = rollout.rollout_single(policy, qs[:3], num_rollouts=2, tokenizer=TOK, limits=limits,
                               key=jax.random.key(1), tools=search.local_tools(index))
  for e in eps:
    assert e.done and (e.format_ok or e.validator.failure)
    check_sequence(e)
    assert 1 <= e.num_generated <= limits.max_turns * limits.max_new_tokens
    assert np.all(np.asarray(e.logprobs)[np.asarray(e.loss_mask, bool)] <= 0)
