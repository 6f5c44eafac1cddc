"""Scripted experts for real multi-hop QA (task=qa): traces from the data's gold structure.

`QAMainExpert` delegates the question's hops in order (MuSiQue's decomposition, or the hops
`datasets.load_qa` builds from HotpotQA's supporting facts), filling `#k` with the result the
sub-agent returned for hop k, not the gold answer, so a wrong sub-agent makes a wrong main
agent; it answers with the last hop's result (a HotpotQA comparison: the gold answer, once
every hop found its evidence). `QASubExpert` searches its subtask as a plain query (a
knowledge-base hop such as "Hello Love >> performer" becomes "Hello Love performer"),
visits the hits of that search in rank order (at most `search_k`, at most 5) and reports an
accepted sub-answer only from a visited page that states it; else it reports that it found
nothing (`experts.UNKNOWN`). What it accepts for a subtask comes from `oracle`, built from
the training questions' hops. Both are stateless like `agents.experts`: every call gets the
task and the replies so far and returns the next turn's text. A "jsonl" dataset has no gold
structure: asking for its experts raises `NoGoldStructure`.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from typing import Any, Mapping, Sequence

from mgrpo_jax.agents import experts, protocol
from mgrpo_jax.agents.validator import EpisodeValidator
from mgrpo_jax.envs import qa
from mgrpo_jax.envs import search as search_lib
from mgrpo_jax.envs.datasets import QAQuestion
from mgrpo_jax.rl.rewards import normalize_answer

__all__ = ["MAX_VISITS", "NoGoldStructure", "QAMainExpert", "QASubExpert", "fill", "oracle",
           "query_of", "solve_qa"]  # fmt: skip

MAX_VISITS = 5  # Hits a sub-agent reads per search, whatever search_k is.
_SLOT = re.compile(r"#(\d+)")
_FAILURES = ("no valid result", "limit reached", "error:")


class NoGoldStructure(ValueError):
  """Experts were asked for questions without hops (a "jsonl" dataset)."""


def fill(template: str, results: Sequence[str]) -> str:
  """`template` with each `#k` (1-based) replaced by `results[k - 1]` (left as is past them)."""
  return _SLOT.sub(lambda m: results[int(m.group(1)) - 1]
                   if 1 <= int(m.group(1)) <= len(results) else m.group(0), template)  # fmt: skip


def query_of(subtask: str) -> str:
  """The search query of a subtask: a ">>" knowledge-base hop becomes plain words."""
  return " ".join(subtask.replace(">>", " ").split())


def _key(subtask: str) -> str:
  return " ".join(subtask.split()).lower()


def oracle(questions: Sequence[QAQuestion]) -> dict[str, tuple[str, ...]]:
  """Subtask text (every hop filled with accepted answers of the hops before) -> the
  accepted sub-answers: what `QASubExpert` knows. Raises `NoGoldStructure` without hops."""
  out: dict[str, tuple[str, ...]] = {}
  for q in questions:
    if not q.hops:
      raise NoGoldStructure(f"question {q.id!r} has no gold structure (a 'jsonl' dataset has "
                            "none): there are no experts for it; train from a checkpoint "
                            "without the warm start, or use musique / hotpotqa data.")
    for i, hop in enumerate(q.hops):
      # Every combination of the earlier hops' accepted answers (few: aliases are rare).
      for earlier in itertools.product(*(h.answers[:3] for h in q.hops[:i])):
        key = _key(fill(hop.question, earlier))
        out[key] = tuple(dict.fromkeys(out.get(key, ()) + hop.answers))
  return out


def _render(action: str, argument: str, thought: str, think: bool) -> str:
  return protocol.render_action(action, argument, think=thought if think else None)


def _failed(observation: str) -> bool:
  low = observation.lower()
  return normalize_answer(observation) in ("", experts.UNKNOWN) or any(p in low for p in _FAILURES)


@dataclasses.dataclass(frozen=True)
class QAMainExpert:
  """Delegates each hop in order, `#k` filled with hop k's result; answers with the last."""

  think: bool = True

  def turn(self, question: QAQuestion, observations: Sequence[str], rng: Any) -> str:
    """The next main-agent turn, given the sub-agent results so far (one per delegation)."""
    del rng  # Noise-free: a slip would be a guess about real text.
    if not question.hops:
      raise NoGoldStructure(f"question {question.id!r} has no gold structure for the experts")
    results, n, think = [o.strip() for o in observations], len(question.hops), self.think
    if results and _failed(results[-1]):
      return _render("answer", experts.UNKNOWN, f"Hop {len(results)} of {n} found nothing.",
                     think)  # fmt: skip
    if len(results) >= n:
      answer = results[-1] if question.final == "last" else question.answer
      return _render("answer", answer, "Every hop is answered.", think)
    subtask = protocol.escape_specials(fill(question.hops[len(results)].question, results))
    return _render("delegate", subtask, f"Hop {len(results) + 1} of {n}.", think)


def _holds(page: str, answer: str) -> bool:
  """Whether `page` states `answer` (normalised, as whole words)."""
  norm = normalize_answer(answer)
  return bool(norm) and f" {norm} " in f" {normalize_answer(page)} "


@dataclasses.dataclass(frozen=True)
class QASubExpert:
  """Search the subtask, visit its hits in order, report the sub-answer a visited page states.

  Turn i is decided by i = len(observations): 0 searches, then one visit per hit (the first
  min(search_k, 5) of the search reply), and the result as soon as a visited page holds an
  accepted sub-answer, which is reported as written in the data.
  """

  oracle: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  search_k: int = 3
  think: bool = True

  def turn(self, subtask: str, observations: Sequence[str], rng: Any) -> str:
    del rng
    query, think = query_of(subtask), self.think
    if not observations:
      return _render("search", query or subtask, "Search the subtask.", think)
    answers = self.oracle.get(_key(subtask), ())
    hits = experts.parse_hits(observations[0])[:min(self.search_k, MAX_VISITS)]
    visits = observations[1:]
    if visits:
      page = experts.parse_visit(visits[-1])
      text = "" if page is None else f"{page[1]}\n{page[2]}"
      found = next((a for a in answers if _holds(text, a)), None)
      if found is not None:
        return _render("result", found, f"{page[1]} states it.", think)
    if len(visits) < len(hits):
      doc, title = hits[len(visits)]
      return _render("visit", doc, f"Read {title}.", think)
    return _render("result", experts.UNKNOWN, f"Found nothing for {query}.", think)


def _episode(expert, role: str, task, tools, max_turns: int) -> tuple[list, list, list, Any]:
  """One episode of an expert calling `tools` itself: (turns, actions, replies, validator)."""
  validator = EpisodeValidator(role, max_turns)
  turns, actions, replies = [], [], []
  while not validator.done:
    text = expert.turn(task, replies, None)
    turns.append(text)
    turn = validator.step(text)
    actions.append(turn.action)
    if not validator.done:
      tool = tools.get(turn.action)
      replies.append(tool(turn.argument) if tool else f"Error: no {turn.action} tool here.")
  return turns, actions, replies, validator


def solve_qa(question: QAQuestion, index: search_lib.Retriever, known: Mapping, *,
             search_k: int = 3, max_chars: int = 2000, max_turns: int = 20,
             think: bool = True) -> dict[str, Any]:  # fmt: skip
  """Runs both experts on `question` through `search.local_tools(index)`, in plain Python.

  Returns `answer` (None unless the main episode is format-valid), `em`, `f1`, `recall`
  (per hop: did a search show its supporting paragraph), `subtasks` and `sub_results`.
  """
  tools = search_lib.local_tools(index, k=search_k, max_chars=max_chars)
  main, sub = QAMainExpert(think), QASubExpert(known, search_k, think)
  validator = EpisodeValidator("main", max_turns)
  results, subtasks, shown = [], [], []
  while not validator.done:
    turn = validator.step(main.turn(question, results, random.Random(0)))
    if validator.done:
      break
    _, actions, replies, v = _episode(sub, "sub", turn.argument, tools, max_turns)
    subtasks.append(turn.argument)
    results.append(v.final.argument if v.format_ok else experts.NO_RESULT)
    shown += qa.hit_ids(r for a, r in zip(actions, replies) if a == "search")
  answer = validator.final.argument if validator.format_ok else None
  em, f1 = qa.scores(answer, question)
  return {"answer": answer, "em": em, "f1": f1, "subtasks": subtasks, "sub_results": results,
          "recall": qa.hop_recall(question, shown, index)}
