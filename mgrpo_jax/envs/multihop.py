"""Multi-hop questions over long pages: the task where a sub-agent's own context matters.

The offline world (`envs.world`) with long documents (`WorldConfig.filler_sentences`) asked
two families of questions, each needing one page per hop:
- bridge: a chain of 1-4 links ("In which country is the birthplace of the founder of X?"),
  `world.chain_questions`;
- comparison: the same fact (or short chain) of two named entities, compared: "Which was
  founded earlier, X or Y?" (the answer is one of the two names, each the title of its own
  page) or "Were A and B born in the same country?" (yes or no). Their hops are those of the
  first entity's chain, then the second's (`Question.side_hops` of each); `compare` gives the
  answer from the two chains' last values.
A question's hop count is the number of pages it needs: 2 for a one-fact comparison, 4 for a
comparison of two-link chains. Everything is a pure function of the seeds.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import random
from typing import Callable, Sequence

from mgrpo_jax.envs import world as world_lib

# (kind of the two entities, attribute chain from each, operation, question template).
COMPARISONS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
  ("organisation", ("founded",), "earlier", "Which was founded earlier, {a} or {b}?"),
  ("person", ("birth_year",), "earlier", "Who was born earlier, {a} or {b}?"),
  ("work", ("year",), "earlier", "Which came out earlier, {a} or {b}?"),
  ("person", ("birthplace",), "same", "Were {a} and {b} born in the same place?"),
  ("organisation", ("headquarters",), "same",
   "Are {a} and {b} headquartered in the same place?"),
  ("organisation", ("founder", "birth_year"), "earlier",
   "Whose founder was born earlier, {a} or {b}?"),
  ("person", ("employer", "founded"), "earlier", "Whose employer was founded earlier, {a} or {b}?"),
  ("person", ("birthplace", "country"), "same", "Were {a} and {b} born in the same country?"),
  ("organisation", ("headquarters", "country"), "same",
   "Are {a} and {b} headquartered in the same country?"),
)
YES, NO = "yes", "no"


def compare(op: str, value_a: str, value_b: str, name_a: str, name_b: str) -> str | None:
  """The answer of a comparison from its two chains' last values; None if they do not compare.

  "earlier": the name whose year is smaller (None for a tie or a value that is not a year);
  "same": "yes" when the values are equal ignoring case and surrounding space, else "no".
  """
  if op == "same":
    return YES if value_a.strip().lower() == value_b.strip().lower() else NO
  if op != "earlier":
    raise ValueError(f"unknown comparison {op!r}; expected 'earlier' or 'same'")
  a, b = value_a.strip(), value_b.strip()
  if not (a.isdigit() and b.isdigit()) or int(a) == int(b):
    return None
  return name_a if int(a) < int(b) else name_b


def _side(world: world_lib.World, entity: world_lib.Entity,
          attrs: Sequence[str]) -> tuple[world_lib.Hop, ...]:
  """The hops that read `attrs` along links from `entity`."""
  hops = []
  for attr in attrs:
    hops.append(world_lib.one_hop(entity, attr))
    if attr in world_lib.LINKS:
      entity = world.entity(entity.attributes[attr])
  return tuple(hops)


def _comparison(world, spec, a: world_lib.Entity, b: world_lib.Entity) -> world_lib.Question | None:
  """The question of `spec` about (a, b); None when its answer would not be well defined."""
  _, attrs, op, template = spec
  hops_a, hops_b = _side(world, a, attrs), _side(world, b, attrs)
  answer = compare(op, hops_a[-1].answer, hops_b[-1].answer, a.name, b.name)
  if answer is None:
    return None
  text = template.format(a=a.name, b=b.name)
  hops = hops_a + hops_b
  qid = "q" + hashlib.sha1(text.encode()).hexdigest()[:10]
  return world_lib.Question(qid, text, answer, hops, tuple(h.doc_id for h in hops),
                            world_lib.DIFFICULTY.get(len(hops), "hard"), compare=op,
                            side_hops=len(attrs))


def _pairs(world, spec, rng: random.Random) -> list[tuple[world_lib.Entity, world_lib.Entity]]:
  """Pairs of entities of `spec`'s kind in random order and orientation, comparable under it.

  "same": pairs with equal values alternate with unequal ones while both last (equal values
  are rare between random entities), then the rest of the larger side follows.
  """
  kind, attrs, op, _ = spec
  of_kind = [e for e in world.entities if e.kind == kind]
  value = [_side(world, e, attrs)[-1].answer for e in of_kind]
  pairs = list(itertools.combinations(range(len(of_kind)), 2))
  rng.shuffle(pairs)
  if op == "same":
    yes = [p for p in pairs if value[p[0]] == value[p[1]]]
    no = [p for p in pairs if value[p[0]] != value[p[1]]]
    pairs = [p for both in itertools.zip_longest(yes, no) for p in both if p]
  else:  # "earlier" needs two different years.
    pairs = [p for p in pairs if value[p[0]] != value[p[1]]]
  # Both entities of one part of the world (`WorldConfig.holdout`): a held-out comparison
  # needs no training page. With one part this keeps every pair, in the same order.
  pairs = [p for p in pairs if of_kind[p[0]].part == of_kind[p[1]].part]
  return [(of_kind[i], of_kind[j]) if rng.random() < 0.5 else (of_kind[j], of_kind[i])
          for i, j in pairs]


def comparison_questions(world: world_lib.World, hops: int, num: int,
                         rng: random.Random) -> list[world_lib.Question]:
  """`num` distinct comparisons needing `hops` pages (2 or 4), spread over the templates.

  The order of the two names is random, so the answer is not always the first; "same"
  questions are half yes while the world has enough equal pairs (`_pairs`).
  """
  specs = [s for s in COMPARISONS if 2 * len(s[1]) == hops]
  if num == 0:
    return []
  if not specs:
    raise ValueError(f"no comparison needs {hops} pages; comparisons need 2 or 4")
  out = []
  for spec, count in zip(specs, world_lib.allocate(num, [1.0] * len(specs))):
    pairs = _pairs(world, spec, rng)
    if count > len(pairs):
      raise ValueError(f"asked for {count} comparisons {spec[3]!r}; the world has {len(pairs)}")
    out += [_comparison(world, spec, a, b) for a, b in pairs[:count]]
  return out


def leaks(world: world_lib.World, q: world_lib.Question) -> bool:
  """True when a bridge answer is written on a page of its chain before the last (a shortcut:
  a common year or country that an earlier page happens to mention). Every such page counts,
  not only the first; the last page is the one that states the answer."""
  answer = q.answer.lower()
  return any(answer in world.document(h.doc_id).text.lower() for h in q.hops[:-1])


def answer_space(world: world_lib.World, attribute: str) -> int:
  """How many distinct values `attribute` takes over the world's entities."""
  return len({e.attributes[attribute] for e in world.entities if attribute in e.attributes})


def make_questions(world: world_lib.World, *, num: int,
                   hop_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
                   compare_fraction: float = 0.5, seed: int = 0,
                   min_answer_space: int = 0) -> list[world_lib.Question]:
  """`num` distinct questions; `hop_weights[i]` weighs questions needing i + 1 pages.

  At 2 and 4 pages, `compare_fraction` of the level's questions are comparisons (rounded),
  the rest bridge chains; at 1 and 3 all are chains. A bridge question whose answer is
  written on a page of its chain before the last (`leaks`) is skipped: answering it must
  need every page. A bridge question asking for an attribute with fewer than
  `min_answer_space` distinct values in the world (a settlement size, a medium) is skipped
  too: its answer could be guessed without reading (`no_tool_guesser`).
  """
  if not 0.0 <= compare_fraction <= 1.0:
    raise ValueError(f"compare_fraction must be in [0, 1], got {compare_fraction}")
  rng = random.Random(seed)
  questions = []
  for level, count in enumerate(world_lib.allocate(num, hop_weights), start=1):
    n_compare = round(count * compare_fraction) if level in (2, 4) else 0
    questions += comparison_questions(world, level, n_compare, rng)
    chains = world_lib.chain_questions(world, level) if count > n_compare else []
    rng.shuffle(chains)
    chains = [q for q in chains if not leaks(world, q)
              and answer_space(world, q.hops[-1].attribute) >= min_answer_space]
    chains = chains[: count - n_compare]
    if count - n_compare > len(chains):
      raise ValueError(f"asked for {count - n_compare} {level}-hop chains; the world has "
                       f"{len(chains)} whose answer is on no earlier page and has at least "
                       f"{min_answer_space} possible values")
    questions += chains
  rng.shuffle(questions)
  return questions


def template(q: world_lib.Question) -> str:
  """The question's wording without its entity names ("Who founded {}?"): its template."""
  text = q.text
  names = [q.hops[0].entity] + ([q.hops[q.side_hops].entity] if q.compare else [])
  for name in names:
    text = text.replace(name, "{}")
  return text


def no_tool_guesser(train: Sequence[world_lib.Question]) -> Callable[[world_lib.Question], str]:
  """A guesser that never reads a page: the bar a trained agent must clear.

  "same" comparisons: "no"; "earlier" comparisons: the first-named entity; a bridge question:
  the most common training answer among training questions of the same template and final
  attribute, else of the same final attribute, else "" (ties: the answer seen first).
  """
  by_key: dict[tuple[str, str], collections.Counter] = {}
  by_attr: dict[str, collections.Counter] = {}
  for q in train:
    if q.compare or not q.hops:
      continue
    attr = q.hops[-1].attribute
    by_key.setdefault((template(q), attr), collections.Counter())[q.answer] += 1
    by_attr.setdefault(attr, collections.Counter())[q.answer] += 1

  def guess(q: world_lib.Question) -> str:
    if q.compare == "same":
      return NO
    if q.compare == "earlier":
      return q.hops[0].entity
    counts = by_key.get((template(q), q.hops[-1].attribute)) or by_attr.get(q.hops[-1].attribute)
    # Counter.most_common keeps insertion order among equal counts: the first seen wins.
    return counts.most_common(1)[0][0] if counts else ""

  return guess
