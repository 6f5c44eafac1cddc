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

import hashlib
import itertools
import random
from typing import Sequence

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


def comparison_questions(world: world_lib.World, hops: int, num: int,
                         rng: random.Random) -> list[world_lib.Question]:
  """`num` distinct comparisons needing `hops` pages (2 or 4), spread over the templates.

  "same" questions alternate yes and no while the world has both (pairs with equal values
  are rare, so a large `num` takes more no than yes); the order of the two
  names is random, so the answer is not always the first.
  """
  specs = [s for s in COMPARISONS if 2 * len(s[1]) == hops]
  if not specs or num == 0:
    if num:
      raise ValueError(f"no comparison needs {hops} pages; comparisons need 2 or 4")
    return []
  pools = []
  for spec in specs:
    of_kind = [e for e in world.entities if e.kind == spec[0]]
    found = [q for a, b in itertools.combinations(of_kind, 2)
             if (q := _comparison(world, spec, *((a, b) if rng.random() < 0.5 else (b, a))))]
    if spec[2] == "same":  # Balance: equal values are rare between random entities.
      yes, no = [q for q in found if q.answer == YES], [q for q in found if q.answer == NO]
      rng.shuffle(yes)
      rng.shuffle(no)
      # Alternating yes and no while both last, then the rest of the larger side.
      found = [q for pair in itertools.zip_longest(yes, no) for q in pair if q]
    else:
      rng.shuffle(found)
    pools.append(found)
  counts = world_lib.allocate(num, [1.0] * len(pools))
  out = []
  for pool, count in zip(pools, counts):
    if count > len(pool):
      raise ValueError(f"asked for {count} comparisons of one kind; the world has {len(pool)}")
    out += pool[:count]
  return out


def _leaks(world: world_lib.World, q: world_lib.Question) -> bool:
  """True when the answer is written on the first page the question needs (a shortcut)."""
  return q.answer.lower() in world.document(q.hops[0].doc_id).text.lower()


def make_questions(world: world_lib.World, *, num: int,
                   hop_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
                   compare_fraction: float = 0.5, seed: int = 0) -> list[world_lib.Question]:
  """`num` distinct questions; `hop_weights[i]` weighs questions needing i + 1 pages.

  At 2 and 4 pages, `compare_fraction` of the level's questions are comparisons (rounded),
  the rest bridge chains; at 1 and 3 all are chains. A bridge question whose answer is
  written on its first page (a common year or country that page happens to mention) is
  skipped: answering it must need the later pages.
  """
  if not 0.0 <= compare_fraction <= 1.0:
    raise ValueError(f"compare_fraction must be in [0, 1], got {compare_fraction}")
  rng = random.Random(seed)
  questions = []
  for level, count in enumerate(world_lib.allocate(num, hop_weights), start=1):
    n_compare = round(count * compare_fraction) if level in (2, 4) else 0
    questions += comparison_questions(world, level, n_compare, rng)
    chains = world_lib.chain_questions(world, level) if count > n_compare else []
    if level > 1:
      chains = [q for q in chains if not _leaks(world, q)]
    if count - n_compare > len(chains):
      raise ValueError(f"asked for {count - n_compare} {level}-hop chains; the world has "
                       f"{len(chains)}")
    questions += rng.sample(chains, count - n_compare)
  rng.shuffle(questions)
  return questions
