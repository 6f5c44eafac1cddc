"""Scripted experts for every role: text-level policies that act through the real tools.

`MainExpert` plans a world question from its hop chain (the decomposition, never the
answers), delegates one one-hop subquestion per hop and answers with the last sub-agent
result; a later hop names whatever the previous result said, so a wrong sub-agent makes a
wrong main agent, as with a real one. A comparison (`envs.multihop`) is two chains, each
started from its named entity, and its answer compares their last results. `SubExpert`
parses its subquestion, searches for the entity, visits the hit titled with that name and
reads the answer out of the document text with the world's fact-sentence patterns.
`SingleExpert`, the single-agent baseline (algorithm.md 1.7), does both jobs itself: it walks
the hop chain (or both chains) with search, visit and the sub-agent's reading, and answers. All are stateless: every call gets the task and the tool
replies seen so far, and returns the next turn's text (`protocol.render_action`), so an
engine can interleave many episodes. With `noise` > 0 each decision is, with that
probability, a plausible mistake in a still valid turn. `solve` runs main and sub on one
question in plain Python, `solve_single` the single agent, for tests, SFT data previews and docs.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Sequence

import numpy as np

from mgrpo_jax.agents import protocol
from mgrpo_jax.agents.validator import EpisodeValidator
from mgrpo_jax.envs import multihop
from mgrpo_jax.envs import search as search_lib
from mgrpo_jax.envs import world as world_lib
from mgrpo_jax.rl.rewards import exact_match, normalize_answer

__all__ = [
  "ENTITY_SLOT", "NO_RESULT", "UNKNOWN", "MainExpert", "SingleExpert", "SubExpert",
  "extract_facts", "fill_template", "hop_template", "parse_hits", "parse_subquestion",
  "parse_visit", "solve", "solve_single",
]

ENTITY_SLOT = "{entity}"  # where `hop_template` leaves the entity out; no question has braces
UNKNOWN = "unknown"  # what an expert reports when it cannot find an answer
# What the driver gives the main agent when a sub episode ends without a valid result (the
# rollout engine sends its own text; `_failed` recognises both by their wording).
NO_RESULT = "The sub-agent returned no valid result."
_FAILURE_PHRASES = ("no valid result", "limit reached", "error:")

Rng = random.Random | np.random.Generator

# ----------------------------------------------------------------------------- text patterns

# The world's templates are the single source of truth: patterns are built from them, so a
# template added to world.py is parsed here too (tests iterate every attribute).
_MAKES = sorted({m[1] for m in world_lib.MEDIA.values()})  # wrote, recorded, directed
_ISSUES = sorted({m[3] for m in world_lib.MEDIA.values()})  # published, released, ...
_MEDIA = sorted(world_lib.MEDIA)
_SLOTS = {
  "made": "(?:" + "|".join(_MAKES) + ")", "issued": "(?:" + "|".join(_ISSUES) + ")",
  "a_medium": "(?:a|an) (?:" + "|".join(_MEDIA) + ")",
  "name": "(?P<name>.+?)", "np": "(?P<name>.+?)",
  "value": "(?P<value>.+?)", "a_value": "(?:a|an) (?P<value>.+?)",
}  # fmt: skip
_FIELD = re.compile(r"\{(\w+)\}")


def _compile(template: str) -> tuple[re.Pattern, int]:
  """A template as a full-match regex, and its specificity (count of literal characters)."""
  parts, literal, start = [], 0, 0
  for m in _FIELD.finditer(template):
    parts += [re.escape(template[start : m.start()]), _SLOTS[m.group(1)]]
    literal += m.start() - start
    start = m.end()
  parts.append(re.escape(template[start:]))
  literal += len(template) - start
  return re.compile("".join(parts)), literal


_QUESTIONS = [(attr, _compile(t)[0]) for attr, t in world_lib.ASK.items()]
_FACT_PATTERNS = [(attr, *_compile(t)) for attr, ts in world_lib.FACTS.items() for t in ts]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_HIT_LINE = re.compile(r"\[(?P<doc_id>[^\]\s]+)\] (?P<title>.+?): ")
_VISIT_HEAD = re.compile(r"\[(?P<doc_id>[^\]\s]+)\] (?P<title>[^\n]+)\n(?P<text>.*)", re.S)


def hop_template(hop: world_lib.Hop) -> tuple[str, str]:
  """(template, entity): `hop.question` with its entity replaced by `ENTITY_SLOT`.

  Raises ValueError unless the entity occurs exactly once in the question.
  """
  if hop.question.count(hop.entity) != 1:
    raise ValueError(f"entity {hop.entity!r} is not named once in {hop.question!r}")
  return hop.question.replace(hop.entity, ENTITY_SLOT), hop.entity


def fill_template(template: str, entity: str) -> str:
  """The subquestion `template` asks about `entity` (str.replace: names may hold braces)."""
  return template.replace(ENTITY_SLOT, entity)


def parse_subquestion(text: str) -> tuple[str, str] | None:
  """(entity, attribute) of a one-hop question in the world's wording, else None."""
  text = " ".join(text.split())
  for attr, pattern in _QUESTIONS:
    m = pattern.fullmatch(text)
    if m and m.group("name").strip():
      return m.group("name").strip(), attr
  return None


def parse_hits(text: str) -> list[tuple[str, str]]:
  """(doc_id, title) of each "[doc_id] Title: snippet" line of a search reply, in order."""
  return [(m.group("doc_id"), m.group("title")) for m in map(_HIT_LINE.match, text.splitlines())
          if m]  # fmt: skip


def parse_visit(text: str) -> tuple[str, str, str] | None:
  """(doc_id, title, text) of a visit reply ("[doc_id] Title" line, then the text), else None."""
  m = _VISIT_HEAD.match(text.strip())
  return None if m is None else (m.group("doc_id"), m.group("title").strip(), m.group("text"))


def extract_facts(text: str, name: str) -> list[tuple[str, str, str]]:
  """(attribute, value, sentence) for every fact sentence about `name` in `text`, in order.

  A sentence several templates match ("X was born in the year 1900" also fits "X was born in
  {value}") counts for the most specific one, the template with the most literal text.
  """
  facts = []
  for sentence in _SENTENCE_END.split(text.strip()):
    best = None
    for attr, pattern, specificity in _FACT_PATTERNS:
      m = pattern.fullmatch(sentence)
      if m and m.group("name") == name and (best is None or specificity > best[0]):
        best = (specificity, attr, m.group("value"))
    if best is not None:
      facts.append((best[1], best[2], sentence))
  return facts


# ------------------------------------------------------------------------------------- noise


def _uniform(rng: Rng) -> float:
  return float(rng.random())


def _pick(rng: Rng, items: Sequence[Any]) -> Any:
  if isinstance(rng, np.random.Generator):
    return items[int(rng.integers(len(items)))]
  return items[rng.randrange(len(items))]


def _slip(noise: float, rng: Rng) -> bool:
  """True with probability `noise`; draws nothing when noise is 0, so such runs ignore `rng`."""
  return noise > 0 and _uniform(rng) < noise


def _words(attribute: str) -> str:
  return attribute.replace("_", " ")


def _render(action: str, argument: str, thought: str, think: bool) -> str:
  return protocol.render_action(action, argument, think=thought if think else None)


def _choose_hit(entity: str, reply: str, search_k: int, noise: float, rng: Rng) -> str | None:
  """The doc id to visit for `entity`, from a search reply; None when no hit has its title.

  That is the hit titled with the entity or, as a slip (probability `noise`), another of the
  top `search_k` hits.
  """
  hits = parse_hits(reply)[:search_k]
  own = next((doc for doc, title in hits if title.strip().lower() == entity.lower()), None)
  if own is None:
    return None
  others = [doc for doc, _ in hits if doc != own]
  return _pick(rng, others) if others and _slip(noise, rng) else own


def _read_fact(entity: str, attr: str, reply: str, noise: float,
               rng: Rng) -> tuple[str | None, str]:
  """(value, the sentence stating it) of `attr` in a visit reply; (None, why not) if absent.

  The value is that of the page's own subject. A slip (probability `noise`) reads another
  fact's value, preferring one of the same type (a name for a link).
  """
  page = parse_visit(reply)
  if page is None:
    return None, f"Could not read a page about {entity}."
  _, title, text = page
  # Facts about the page's own subject: on a wrong page they give a wrong answer of the
  # right type, the mistake a careless reader makes.
  facts = extract_facts(text, title)
  right = [(v, s) for a, v, s in facts if a == attr]
  if not right:
    return None, f"No {_words(attr)} of {title} here."
  wrong = [(a in world_lib.LINKS, v, s) for a, v, s in facts if a != attr]
  same = [(v, s) for link, v, s in wrong if link == (attr in world_lib.LINKS)]
  pool = same or [(v, s) for _, v, s in wrong]
  return _pick(rng, pool) if pool and _slip(noise, rng) else right[0]


def _failed(observation: str) -> bool:
  """True when a delegation brought back no usable result."""
  low = observation.lower()
  return normalize_answer(observation) in ("", UNKNOWN) or any(p in low for p in _FAILURE_PHRASES)


# --------------------------------------------------------------------------------- experts


def _step_entity(question: world_lib.Question, step: int, values: Sequence[str]) -> str:
  """Whom hop `step` asks about: a named entity where a chain starts, else the last value.

  A chain starts at hop 0 and, in a comparison, at hop `side_hops` (the second entity).
  """
  if step == 0 or (question.compare and step == question.side_hops):
    return question.hops[step].entity
  return values[step - 1]


def _final(question: world_lib.Question | str, values: Sequence[str]) -> str:
  """The answer from every hop's value: the last one, or a comparison of the two chains'."""
  if isinstance(question, str) or not question.compare:
    return values[-1]
  side = question.side_hops
  answer = multihop.compare(question.compare, values[side - 1], values[-1],
                            question.hops[0].entity, question.hops[side].entity)
  return UNKNOWN if answer is None else answer


@dataclasses.dataclass(frozen=True)
class MainExpert:
  """Delegates one subquestion per hop, then answers with the last result (see module doc).

  `retries` re-delegations of a hop whose result failed, before answering `UNKNOWN`.
  Mistakes (probability `noise` per turn): answer early with the latest result, or delegate
  a vague subtask that names the entity but not the attribute.
  """

  noise: float = 0.0
  think: bool = True
  retries: int = 1

  def turn(self, question: world_lib.Question | str, observations: Sequence[str], rng: Rng) -> str:
    """The next main-agent turn, given the sub-agent results so far (one per delegation)."""
    text = question if isinstance(question, str) else question.text
    hops = () if isinstance(question, str) else question.hops
    # Without a chain (a benchmark question) the plan is one delegation of the whole question.
    plan = [hop_template(h) for h in hops] or [(ENTITY_SLOT, text)]
    n = len(plan)
    results, fails = [], 0
    for obs in observations:
      if _failed(obs):
        fails += 1
      else:
        results.append(obs.strip())
        fails = 0
    step, think = len(results), self.think
    if observations and "limit reached" in observations[-1].lower():
      # The engine refuses further delegations (rollout.Limits.max_delegations).
      return _render("answer", results[-1] if results else UNKNOWN, "No delegations left.", think)
    if fails > self.retries:
      return _render("answer", UNKNOWN, f"Step {step + 1} of {n} failed; giving up.", think)
    if step >= n:
      return _render("answer", _final(question, results), "All steps done.", think)
    entity = _step_entity(question, step, results) if hops else plan[0][1]
    attr = hops[step].attribute if hops else None
    if _slip(self.noise, rng):
      if step and _uniform(rng) < 0.5:  # early answers need a result to answer with
        return _render("answer", results[-1], f"Step {step} of {n} is enough.", think)
      return _render("delegate", f"Find out about {entity}.", f"Step {step + 1} of {n}: {entity}.",
                     think)  # fmt: skip
    goal = f"{_words(attr)} of {entity}" if attr else "the whole question"
    retry = "retry " if fails else ""
    return _render("delegate", fill_template(plan[step][0], entity),
                   f"Step {step + 1} of {n}: {retry}{goal}.", think)


@dataclasses.dataclass(frozen=True)
class SubExpert:
  """Search the entity, visit its own document, report the value stated there (module doc).

  Turn i is decided by i = len(observations): 0 search, 1 visit, 2 result. Mistakes
  (probability `noise` per decision): visit another hit; report another fact's value.
  `search_k` is the k the expert assumes the search tool uses (hits beyond it are ignored).
  """

  noise: float = 0.0
  think: bool = True
  search_k: int = 3

  def turn(self, subtask: str, observations: Sequence[str], rng: Rng) -> str:
    """The next sub-agent turn, given the tool replies so far (search, then visit)."""
    parsed = parse_subquestion(subtask)
    if parsed is None:
      return _render("result", UNKNOWN, "Not a question I can look up.", self.think)
    entity, attr = parsed
    if not observations:
      return _render("search", entity, f"Find the {_words(attr)} of {entity}.", self.think)
    if len(observations) == 1:
      return self._visit(entity, observations[0], rng)
    return self._report(entity, attr, observations[-1], rng)

  def _visit(self, entity: str, reply: str, rng: Rng) -> str:
    doc = _choose_hit(entity, reply, self.search_k, self.noise, rng)
    if doc is None:
      return _render("result", UNKNOWN, f"No document about {entity}.", self.think)
    return _render("visit", doc, f"{entity}: {doc}.", self.think)

  def _report(self, entity: str, attr: str, reply: str, rng: Rng) -> str:
    value, sentence = _read_fact(entity, attr, reply, self.noise, rng)
    return _render("result", UNKNOWN if value is None else value, sentence, self.think)


def _chain(question: world_lib.Question | str) -> tuple[str, list[tuple[str, str]]] | None:
  """(first entity, [(subquestion template, attribute) per hop]) of a question, else None.

  A question without a chain (plain text) is one hop when it is in the world's wording.
  """
  if not isinstance(question, str) and question.hops:
    return question.hops[0].entity, [(hop_template(h)[0], h.attribute) for h in question.hops]
  text = " ".join((question if isinstance(question, str) else question.text).split())
  parsed = parse_subquestion(text)
  if parsed is None:
    return None
  entity, attr = parsed
  return entity, [(text.replace(entity, ENTITY_SLOT, 1), attr)]


@dataclasses.dataclass(frozen=True)
class SingleExpert:
  """One agent with every tool (algorithm.md 1.7): per hop a search, a visit, a read; then answer.

  For each hop of the chain it searches the hop's entity, visits the hit titled with it and
  reads the hop's attribute off the page as `SubExpert` does; the value read is the next
  hop's entity, and the last one is the answer. Turn i is decided by i = len(observations):
  hop i // 2, a search when i is even, a visit when it is odd. Values of hops already done
  are read again from their pages, never remembered. Mistakes (probability `noise` per
  decision): visit another hit; answer early with the value just read; at the last hop, read
  another fact's value. Only the decision being made draws from `rng`, so rereading a page
  gives the value the episode went on with. Fails softly: a missing hit, page or fact, or a
  question it cannot parse, is answered `UNKNOWN`.
  """

  noise: float = 0.0
  think: bool = True
  search_k: int = 3

  def turn(self, question: world_lib.Question | str, observations: Sequence[str], rng: Rng) -> str:
    """The next turn, given the tool replies so far (a search and a visit reply per hop)."""
    chain, think = _chain(question), self.think
    if chain is None:
      return _render("answer", UNKNOWN, "Not a question I can look up.", think)
    entity, steps = chain
    n = len(steps)
    hop, searched = divmod(len(observations), 2)
    has_hops = not isinstance(question, str) and bool(question.hops)
    values = []
    for j in range(min(hop, n)):
      if has_hops:
        entity = _step_entity(question, j, values)
      fresh = j == hop - 1 and not searched  # this turn is the first to read page j
      last = j == n - 1
      value, sentence = _read_fact(entity, steps[j][1], observations[2 * j + 1],
                                   self.noise if fresh and last else 0.0, rng)
      if value is None:
        return _render("answer", UNKNOWN, sentence, think)
      values.append(value)
      if last or (fresh and _slip(self.noise, rng)):
        thought = sentence if last else f"Step {j + 1} of {n} is enough."
        return _render("answer", _final(question, values) if last else value, thought, think)
      entity = value
    if has_hops and hop < n:
      entity = _step_entity(question, hop, values)
    if not searched:
      goal = fill_template(steps[hop][0], entity)
      return _render("search", entity, f"Step {hop + 1} of {n}: {goal}", think)
    doc = _choose_hit(entity, observations[-1], self.search_k, self.noise, rng)
    if doc is None:
      return _render("answer", UNKNOWN, f"No document about {entity}.", think)
    return _render("visit", doc, f"{entity}: {doc}.", think)


# ------------------------------------------------------------------------------------ driver


def _run_tools(expert, role: str, task, tools, rng: Rng, max_turns: int):
  """One episode of an expert that calls `tools` itself: (turns, tool replies, validator)."""
  validator = EpisodeValidator(role, max_turns)
  turns, replies = [], []
  while not validator.done:
    text = expert.turn(task, replies, rng)
    turns.append(text)
    turn = validator.step(text)
    if not validator.done:
      tool = tools.get(turn.action)
      replies.append(tool(turn.argument) if tool else f"Error: no {turn.action} tool here.")
  return turns, replies, validator


def solve(question: world_lib.Question, index: search_lib.Retriever, *, main_noise: float = 0.0,
          sub_noise: float = 0.0, rng: Rng | None = None, think: bool = True,
          max_turns: int = 20, search_k: int = 3, max_chars: int = 800) -> dict[str, Any]:
  """Runs `MainExpert` and `SubExpert` on `question` through `local_tools(index)`.

  Follows the protocol as the rollout engine does, in text: each main turn that delegates
  runs a whole sub episode, whose result (or `NO_RESULT`) is the main agent's next
  observation. `max_turns` limits each agent episode. Returns a dict with `answer` (None
  unless the main episode is format-valid), `correct`, `main_turns`, `observations` (the main
  agent's tool replies), `main_format_ok`, and per delegation `subtasks`, `sub_episodes`
  (turn texts), `sub_observations` (tool replies) and `sub_format_ok`.
  """
  rng = random.Random(0) if rng is None else rng
  tools = search_lib.local_tools(index, k=search_k, max_chars=max_chars)
  main = MainExpert(main_noise, think)
  sub = SubExpert(sub_noise, think, search_k)
  validator = EpisodeValidator("main", max_turns)
  out = {"main_turns": [], "observations": [], "subtasks": [], "sub_episodes": [],
         "sub_observations": [], "sub_format_ok": []}  # fmt: skip
  while not validator.done:
    text = main.turn(question, out["observations"], rng)
    out["main_turns"].append(text)
    turn = validator.step(text)
    if validator.done:
      break
    turns, replies, sub_validator = _run_tools(sub, "sub", turn.argument, tools, rng, max_turns)
    out["subtasks"].append(turn.argument)
    out["sub_episodes"].append(turns)
    out["sub_observations"].append(replies)
    out["sub_format_ok"].append(sub_validator.format_ok)
    out["observations"].append(sub_validator.final.argument if sub_validator.format_ok
                               else NO_RESULT)  # fmt: skip
  answer = validator.final.argument if validator.format_ok else None
  out.update(answer=answer, main_format_ok=validator.format_ok,
             correct=answer is not None and exact_match(answer, question.answer))
  return out


def solve_single(question: world_lib.Question, index: search_lib.Retriever, *,
                 noise: float = 0.0, rng: Rng | None = None, think: bool = True,
                 max_turns: int = 20, search_k: int = 3, max_chars: int = 800) -> dict[str, Any]:
  """Runs `SingleExpert` on `question` through `local_tools(index)`, as the rollout engine does.

  Returns a dict with `answer` (None unless the episode is format-valid), `correct`,
  `turns` (turn texts), `observations` (tool replies) and `format_ok`.
  """
  rng = random.Random(0) if rng is None else rng
  tools = search_lib.local_tools(index, k=search_k, max_chars=max_chars)
  expert = SingleExpert(noise, think, search_k)
  turns, replies, validator = _run_tools(expert, "single", question, tools, rng, max_turns)
  answer = validator.final.argument if validator.format_ok else None
  return {"answer": answer, "correct": answer is not None and exact_match(answer, question.answer),
          "turns": turns, "observations": replies, "format_ok": validator.format_ok}
