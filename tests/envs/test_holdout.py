"""The held-out task: held-out parts of the world, the leak check over every page, the guesser."""

import dataclasses
import re

import pytest

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import config_checks as checks
from mgrpo_jax import keys, tokenizer_io
from mgrpo_jax.mgrpo import setup, sft, tasks
from mgrpo_jax.agents import experts
from mgrpo_jax.envs import multihop, search
from mgrpo_jax.envs import world as world_lib
from mgrpo_jax.rl import rewards

_CFG = world_lib.WorldConfig(seed=3, num_people=40, num_orgs=20, num_places=20, num_works=20,
                             holdout=(0.2, 0.25))


def test_links_stay_inside_their_part():
  world = world_lib.generate_world(_CFG)
  parts = {e.name: e.part for e in world.entities}
  assert {p: sum(v == p for v in parts.values()) for p in world_lib.PARTS} == {
      "train": 22 + 11 + 11 + 11, "valid": 8 + 4 + 4 + 4, "test": 10 + 5 + 5 + 5}
  for e in world.entities:
    for attr, value in e.attributes.items():
      if attr in world_lib.LINKS:
        assert parts[value] == e.part, (e.name, attr, value)


def test_one_part_world_is_the_old_world():
  """holdout (0, 0) draws exactly what the world drew before parts existed."""
  base = world_lib.WorldConfig(seed=3)
  assert world_lib.generate_world(base).entities == world_lib.generate_world(
      world_lib.WorldConfig(seed=3, holdout=(0.0, 0.0))).entities
  assert {e.part for e in world_lib.generate_world(base).entities} == {"train"}
  with pytest.raises(ValueError, match="holdout"):
    world_lib.generate_world(world_lib.WorldConfig(seed=3, holdout=(0.5, 0.5)))


def test_split_by_part_keeps_only_single_part_questions():
  world = world_lib.generate_world(_CFG)
  questions = multihop.make_questions(world, num=300, hop_weights=(1, 2, 2, 2),
                                      compare_fraction=0.5, seed=1)
  split = world_lib.split_by_part(world, questions)
  assert all(split[p] for p in world_lib.PARTS)
  assert sum(map(len, split.values())) == len(questions)  # Links and pairs stay in a part.
  for part, qs in split.items():
    for q in qs:
      assert {world.entity_of_doc(h.doc_id).part for h in q.hops} == {part}


@pytest.fixture(scope="module")
def cpu_task():
  c = mgrpo_config.get_config("task=multihop,runlocal")
  return c, tasks.build_env(c)


def test_multihop_task_holds_out_whole_chains(cpu_task):
  """The sweep's task (CPU size): no validation or test page is in a training question's
  chain or in the warm start's corpus (env.documents, which sft.corpus_rows turns into rows),
  and every held-out question's pages are all held out."""
  _, env = cpu_task
  train_pages = {h.doc_id for q in env.train for h in q.hops}
  corpus = {d.doc_id for d in env.documents}
  assert len(env.valid) >= 200 and len(env.test) >= 200
  for q in env.valid + env.test:
    pages = {h.doc_id for h in q.hops}
    assert not pages & train_pages and not pages & corpus
  assert train_pages <= corpus
  assert not {q.text for q in env.train} & {q.text for q in env.valid + env.test}
  assert not any(q.compare for q in env.train + env.valid + env.test)  # Binary ones removed.


def _token_ids(tokenizer, texts) -> set[int]:
  return {i for t in texts for i in tokenizer.encode(t)}


def test_held_out_questions_need_no_token_that_training_never_shows(cpu_task):
  """Every token id of a held-out question, its pages and its answer is in the warm start's
  training text: the training questions, answers and pages, and the other worlds' questions
  and pages (`sft.other_worlds`). A name with an id of its own that only held-out text uses
  (the byte+world tokenizer) has an untrained embedding the model cannot write; the doc ids'
  own ids (byte+phrases+ids) are trained by the other worlds, which share them."""
  c, env = cpu_task
  assert c.tokenizer == "byte+phrases+ids"
  the_world = world_lib.generate_world(tasks.world_config(c))
  s = sft_config.get_config("task=multihop,runlocal")
  # Two of the 29 other worlds already cover every held-out token (all of them do, then).
  assert s.sft.other_worlds >= 2
  others = [tasks.other_world_env(s, k, num_questions=100) for k in range(2)]

  def ids(tokenizer, questions, pages):
    return _token_ids(tokenizer, [q.text for q in questions] + [q.answer for q in questions]
                      + [f"[{d.doc_id}] {d.title}\n{d.text}" for d in pages])  # As visited.

  def trained(tokenizer, with_others=True):
    out = ids(tokenizer, env.train, env.documents)
    for o in others if with_others else ():
      out |= ids(tokenizer, o.train + o.test, o.documents)
    return out

  held = env.valid + env.test
  held_pages = [the_world.document(h.doc_id) for q in held for h in q.hops]
  tok = env.tokenizer
  assert not ids(tok, held, held_pages) - trained(tok)
  # Without the other worlds, held-out pages' doc ids would be untrained ids.
  assert ids(tok, held, held_pages) - trained(tok, with_others=False)
  one_id_per_name = tokenizer_io.load_tokenizer(
      "byte+world", words=tasks.tokenizer_words("byte+world", the_world))
  assert ids(one_id_per_name, held, held_pages) - trained(one_id_per_name)


def _naming(names):
  """Whether a text names one of `names` (whole words)."""
  pattern = re.compile("|".join(rf"\b{re.escape(n)}\b" for n in names))
  return lambda text: bool(pattern.search(text))


def test_warm_start_other_worlds_bring_new_names_and_no_held_out_one(cpu_task):
  """sft.other_worlds: the traces and pages of other generated worlds, whose names are not
  the task's (a tiny model cannot memorise them all, so it learns to copy), and none of
  whose kept rows names a held-out entity (two invented worlds can share a word)."""
  c = sft_config.get_config("task=multihop,runlocal")
  env = cpu_task[1]
  assert tasks.world_config(c) == tasks.world_config(cpu_task[0])
  c.sft.update(num_questions=90, other_worlds=2)
  w = setup.resolve_wiring(c, training=False)
  others = [tasks.other_world_env(c, k, num_questions=30) for k in range(2)]
  own = {d.title for d in env.documents} | set(env.held_out_names)
  assert len(env.held_out_names) == 60
  for o in others:
    titles = {d.title for d in o.documents}
    assert len(o.train) + len(o.test) == 30 and not o.valid and len(titles) == 200
    assert len(titles & own) <= 4, titles & own  # Another world: other names.

  # The training world's own traces may name a held-out entity (a search hit's title, as
  # the instrument's table says), so these checks read the other worlds' rows only.
  held = _naming(env.held_out_names)
  data = sft.expert_episodes(c, w, env, seed=0, others=others)
  texts = [env.tokenizer.decode(e.tokens) for eps in data.values() for e in eps]
  other_questions = {q.text for o in others for q in o.train + o.test}
  asked = {e.task.text for e in data["main"]}
  assert {q.text for q in env.train} & asked and all(
      {q.text for q in o.train + o.test} & asked for o in others)
  assert not any(held(env.tokenizer.decode(e.tokens)) for e in data["main"]
                 if e.task.text in other_questions)
  rows = [env.tokenizer.decode(r.tokens) for r in sft.corpus_rows(env, others)]
  assert rows[:len(env.documents)] == [
      env.tokenizer.decode(r.tokens) for r in sft.corpus_rows(env)]
  assert 0 < len(rows) - len(env.documents) <= 400
  assert not any(map(held, rows[len(env.documents):]))

  # The filter is what keeps them out, from every row (the sub-agent's too): call some of
  # the first other world's names held out.
  planted = tuple(q.hops[0].entity for q in others[0].train[:5])
  assert any(map(_naming(planted), texts))
  planted_env = dataclasses.replace(env, held_out_names=planted)
  data = sft.expert_episodes(c, w, planted_env, seed=0, others=others)
  assert not any(_naming(planted)(env.tokenizer.decode(e.tokens))
                 for eps in data.values() for e in eps)
  assert any(map(_naming(planted), rows))
  assert not any(_naming(planted)(env.tokenizer.decode(r.tokens))
                 for r in sft.corpus_rows(planted_env, others))


def _world(pages: dict[str, str]) -> world_lib.World:
  docs = tuple(world_lib.Document(d, d.upper(), text) for d, text in pages.items())
  return world_lib.World(world_lib.WorldConfig(), (), docs)


def _hop(doc_id: str, answer: str = "x", attribute: str = "birthplace",
         entity: str = "E") -> world_lib.Hop:
  return world_lib.Hop(entity, attribute, answer, doc_id, "?")


def test_leak_check_reads_every_page_before_the_last():
  world = _world({"d1": "Alpha is here.", "d2": "Near Zorn lies Beta.", "d3": "Zorn is it."})
  chain = lambda *docs: world_lib.Question("q", "?", "Zorn", tuple(_hop(d) for d in docs))
  assert multihop.leaks(world, chain("d2", "d1", "d3"))  # On the first page.
  assert multihop.leaks(world, chain("d1", "d2", "d3"))  # On a middle page only.
  assert not multihop.leaks(world, chain("d1", "d3"))  # Only on the last, answering page.
  assert not multihop.leaks(world, chain("d3"))


def _q(text, answer, entity, attribute="country", compare="", side=0, second="B"):
  hops = (_hop("d1", answer, attribute, entity),)
  if compare:
    hops += (_hop("d2", answer, attribute, second),)
  return world_lib.Question(text, text, answer, hops, compare=compare, side_hops=side)


def test_no_tool_guesser_rules():
  train = [_q("In which country is Al?", "Ostia", "Al"),
           _q("In which country is Bo?", "Ostia", "Bo"),
           _q("In which country is Cy?", "Zemark", "Cy"),
           _q("In which country is the birthplace of Di?", "Zemark", "Di"),
           _q("On which river does Ed lie?", "Vel", "Ed", "river"),
           _q("On which river does Fa lie?", "Orn", "Fa", "river")]
  guess = multihop.no_tool_guesser(train)
  # Majority per template and final attribute (not per attribute alone: Zemark ties there).
  assert guess(_q("In which country is Gu?", "?", "Gu")) == "Ostia"
  assert guess(_q("In which country is the birthplace of Ho?", "?", "Ho")) == "Zemark"
  assert guess(_q("On which river does Ix lie?", "?", "Ix", "river")) == "Vel"  # First seen.
  # An unseen template falls back to the attribute's majority; an unseen attribute to "".
  assert guess(_q("In which country is the headquarters of Jo?", "?", "Jo")) == "Ostia"
  assert guess(_q("Who founded Ka?", "?", "Ka", "founder")) == ""
  assert guess(_q("Were Al and Bo born in the same country?", "yes", "Al", compare="same",
                  side=1, second="Bo")) == "no"
  assert guess(_q("Who was born earlier, Lu or Mo?", "Mo", "Lu", "birth_year", "earlier",
                  1, "Mo")) == "Lu"
  assert multihop.template(_q("Who was born earlier, Lu or Mo?", "Mo", "Lu", "birth_year",
                              "earlier", 1, "Mo")) == "Who was born earlier, {} or {}?"


def test_no_tool_guesser_is_at_most_ten_percent_on_the_test_split():
  env = tasks.build_env(mgrpo_config.get_config("task=multihop,runlocal"))
  guess = multihop.no_tool_guesser(env.train)
  right = [bool(rewards.exact_match(guess(q), q.answer)) for q in env.test]
  assert sum(right) / len(right) <= 0.10
  # On its own training questions it is far better: the rule is not a broken one.
  train_right = [bool(rewards.exact_match(guess(q), q.answer)) for q in env.train]
  assert sum(train_right) / len(train_right) > sum(right) / len(right)


def test_shuffled_search_hits_leave_the_choice_to_the_agent():
  """The multi-hop task's search: the same hits as by score, in an order drawn from the
  query (the same query, the same order), so the needed page is often not the first hit."""
  env = tasks.build_env(mgrpo_config.get_config("task=multihop,runlocal"))
  tool = env.tools["search"]
  assert tool.shuffle and tool.k >= 2
  first = []
  for q in env.test[:40]:
    h = q.hops[0]
    reply = tool(h.entity)
    assert reply == tool(h.entity)
    assert sorted(reply.splitlines()) == sorted(
        search.format_hits(env.index.search(h.entity, tool.k)).splitlines())
    first.append(experts.parse_hits(reply)[0][0] == h.doc_id)
  assert 0.2 < sum(first) / len(first) < 0.9


def test_rl_worlds_ask_questions_no_warm_start_read(cpu_task, tmp_path):
  """config.rl_worlds = N: step s asks world s mod N's questions, with that world's tools
  and the task's tokenizer, none of them a question of the task or a held-out name, the same
  ones again on a resumed run; 0 keeps the training split."""
  c, env = cpu_task
  c = c.copy_and_resolve_references()
  c.num_queries, c.rl_worlds, c.rl_hop_weights = 8, 0, ()
  assert tasks.TrainingQuestions(c, env)(5) == (
      env, keys.examples_for_step(env.train, 5, 8, c.seed))
  c.rl_worlds = 3
  draw = tasks.TrainingQuestions(c, env)
  steps = {s: draw(s) for s in range(7)}
  task_questions = {q.text for q in env.train + env.valid + env.test}
  pages = lambda e: [d.text for d in e.documents]
  for s, (world_env, questions) in steps.items():
    assert world_env is not env and world_env.tokenizer is env.tokenizer
    assert len(questions) == 8 and not {q.text for q in questions} & task_questions
    assert all(q in world_env.train for q in questions)
    for q in questions:  # The step's tools read its world: the answer is on the last page.
      assert q.answer in world_env.tools["visit"](q.hops[-1].doc_id), (s, q.text)
    assert pages(world_env) != pages(env)
  assert pages(steps[0][0]) == pages(steps[3][0]) == pages(steps[6][0])
  worlds = [tuple(pages(steps[k][0])) for k in range(3)]
  assert len(set(worlds)) == 3
  assert [q.text for q in steps[0][1]] != [q.text for q in steps[3][1]]
  assert [q.text for q in tasks.TrainingQuestions(c, env)(4)[1]] == [
      q.text for q in steps[4][1]]

  # A curriculum: RL on one-page chains only; weights that do not match the task's refused.
  c.rl_hop_weights = (1.0, 0.0, 0.0, 0.0)
  assert {len(q.hops) for q in tasks.rl_world_env(c, 0, env).train} == {1}
  c.rl_hop_weights = (1.0, 0.0)
  with pytest.raises(checks.ConfigValueError, match=r"config\.rl_hop_weights=\(1\.0, 0\.0\)"):
    setup.resolve_wiring(c)
  c.rl_hop_weights = ()

  # The held-out names filter: call some of world 0's names held out.
  planted = tuple(q.hops[0].entity for q in steps[0][0].train[:5])
  kept = tasks.rl_world_env(c, 0, dataclasses.replace(env, held_out_names=planted)).train
  assert len(kept) < len(steps[0][0].train)
  assert not any(_naming(planted)(" ".join([q.text] + [h.entity for h in q.hops]))
                 for q in kept)

  # The warm start's other worlds stop below RL's first world.
  s = sft_config.get_config("task=multihop,runlocal")
  s.sft.other_worlds = tasks.RL_WORLD_BASE
  with pytest.raises(checks.ConfigValueError, match=r"sft\.other_worlds"):
    sft.train_sft(s, str(tmp_path / "sft"))
  assert not (tmp_path / "sft").exists()
