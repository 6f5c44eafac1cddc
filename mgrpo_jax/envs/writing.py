"""MAGRPO's writing tasks: TLDR summarisation and article expansion, with their joint rewards.

Two agents write in parallel from the same source (a Reddit post, or a paper abstract) and
one level-gated joint reward scores the pair (algorithm.md 2.3). Levels: (1) word counts,
(2) character-length ratio, (3) unique-word ratio, (4) style = 0.4·T (transition-word
categories) + 0.6·J (content-word Jaccard, normalised by a cap). A level that fails stops
scoring: later levels give 0 and earlier ones keep what they earned.

Choices where the paper is silent (the reference matched transitions as substrings, so "but"
fired inside "butter"; ours matches whole words):
- Word counts (level 1) are whitespace tokens of the raw text, as the paper says.
- Character lengths (level 2) are of the text with outer whitespace stripped, so trailing
  newlines or padding cannot move the ratio.
- Words for levels 3 and 4 are whitespace tokens, case-folded (curly apostrophes made
  straight), with leading and trailing punctuation stripped ("Post," == "post"); inner
  punctuation stays ("don't", "state-of-the-art", "3.5"). Tokens of punctuation only are
  dropped. Level 3 counts every distinct word, stop-words included (as the reference does);
  Jaccard uses content words (STOP_WORDS removed), and two empty sets give J = 0.
- Transition phrases match whole words, case-folded, within one clause (punctuation such as
  "," or "." between two words breaks a phrase), longest phrase first, without overlap:
  "as a result of" is a cause, not also an effect. Each phrase has exactly one category.
- Article transitions are counted over both texts (the union of their categories).
- Range ends are inclusive as algorithm.md writes them; a ratio exactly at the outer end (ρ = 1.1
  or 5.0, u = 1.3) passes the level with 0 points, so later levels still score. Partial
  scores are clamped to their range to absorb float round-off at the ends.
- `level` counts the levels passed: 0, 1, 2, or 4 (level 4 cannot fail once reached).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

from mgrpo_jax.envs import writing_corpus
from mgrpo_jax.envs.datasets import DatasetError

KINDS = ("tldr", "article")
MAX_REWARD = 3.0
MAX_FEEDBACK_CHARS = 300

TRANSITION_WORDS: dict[str, tuple[str, ...]] = {
  "addition": ("additionally", "furthermore", "moreover", "in addition", "besides", "also",
               "as well as", "what is more", "not only"),
  "contrast": ("however", "in contrast", "by contrast", "on the other hand", "conversely",
               "on the contrary", "whereas", "instead", "but", "rather than"),
  "concession": ("although", "though", "even though", "nevertheless", "nonetheless", "despite",
                 "in spite of", "admittedly", "even so"),
  "cause": ("because", "because of", "due to", "owing to", "as a result of",
            "for this reason", "given that", "thanks to"),
  "effect": ("therefore", "thus", "consequently", "as a result", "hence", "accordingly",
             "as a consequence"),
  "example": ("for example", "for instance", "such as", "to illustrate", "namely"),
  "clarification": ("in other words", "that is to say", "to put it simply", "to clarify",
                    "more precisely", "specifically", "put differently"),
  "emphasis": ("indeed", "in fact", "above all", "notably", "especially", "certainly",
               "importantly", "clearly", "undoubtedly"),
  "sequence": ("first", "firstly", "second", "secondly", "third", "thirdly", "next", "then",
               "finally", "lastly", "to begin with", "subsequently"),
  "time": ("meanwhile", "at the same time", "in the meantime", "previously", "afterwards",
           "afterward", "later", "eventually", "currently", "recently"),
  "comparison": ("similarly", "likewise", "in the same way", "compared with", "compared to",
                 "equally", "just as", "in comparison"),
  "conclusion": ("in conclusion", "to conclude", "in summary", "to summarize", "to sum up",
                 "overall", "in short", "in brief", "ultimately", "all in all"),
  "condition": ("if", "unless", "even if", "provided that", "as long as", "otherwise", "in case",
                "assuming that"),
  "purpose": ("in order to", "so that", "so as to", "to this end", "with this in mind",
              "for this purpose"),
  "generalization": ("in general", "generally", "typically", "usually", "as a rule",
                     "for the most part", "broadly speaking"),
}  # fmt: skip

# English function words: pronouns, articles, auxiliaries, prepositions, conjunctions and
# their common contractions. They carry no topic, so Jaccard ignores them.
STOP_WORDS: frozenset[str] = frozenset("""
a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from
further had has have having he her here hers herself him himself his how i if in into is it
its itself just may me might more most must my myself no nor not now of off on once only or
other our ours ourselves out over own same shall she should so some such than that the their
theirs them themselves then there these they this those through to too under until up us very
was we were what when where which while who whom why will with would you your yours yourself
yourselves it's i'm i've i'd i'll don't doesn't didn't can't won't isn't wasn't aren't that's
there's we're they're you're let's
""".split())

_PHRASES = {tuple(p.split()): cat for cat, ps in TRANSITION_WORDS.items() for p in ps}
_LONGEST = max(len(p) for p in _PHRASES)
_EDGE = re.compile(r"^[\W_]+|[\W_]+$")
# What ends a clause for phrase matching: sentence and clause punctuation, brackets, quotes,
# dashes (a hyphen only when it stands alone, so "well-known" stays one word).
_CLAUSE_BREAK = re.compile(r"[.,;:!?()\[\]{}\"\u201c\u201d\u2013\u2014\u2026]|\s-+\s")


def normalized_words(text: str) -> list[str]:
  """Whitespace tokens, case-folded, with leading and trailing punctuation stripped."""
  text = text.replace("\u2019", "'").replace("\u2018", "'").casefold()
  return [w for w in (_EDGE.sub("", tok) for tok in text.split()) if w]


def content_words(text: str) -> set[str]:
  """The distinct normalised words of `text` that are not stop-words."""
  return {w for w in normalized_words(text) if w not in STOP_WORDS}


def jaccard(a: set[str], b: set[str]) -> float:
  """|a ∩ b| / |a ∪ b|, and 0 for two empty sets (nothing shared is no consistency)."""
  union = a | b
  return len(a & b) / len(union) if union else 0.0


def transition_categories(text: str) -> frozenset[str]:
  """The TRANSITION_WORDS categories used in `text` (whole words, longest phrase first)."""
  found = set()
  for clause in _CLAUSE_BREAK.split(text):
    ws, i = normalized_words(clause), 0
    while i < len(ws):
      for n in range(min(_LONGEST, len(ws) - i), 0, -1):
        category = _PHRASES.get(tuple(ws[i:i + n]))
        if category is not None:
          found.add(category)
          i += n
          break
      else:
        i += 1
  return frozenset(found)


def transition_score(num_categories: int) -> float:
  """T: 0 without transitions, else min(1, 0.4 + 0.05·(k − 1)); k ≥ 13 gives 1."""
  return 0.0 if num_categories <= 0 else min(1.0, 0.4 + 0.05 * (num_categories - 1))


def _clamp(x: float, hi: float) -> float:
  return min(hi, max(0.0, x))


def _tldr_length(rho: float) -> float | None:
  if 1.6 <= rho <= 3.2:
    return 1.0
  if 1.1 <= rho < 1.6:
    return _clamp((rho - 1.1) / 0.5, 1.0)
  if 3.2 < rho <= 5.0:
    return _clamp(1.0 - (rho - 3.2) / 1.8, 1.0)
  return None


def _tldr_unique(u: float) -> float | None:
  if u >= 2.0:
    return 0.5
  if 1.3 <= u < 2.0:
    return _clamp(0.5 * (u - 1.3) / 0.7, 0.5)
  return None


def _article_length(rho: float) -> float | None:
  if 1.0 <= rho <= 1.3:
    return 1.0
  if 0.8 <= rho < 1.0:
    return _clamp((rho - 0.8) / 0.2, 1.0)
  if 1.3 < rho <= 1.5:
    return _clamp(1.0 - (rho - 1.3) / 0.2, 1.0)
  return None


def _article_unique(u: float) -> float | None:
  if 0.7 <= u <= 1.3:
    return 0.5
  if 0.5 <= u < 0.7:
    return _clamp(0.5 * (u - 0.5) / 0.2, 0.5)
  if 1.3 < u <= 1.7:
    return _clamp(0.5 * (1.0 - (u - 1.3) / 0.4), 0.5)
  return None


@dataclasses.dataclass(frozen=True)
class _Spec:
  """One task's constants; the text fields are what feedback tells the agents."""

  names: tuple[str, str]  # What the feedback calls text 1 and text 2.
  words: tuple[int, int]  # Inclusive word-count range for each text.
  length: Callable[[float], float | None]  # Level 2 score of ρ; None stops.
  length_target: str
  unique: Callable[[float], float | None]  # Level 3 score of u; None stops.
  unique_target: str
  transitions_both: bool  # False: agent 2's text only.
  jaccard_cap: float


_SPECS = {
  "tldr": _Spec(("summary 1", "summary 2"), (8, 256), _tldr_length, "1.6-3.2x", _tldr_unique,
                "at least 2x", False, 0.03),
  "article": _Spec(("part 1", "part 2"), (128, 256), _article_length, "1.0-1.3x",
                   _article_unique, "0.7-1.3x", True, 0.23),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Measures:
  words: tuple[int, int]
  rho: float | None  # None when text 1 is empty.
  unique: float | None  # None when text 1 has no words.
  categories: frozenset[str]
  jaccard: float


def _measure(spec: _Spec, c1: str, c2: str) -> _Measures:
  len1, len2 = len(c1.strip()), len(c2.strip())
  u1, u2 = len(set(normalized_words(c1))), len(set(normalized_words(c2)))
  cats = transition_categories(c2)
  if spec.transitions_both:
    cats = cats | transition_categories(c1)
  return _Measures((len(c1.split()), len(c2.split())), len2 / len1 if len1 else None,
                   u2 / u1 if u1 else None, cats, jaccard(content_words(c1), content_words(c2)))


@dataclasses.dataclass(frozen=True)
class WritingReward:
  """The joint reward of one pair of texts and its parts (algorithm.md 2.3)."""

  total: float  # 0..3.
  structure: float  # Levels 1-3, max 2.
  style: float  # 0.6·J part of level 4.
  coherence: float  # 0.4·T part of level 4.
  level: int  # Levels passed: 0, 1, 2 or 4.

  def metrics(self) -> dict[str, float]:
    """The paper's reported metrics; return = total / 3."""
    return {"total": self.total, "structure": self.structure, "style": self.style,
            "coherence": self.coherence, "return": self.total / MAX_REWARD}


def _score(spec: _Spec, c1: str, c2: str) -> WritingReward:
  m = _measure(spec, c1, c2)
  lo, hi = spec.words
  if not all(lo <= n <= hi for n in m.words):
    return WritingReward(0.0, 0.0, 0.0, 0.0, 0)
  structure = 0.5
  length = spec.length(m.rho) if m.rho is not None else None
  if length is None:
    return WritingReward(structure, structure, 0.0, 0.0, 1)
  structure += length
  unique = spec.unique(m.unique) if m.unique is not None else None
  if unique is None:
    return WritingReward(structure, structure, 0.0, 0.0, 2)
  structure += unique
  coherence = 0.4 * transition_score(len(m.categories))
  style = 0.6 * min(m.jaccard, spec.jaccard_cap) / spec.jaccard_cap
  # style + coherence first: 2.0 + (0.6 + 0.4) is exactly 3.0 at the maximum.
  return WritingReward(structure + (style + coherence), structure, style, coherence, 4)


def tldr_reward(c1: str, c2: str) -> WritingReward:
  """TLDR joint reward: c1 is agent 1's short summary, c2 agent 2's detailed one."""
  return _score(_SPECS["tldr"], c1, c2)


def article_reward(c1: str, c2: str) -> WritingReward:
  """Article-expansion joint reward: c1 background and motivation, c2 methods and implications."""
  return _score(_SPECS["article"], c1, c2)


REWARDS: dict[str, Callable[[str, str], WritingReward]] = {
  "tldr": tldr_reward, "article": article_reward}


def _check_kind(kind: str) -> _Spec:
  if kind not in _SPECS:
    raise ValueError(f"unknown writing task {kind!r}; expected one of {KINDS}.")
  return _SPECS[kind]


def feedback(kind: str, c1: str, c2: str, reward: WritingReward) -> str:
  """At most 300 characters for the next turn: the failed level and why, else what to improve."""
  spec = _check_kind(kind)
  m = _measure(spec, c1, c2)
  a, b = spec.names
  (lo, hi), (n1, n2) = spec.words, m.words
  if reward.level == 0:
    parts = [f"level 1 failed: {a} has {n1} words and {b} has {n2}; each needs {lo}-{hi}."]
  elif reward.level == 1:
    got = "is empty" if m.rho is None else f"is {m.rho:.2f}x as long as {a}"
    parts = [f"level 2 failed: {b} {got} (characters); aim for {spec.length_target}."]
  elif reward.level == 2:
    got = "cannot be compared" if m.unique is None else f"has {m.unique:.2f}x the distinct words"
    parts = [f"level 3 failed: {b} {got} of {a}; aim for {spec.unique_target}."]
  else:
    parts = [f"all levels passed, score {reward.total:.2f}/3."]
    if spec.length(m.rho) < 1.0:
      parts.append(f"{b} is {m.rho:.2f}x as long as {a}; aim for {spec.length_target}.")
    if spec.unique(m.unique) < 0.5:
      parts.append(f"{b} has {m.unique:.2f}x the distinct words of {a}; "
                   f"aim for {spec.unique_target}.")  # fmt: skip
    if reward.coherence < 0.4:
      who = "the two texts use" if spec.transitions_both else f"{b} uses"
      parts.append(f"{who} {len(m.categories)} kinds of transition words; 13 score full.")
    if reward.style < 0.6:
      parts.append(f"shared content words {100 * m.jaccard:.1f}% of all; "
                   f"{100 * spec.jaccard_cap:.0f}% scores full.")  # fmt: skip
  # Whole sentences only: drop the later hints rather than cut one in half.
  text = parts[0]
  for part in parts[1:]:
    if len(text) + 1 + len(part) <= MAX_FEEDBACK_CHARS:
      text += " " + part
  return text[:MAX_FEEDBACK_CHARS]


@dataclasses.dataclass(frozen=True)
class WritingExample:
  """One source text: the post (tldr) or the abstract (article); `id` is unique per set."""

  kind: str
  source: str
  id: str


# Field names tried in order: trl-lib/tldr's "prompt", arXiv abstracts' "abstract" (the
# reference's dataset calls it "abstract_text").
DEFAULT_FIELDS = {"tldr": ("prompt", "post"), "article": ("abstract", "abstract_text")}
_TLDR_CUE = re.compile(r"\s*TL;DR:\s*$")


def _parse_line(raw: str, where: str, names: tuple[str, ...]) -> tuple[str, str | None]:
  try:
    record = json.loads(raw)
  except json.JSONDecodeError as e:
    raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno}).") from None
  if not isinstance(record, dict):
    raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}.")
  name = next((n for n in names if n in record), None)
  if name is None:
    tried = " or ".join(repr(n) for n in names)
    raise DatasetError(f"{where}: missing field {tried}; keys present: {sorted(record)}.")
  value = record[name]
  if not isinstance(value, str) or not value.strip():
    raise DatasetError(f"{where}: field {name!r} must be non-empty text, got {value!r:.60}.")
  rid = record.get("id")
  return value, None if rid is None else str(rid)


def load_jsonl(path: str | os.PathLike, kind: str, *, field: str | None = None,
               limit: int | None = None) -> list[WritingExample]:  # fmt: skip
  """Reads source texts from a jsonl file (one object per line; blank lines skipped).

  The source comes from `field`, or by default "prompt"/"post" (tldr) and
  "abstract"/"abstract_text" (article); a trailing "TL;DR:" cue (trl-lib/tldr) is dropped.
  Ids come from an "id" field, else "<kind>-<n>" with n counting records from 0. A bad line
  raises DatasetError naming the file, the line and the field.
  """
  _check_kind(kind)
  names = (field,) if field else DEFAULT_FIELDS[kind]
  if limit is not None and limit < 0:
    raise ValueError(f"limit must be >= 0, got {limit}.")
  examples, seen = [], {}
  with open(path, encoding="utf-8") as f:
    for lineno, raw in enumerate(f, start=1):
      if limit is not None and len(examples) >= limit:
        break
      if not raw.strip():
        continue
      where = f"{os.fspath(path)}, line {lineno}"
      source, rid = _parse_line(raw, where, names)
      if kind == "tldr":
        source = _TLDR_CUE.sub("", source)
      rid = rid if rid is not None else f"{kind}-{len(examples)}"
      if rid in seen:
        raise DatasetError(f"{where}: id {rid!r} repeats line {seen[rid]}.")
      seen[rid] = lineno
      examples.append(WritingExample(kind, source.strip(), rid))
  if not examples and limit != 0:
    raise DatasetError(f"{os.fspath(path)}: no records.")
  return examples


def make_corpus(kind: str, num: int, *, seed: int = 0) -> list[WritingExample]:
  """`num` generated sources (reddit-like posts, or paper abstracts), deterministic by seed.

  Example i depends only on (kind, seed, i), so a smaller corpus is a prefix of a larger one.
  """
  _check_kind(kind)
  make = writing_corpus.post if kind == "tldr" else writing_corpus.abstract
  return [WritingExample(kind, make(seed, i), f"{kind}-{seed}-{i}") for i in range(num)]


_INSTRUCTIONS = {
  "tldr": (
    "You are writer 1 of two summarising the Reddit post below. Write summary 1: a short "
    "TL;DR of one or two sentences (at least 8 words) that states the post's main point. "
    "Writer 2 is separately writing a longer, detailed summary; you will not see it.",
    "You are writer 2 of two summarising the Reddit post below. Write summary 2: a detailed "
    "summary, two to three times as long as a one- or two-sentence TL;DR, with a varied "
    "vocabulary and transition words (however, for example, as a result) linking the ideas. "
    "Writer 1 is separately writing the short TL;DR; you will not see it.",
  ),
  "article": (
    "You are writer 1 of two expanding the paper abstract below into an introduction. Write "
    "part 1: the background and motivation (the problem, why it matters, what earlier work "
    "leaves open), in 150-250 words. Writer 2 is separately writing the methods and "
    "implications; do not cover them.",
    "You are writer 2 of two expanding the paper abstract below into an introduction. Write "
    "part 2: the methods and implications (what the paper does, how, and what follows from "
    "it), in 150-250 words. Writer 1 is separately writing the background and motivation; "
    "do not repeat it.",
  ),
}
_SOURCE_LABEL = {"tldr": "Post", "article": "Abstract"}


def agent_prompts(example: WritingExample, *, feedback: str = "") -> tuple[str, str]:
  """The two agents' prompts (each sees only its own), with `feedback` appended when given."""
  _check_kind(example.kind)
  tail = f"\n\nFeedback on the previous attempt: {feedback}" if feedback else ""
  body = f"\n\n{_SOURCE_LABEL[example.kind]}:\n{example.source}"
  first, second = _INSTRUCTIONS[example.kind]
  return first + body + tail, second + body + tail
