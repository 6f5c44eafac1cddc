"""An offline research world: invented entities, one prose document each, multi-hop questions.

The world stands in for the live web of GAIA / XBench-DeepSearch / WebWalkerQA, which this
project cannot reach. People, organisations, places and works carry attributes, some of which
link to other entities (an organisation's founder is a person). Every entity has one document
whose sentences state its attributes in shuffled order, mixed with distractor sentences naming
other entities, so a search for a name also returns documents that merely mention it. A
question follows a chain of 1-3 links ("In which country is the birthplace of the founder of
X?"); each hop's answer is written literally in that hop's document, so an agent can copy it.
A world may hold separate parts (`WorldConfig.holdout`: train, validation and test entities,
linked only inside their part), so held-out questions are whole chains of pages that no
training question reads (`split_by_part`). Everything is a pure function of the seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import re
from typing import Mapping, Sequence

# Attributes per kind, in the order documents list them before shuffling.
ATTRIBUTES: Mapping[str, tuple[str, ...]] = {
  "person": ("birth_year", "birthplace", "occupation", "employer"),
  "organisation": ("founded", "founder", "headquarters"),
  "place": ("country", "river", "population"),
  "work": ("medium", "year", "creator", "publisher"),
}
# Attributes whose value is another entity's name (and that entity's kind): the hops of a
# question follow these links. Every other attribute is a literal (a year or one word).
LINKS: Mapping[str, str] = {
  "birthplace": "place", "employer": "organisation", "founder": "person",
  "headquarters": "place", "creator": "person", "publisher": "organisation",
}  # fmt: skip
DIFFICULTY = {1: "easy", 2: "medium", 3: "hard"}

_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "st", "th", "tr", "vr")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ae", "ei", "ou")
_CODAS = ("", "", "l", "n", "r", "s", "th", "nd", "rk")
_OCCUPATIONS = ("painter", "chemist", "architect", "sailor", "botanist", "engineer", "composer",
                "surveyor", "physician", "weaver", "astronomer", "historian")  # fmt: skip
_ORG_SUFFIXES = ("Institute", "Press", "Records", "Pictures", "Society", "Company", "Guild")
_TITLE_NOUNS = ("Letters", "Tides", "Lanterns", "Harvest", "Echoes", "Winter", "Gardens",
                "Machines", "Orchard", "Voyage", "Silence", "Mirrors")  # fmt: skip
_POPULATIONS = ("village", "town", "city", "metropolis")
# medium -> (maker noun, verb of making, issuer noun, verb of issuing).
MEDIA = {
  "book": ("author", "wrote", "publisher", "published"),
  "album": ("performer", "recorded", "label", "released"),
  "film": ("director", "directed", "distributor", "distributed"),
}

# Sentence templates. Every fact template names the entity and holds the value verbatim.
FACTS: Mapping[str, tuple[str, ...]] = {
  "birth_year": ("{name} was born in the year {value}.",
                 "Records give {value} as the birth year of {name}."),
  "birthplace": ("{name} was born in {value}.", "The birthplace of {name} is {value}."),
  "occupation": ("{name} worked as {a_value}.", "By profession, {name} was {a_value}."),
  "employer": ("{name} was employed by {value}.", "For many years {name} worked for {value}."),
  "founded": ("{name} was founded in {value}.",
              "{name} has existed since {value}, the year of its founding."),
  "founder": ("{name} was founded by {value}.", "The founder of {name} was {value}."),
  "headquarters": ("{name} is headquartered in {value}.",
                   "The headquarters of {name} stand in {value}."),
  "country": ("{name} lies in the country of {value}.", "{name} is part of the country {value}."),
  "river": ("{name} lies on the river {value}.", "The river {value} flows through {name}."),
  "population": ("By population, {name} counts as {a_value}.", "In size, {name} is {a_value}."),
  "medium": ("{name} is {a_value}.", "{name} was made as {a_value}."),
  "year": ("{name} was first {issued} in {value}.",
           "The year {name} first came out was {value}."),
  "creator": ("{name} is {a_medium} by {value}.", "{value} {made} {name}."),
  "publisher": ("{name} was {issued} by {value}.", "{value} {issued} {name}."),
}  # fmt: skip
_DISTRACTORS = (
  "{name} is sometimes confused with {other}.",
  "A survey from {year} mentions {name} alongside {other}.",
  "In {year}, a newspaper compared {name} with {other}.",
  "Little is recorded about any link between {name} and {other}.",
  "Visitors who ask about {name} often ask about {other} as well.",
)
# Filler prose for long documents: never a fact about the page's subject (no `FACTS` pattern
# matches it), and no word of an organisation suffix or a title noun, which names contain.
FILLER = (
  "A catalogue compiled in {year} lists {other} among a long run of entries.",
  "Notes written in {year} mention {other} in passing, with little detail.",
  "A regional almanac of {year} has a short paragraph on {other}.",
  "An exhibition in {year} showed maps and papers connected with {other}.",
  "Travellers in {year} described {other} at some length in their diaries.",
  "A later survey returned to {other} in {year} and found much unchanged.",
)
# Questions: `ASK` asks for the final attribute of a noun phrase; `_NP` wraps a phrase in a link.
ASK: Mapping[str, str] = {
  "birth_year": "In what year was {np} born?", "birthplace": "Where was {np} born?",
  "occupation": "What was the occupation of {np}?", "employer": "Which organisation employed {np}?",
  "founded": "In what year was {np} founded?", "founder": "Who founded {np}?",
  "headquarters": "Where is {np} headquartered?", "country": "In which country is {np}?",
  "river": "On which river does {np} lie?", "population": "What size of settlement is {np}?",
  "medium": "What kind of work is {np}?", "year": "In what year was {np} first {issued}?",
  "creator": "Who {made} {np}?", "publisher": "Which organisation {issued} {np}?",
}  # fmt: skip
_NP: Mapping[str, str] = {
  "birthplace": "the birthplace of {np}", "employer": "the employer of {np}",
  "founder": "the founder of {np}", "headquarters": "the headquarters of {np}",
  "creator": "the {maker} of {np}", "publisher": "the {issuer} of {np}",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WorldConfig:
  """Size and difficulty of a generated world. The defaults make 60 entities."""

  seed: int = 0
  num_people: int = 24
  num_orgs: int = 12
  num_places: int = 12
  num_works: int = 12
  num_countries: int = 4  # countries and rivers are literal values, not entities
  num_rivers: int = 5
  distractors_per_doc: int = 2  # sentences naming other entities, mixed into each document
  name_similarity: float = 0.0  # chance a new name reuses the first syllable of an earlier one
  # (low, high): each document gets a number of filler sentences in this range, prose naming
  # other entities (`FILLER`), drawn from a stream of its own: (0, 0) leaves the world as it was.
  filler_sentences: tuple[int, int] = (0, 0)
  # (validation, test) fractions of each kind's entities held out as separate parts whose
  # links stay inside their part, so a chain never leaves its part (`split_by_part`): the
  # pages of a held-out question are in no training question's chain. (0, 0): one part.
  holdout: tuple[float, float] = (0.0, 0.0)


PARTS = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True)
class Entity:
  """One thing in the world; `attributes` maps name -> value text (linked values are names)."""

  name: str
  kind: str
  attributes: Mapping[str, str]
  doc_id: str
  part: str = "train"  # Which of `PARTS` the entity (and its page) belongs to.


@dataclasses.dataclass(frozen=True)
class Document:
  """One searchable page: the document of one entity (title = the entity's name)."""

  doc_id: str
  title: str
  text: str


@dataclasses.dataclass(frozen=True)
class Hop:
  """One step of a question's chain: `entity`'s `attribute` is `answer`, stated in `doc_id`.

  `question` asks for this step alone, naming the entity (what an expert would delegate).
  """

  entity: str
  attribute: str
  answer: str
  doc_id: str
  question: str


@dataclasses.dataclass(frozen=True)
class Question:
  """A question with its answer; world questions also carry the chain that answers them."""

  id: str
  text: str
  answer: str
  hops: tuple[Hop, ...] = ()
  gold_doc_ids: tuple[str, ...] = ()
  difficulty: str = ""
  source: str = "world"
  # Comparison questions (`envs.multihop`): "earlier" or "same" over two chains, the first
  # `side_hops` hops about the first named entity and the rest about the second; "" = a chain.
  compare: str = ""
  side_hops: int = 0
  aliases: tuple[str, ...] = ()  # Other accepted answers (real QA data's answer aliases).

  @property
  def answers(self) -> tuple[str, ...]:
    """Every accepted answer: `answer`, then its aliases."""
    return (self.answer, *self.aliases)


@dataclasses.dataclass(frozen=True)
class World:
  """Entities and their documents; `entity(name)` and `document(doc_id)` look them up."""

  config: WorldConfig
  entities: tuple[Entity, ...]
  documents: tuple[Document, ...]

  @functools.cached_property
  def _by_name(self) -> dict[str, Entity]:
    return {e.name: e for e in self.entities}

  @functools.cached_property
  def _by_doc(self) -> dict[str, Document]:
    return {d.doc_id: d for d in self.documents}

  @functools.cached_property
  def _by_doc_entity(self) -> dict[str, Entity]:
    return {e.doc_id: e for e in self.entities}

  def entity(self, name: str) -> Entity:
    return self._by_name[name]

  def entity_of_doc(self, doc_id: str) -> Entity:
    return self._by_doc_entity[doc_id]

  def document(self, doc_id: str) -> Document:
    return self._by_doc[doc_id]


class _Namer:
  """Invents unique pronounceable words: consonant-vowel syllables and an optional coda."""

  def __init__(self, rng: random.Random, similarity: float):
    self._rng, self._similarity = rng, similarity
    self._used: set[str] = set()
    self._firsts: list[str] = []  # first syllables of earlier words, reused for look-alikes

  def word(self, syllables: int = 2) -> str:
    rng = self._rng
    for _ in range(10_000):
      parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
      if self._firsts and rng.random() < self._similarity:
        parts[0] = rng.choice(self._firsts)
      word = ("".join(parts) + rng.choice(_CODAS)).capitalize()
      # Uniqueness is on the lower-cased word, because search tokens are lower-cased.
      if 5 <= len(word) <= 11 and word.lower() not in self._used:
        self._used.add(word.lower())
        self._firsts.append(parts[0])
        return word
    raise RuntimeError("ran out of unique names; lower the number of entities")


def _people(rng, namer, n, places):
  return [{"name": f"{namer.word(2)} {namer.word(rng.choice((2, 3)))}", "kind": "person",
           "birth_year": str(rng.randint(1800, 1950)), "birthplace": rng.choice(places)["name"],
           "occupation": rng.choice(_OCCUPATIONS)} for _ in range(n)]  # fmt: skip


def _orgs(rng, namer, n, people, places):
  # Distinct founders while there are enough people: more distinct chains to ask about.
  founders = rng.sample(people, n) if n <= len(people) else [rng.choice(people) for _ in range(n)]
  return [{"name": f"{namer.word(2)} {rng.choice(_ORG_SUFFIXES)}", "kind": "organisation",
           "founded": str(int(f["birth_year"]) + rng.randint(25, 60)), "founder": f["name"],
           "headquarters": rng.choice(places)["name"]} for f in founders]  # fmt: skip


def _works(rng, namer, n, people, orgs):
  works = []
  for _ in range(n):
    creator = rng.choice(people)
    works.append({"name": f"The {namer.word(2)} {rng.choice(_TITLE_NOUNS)}", "kind": "work",
                  "medium": rng.choice(tuple(MEDIA)), "creator": creator["name"],
                  "year": str(int(creator["birth_year"]) + rng.randint(20, 60)),
                  "publisher": rng.choice(orgs)["name"]})  # fmt: skip
  return works


def _article(word: str) -> str:
  return ("an " if word[0] in "aeiou" else "a ") + word


def _medium_words(medium: str) -> dict[str, str]:
  maker, made, issuer, issued = MEDIA[medium]
  return {"maker": maker, "made": made, "issuer": issuer, "issued": issued}


def _fact(rng: random.Random, record: dict, attr: str) -> str:
  value = record[attr]
  words = _medium_words(record["medium"]) if record["kind"] == "work" else {}
  medium = _article(record["medium"]) if record["kind"] == "work" else ""
  return rng.choice(FACTS[attr]).format(
    name=record["name"], value=value, a_value=_article(value), a_medium=medium, **words)


def _document(rng: random.Random, record: dict, doc_id: str, names: list[str], k: int) -> Document:
  """Fact sentences plus `k` distractors, shuffled; decoy years never equal a true year."""
  sentences = [_fact(rng, record, a) for a in ATTRIBUTES[record["kind"]]]
  own_years = {v for v in record.values() if v.isdigit()}
  others = [n for n in names if n != record["name"]]
  for _ in range(k if others else 0):
    year = str(rng.randint(1800, 2010))
    while year in own_years:
      year = str(rng.randint(1800, 2010))
    template = rng.choice(_DISTRACTORS)
    sentences.append(template.format(name=record["name"], other=rng.choice(others), year=year))
  rng.shuffle(sentences)
  return Document(doc_id, record["name"], " ".join(sentences))


def _lengthen(rng: random.Random, doc: Document, record: dict, names: list[str],
              count: tuple[int, int]) -> Document:
  """`doc` with filler sentences (`FILLER`, naming other entities) inserted at random places.

  Their years never equal one of the subject's own, so no year on a page is a false fact.
  """
  sentences = re.split(r"(?<=[.!?]) ", doc.text)
  own_years = {v for v in record.values() if v.isdigit()}
  others = [n for n in names if n != record["name"]]
  for _ in range(rng.randint(*count) if others else 0):
    year = str(rng.randint(1800, 2010))
    while year in own_years:
      year = str(rng.randint(1800, 2010))
    filler = rng.choice(FILLER).format(other=rng.choice(others), year=year)
    sentences.insert(rng.randint(0, len(sentences)), filler)
  return dataclasses.replace(doc, text=" ".join(sentences))


def _part_sizes(cfg: WorldConfig) -> dict[str, dict[str, int]]:
  """Entities per part and kind: `cfg.holdout` of each kind, rounded, to validation and test."""
  counts = {"place": cfg.num_places, "person": cfg.num_people, "organisation": cfg.num_orgs,
            "work": cfg.num_works}
  fractions = dict(zip(PARTS, (1.0 - sum(cfg.holdout),) + tuple(cfg.holdout)))
  sizes = {}
  for part, fraction in fractions.items():
    if part != "train" and fraction == 0:
      continue
    sizes[part] = {k: round(n * fraction) for k, n in counts.items()}
  held = {k: sum(sizes[p][k] for p in sizes if p != "train") for k in counts}
  sizes["train"] = {k: counts[k] - held[k] for k in counts}
  for part, n in sizes.items():
    if min(n["place"], n["person"], n["organisation"]) < 1:
      raise ValueError(f"holdout={cfg.holdout} leaves part {part!r} without a person, "
                       f"organisation or place: {n}")
  return sizes


def generate_world(cfg: WorldConfig = WorldConfig()) -> World:
  """Builds the world of `cfg`: same config, same entities and documents, byte for byte."""
  if min(cfg.num_people, cfg.num_orgs, cfg.num_places) < 1 or cfg.num_works < 0:
    raise ValueError(f"need at least one person, organisation and place: {cfg}")
  if min(cfg.num_countries, cfg.num_rivers) < 1 or cfg.distractors_per_doc < 0:
    raise ValueError(f"need a country and a river, and distractors >= 0: {cfg}")
  low, high = cfg.filler_sentences
  if not 0 <= low <= high:
    raise ValueError(f"filler_sentences must be (low, high) with 0 <= low <= high: {cfg}")
  if min(cfg.holdout) < 0 or sum(cfg.holdout) >= 1:
    raise ValueError(f"holdout must be two fractions >= 0 summing to < 1: {cfg}")
  sizes = _part_sizes(cfg)
  rng = random.Random(cfg.seed)
  namer = _Namer(rng, cfg.name_similarity)
  countries = [namer.word(2) + rng.choice(("ia", "land", "mark")) for _ in range(cfg.num_countries)]
  rivers = [namer.word(2) for _ in range(cfg.num_rivers)]
  # Each step runs part by part, links drawn inside the part; with one part (holdout (0, 0))
  # the draws are those of the world before parts existed, so old worlds stay byte-identical.
  places = {p: [{"name": namer.word(rng.choice((2, 3))), "kind": "place",
                 "country": rng.choice(countries), "river": rng.choice(rivers),
                 "population": rng.choice(_POPULATIONS)} for _ in range(n["place"])]
            for p, n in sizes.items()}  # fmt: skip
  people = {p: _people(rng, namer, n["person"], places[p]) for p, n in sizes.items()}
  orgs = {p: _orgs(rng, namer, n["organisation"], people[p], places[p])
          for p, n in sizes.items()}
  for p in sizes:
    for person in people[p]:  # employers exist only once the organisations do
      person["employer"] = rng.choice(orgs[p])["name"]
  works = {p: _works(rng, namer, n["work"], people[p], orgs[p]) for p, n in sizes.items()}
  records, parts = [], []
  for by_part in (places, people, orgs, works):
    for p, recs in by_part.items():
      records += recs
      parts += [p] * len(recs)
  # Doc ids follow a shuffled order, so an id says nothing about the entity's kind.
  ranks = list(range(len(records)))
  rng.shuffle(ranks)
  width = max(3, len(str(len(records) - 1)))
  doc_ids = [f"doc{r:0{width}d}" for r in ranks]
  # Distractor sentences may name entities of any part: a name, never a fact about it.
  names = [r["name"] for r in records]
  entities, documents = [], []
  for record, doc_id, part in zip(records, doc_ids, parts):
    attrs = {a: record[a] for a in ATTRIBUTES[record["kind"]]}
    entities.append(Entity(record["name"], record["kind"], attrs, doc_id, part))
    documents.append(_document(rng, record, doc_id, names, cfg.distractors_per_doc))
  if high > 0:
    # Its own stream: the entities and the base pages stay those of the world without filler.
    filler_rng = random.Random(f"{cfg.seed}-filler")
    documents = [_lengthen(filler_rng, doc, record, names, cfg.filler_sentences)
                 for doc, record in zip(documents, records)]
  documents.sort(key=lambda d: d.doc_id)
  return World(cfg, tuple(entities), tuple(documents))


def vocabulary(world: World, *, phrases: bool = False, names: bool = True) -> tuple[str, ...]:
  """The world's names and question stems, sorted (a stable order).

  Names are those of the entities, attribute values and doc ids; stems are the literal
  text of the question templates ("What size of settlement is ", " lie?"). A tokenizer
  trained on the world's text with a large enough vocabulary gives each of these one
  token; `ByteTokenizer(words=vocabulary(w))` does the same without training one. Then
  copying a name after a stem is one attention lookup, which a tiny model learns in minutes.
  `phrases=True` adds the literal text of the page templates too (fact and distractor
  sentences, noun phrases, the media's verbs: "By population, ", " counts as "), as such a
  tokenizer would: pages, and the traces that quote them, become about three times shorter.
  `names=False` leaves the names out (the stems, and phrases if asked, only): names are then
  spelled in bytes, as a tokenizer that never saw them splits them into pieces.
  """
  words = set()
  if names:
    words |= {e.name for e in world.entities} | {d.doc_id for d in world.documents}
    words |= {v for e in world.entities for v in e.attributes.values()}
  templates = list(ASK.values())
  if phrases:
    templates += [t for ts in FACTS.values() for t in ts] + list(_DISTRACTORS)
    templates += list(_NP.values()) + [w for ws in MEDIA.values() for w in ws]
  words |= {part for template in templates for part in re.split(r"\{\w+\}", template)
            if len(part.strip()) > 1}
  return tuple(sorted(words))


def _chains(world: World, hops: int) -> list[tuple[tuple[Entity, ...], tuple[str, ...]]]:
  """Every (entities, attributes) path of exactly `hops` steps that never revisits an entity."""
  found = []

  def walk(path: tuple[Entity, ...], attrs: tuple[str, ...]) -> None:
    here = path[-1]
    seen = {e.name for e in path}
    for attr in ATTRIBUTES[here.kind]:
      value = here.attributes[attr]
      if attr in LINKS and value in seen:
        continue  # a cycle would put the answer into the question text
      if len(attrs) == hops - 1:
        found.append((path, attrs + (attr,)))
      elif attr in LINKS:
        walk(path + (world.entity(value),), attrs + (attr,))

  for entity in world.entities:
    walk((entity,), ())
  return found


def _words(entity: Entity) -> dict[str, str]:
  return _medium_words(entity.attributes["medium"]) if entity.kind == "work" else {}


def one_hop(entity: Entity, attr: str) -> Hop:
  """The one-hop step asking for `entity`'s `attr`, in the world's wording."""
  return Hop(entity.name, attr, entity.attributes[attr], entity.doc_id,
             ASK[attr].format(np=entity.name, **_words(entity)))


def _question(path: tuple[Entity, ...], attrs: tuple[str, ...]) -> Question:
  """Nests one noun phrase per link ("the birthplace of the founder of X"), then asks."""
  phrase = path[0].name
  hops = []
  for entity, attr in zip(path, attrs):
    hops.append(one_hop(entity, attr))
    if len(hops) < len(attrs):
      phrase = _NP[attr].format(np=phrase, **_words(entity))
  text = ASK[attrs[-1]].format(np=phrase, **_words(path[-1]))
  qid = "q" + hashlib.sha1(text.encode()).hexdigest()[:10]
  return Question(qid, text, hops[-1].answer, tuple(hops), tuple(h.doc_id for h in hops),
                  DIFFICULTY.get(len(hops), "hard"))  # fmt: skip


def chain_questions(world: World, hops: int) -> list[Question]:
  """Every question of exactly `hops` links (bridge questions), in a stable order."""
  return [_question(*chain) for chain in _chains(world, hops)]


def allocate(num: int, weights: Sequence[float]) -> list[int]:
  """Splits `num` by `weights` with largest remainders (deterministic, sums to `num`)."""
  total = float(sum(weights))
  if total <= 0 or min(weights) < 0:
    raise ValueError(f"hop_weights must be >= 0 with a positive sum, got {tuple(weights)}")
  raw = [num * w / total for w in weights]
  counts = [int(r) for r in raw]
  by_remainder = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
  for i in by_remainder[: num - sum(counts)]:
    counts[i] += 1
  return counts


def make_questions(world: World, *, num: int, hop_weights: Sequence[float] = (1.0, 1.0, 1.0),
                   seed: int = 0) -> list[Question]:  # fmt: skip
  """Samples `num` distinct questions; `hop_weights[i]` weighs questions of i + 1 hops.

  Counts per hop level are split by the weights exactly (largest remainder). Raises
  ValueError when the world has fewer distinct questions of some level than asked for.
  """
  rng = random.Random(seed)
  questions = []
  for level, count in enumerate(allocate(num, hop_weights), start=1):
    if count == 0:
      continue
    chains = _chains(world, level)
    if count > len(chains):
      raise ValueError(f"asked for {count} {level}-hop questions; the world has {len(chains)}")
    questions += [_question(*chain) for chain in rng.sample(chains, count)]
  rng.shuffle(questions)
  return questions


def _split_group(question: Question) -> str:
  return question.hops[0].entity if question.hops else question.id


def split_questions(questions: Sequence[Question], test_fraction: float,
                    seed: int = 0) -> tuple[list[Question], list[Question]]:  # fmt: skip
  """Splits by the entity a question starts from, so no test start entity is asked about in train.

  Whole groups go to test until it holds at least `test_fraction` of the questions; both
  lists keep the input order. Questions without hops (benchmarks) are grouped by id.
  """
  if not 0.0 <= test_fraction <= 1.0:
    raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
  key = _split_group
  groups = sorted({key(q) for q in questions})
  random.Random(seed).shuffle(groups)
  sizes: dict[str, int] = {}
  for q in questions:
    sizes[key(q)] = sizes.get(key(q), 0) + 1
  target, test_groups, taken = test_fraction * len(questions), set(), 0
  for group in groups:
    if taken >= target:
      break
    test_groups.add(group)
    taken += sizes[group]
  train = [q for q in questions if key(q) not in test_groups]
  return train, [q for q in questions if key(q) in test_groups]


def question_part(world: World, question: Question) -> str | None:
  """The part of every page `question` needs, or None when its pages span several parts."""
  parts = {world.entity_of_doc(h.doc_id).part for h in question.hops}
  return parts.pop() if len(parts) == 1 else None


def split_by_part(world: World, questions: Sequence[Question]) -> dict[str, list[Question]]:
  """The questions of each part of the world (`WorldConfig.holdout`), in the input order.

  A question lands in a part only when every page of its chain (both chains of a comparison)
  is that part's; a question that spans parts is dropped (with links kept inside parts, only
  a comparison of two entities of different parts can).
  """
  out = {p: [] for p in PARTS}
  for q in questions:
    part = question_part(world, q)
    if part is not None:
      out[part].append(q)
  return out


def part_documents(world: World, part: str) -> tuple[Document, ...]:
  """The pages of the entities of `part` (e.g. the training pages: a warm start's corpus)."""
  docs = {e.doc_id for e in world.entities if e.part == part}
  return tuple(d for d in world.documents if d.doc_id in docs)
