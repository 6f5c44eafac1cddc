"""Rewards for M-GRPO (algorithm.md 1.2): answer matching, pluggable judges, R_M and R_S.

The string functions run on the host (rewards are computed once per episode, outside any
jitted step). `main_reward` and `sub_reward` are plain arithmetic, so they accept Python
scalars, NumPy arrays and JAX arrays alike and return the same kind they were given.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import unicodedata
from typing import Protocol, Sequence, runtime_checkable

__all__ = [
    "GroundedJudge",
    "Judge",
    "JudgeError",
    "RuleExpertJudge",
    "RuleJudge",
    "correctness",
    "best_f1",
    "exact_match",
    "expert_score",
    "main_reward",
    "normalize_answer",
    "sub_reward",
    "token_f1",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
  """SQuAD normalisation: lower-case, drop punctuation, drop a/an/the, collapse spaces.

  Punctuation is every Unicode character whose category starts with "P" (a superset of
  `string.punctuation`, so curly quotes and dashes from web pages are removed too). As in
  SQuAD, punctuation is deleted rather than replaced by a space: "U.S." -> "us".
  """
  s = s.lower()
  s = "".join(ch for ch in s if not unicodedata.category(ch).startswith("P"))
  s = _ARTICLES.sub(" ", s)
  return " ".join(s.split())


def _golds(gold: str | Sequence[str]) -> list[str]:
  golds = [gold] if isinstance(gold, str) else list(gold)
  if not golds:
    raise ValueError("gold must be a string or a non-empty list of strings")
  return golds


def exact_match(pred: str, gold: str | Sequence[str]) -> bool:
  """True when the normalised prediction equals any normalised acceptable answer."""
  norm_pred = normalize_answer(pred)
  return any(norm_pred == normalize_answer(g) for g in _golds(gold))


def token_f1(pred: str, gold: str) -> float:
  """SQuAD token F1 between normalised strings (1.0 when both are empty)."""
  pred_toks, gold_toks = normalize_answer(pred).split(), normalize_answer(gold).split()
  if not pred_toks or not gold_toks:
    return float(pred_toks == gold_toks)
  # Multiset intersection: a repeated word only matches as often as it occurs in both.
  same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred_toks), same / len(gold_toks)
  return 2 * precision * recall / (precision + recall)


def best_f1(pred: str, gold: str | Sequence[str]) -> float:
  """The best `token_f1` of `pred` over the acceptable answers (an answer and its aliases)."""
  return max(token_f1(pred, g) for g in _golds(gold))


def main_reward(format_ok, correct, *, alpha=(0.1, 0.9)):
  """R_M = α1·format + α2·correct, where correctness only counts when the format is valid.

  `format_ok` is a bool (or 0/1 array); `correct` is a score in [0, 1] (bool, EM or a
  judge's verdict). With the reference α = (0.1, 0.9), R_M ∈ {0, 0.1, 1.0}.
  """
  fmt = format_ok * 1.0  # bool -> float without changing the array library
  return alpha[0] * fmt + alpha[1] * fmt * correct


def sub_reward(format_ok, main_correct, expert_score, *, beta=(0.1, 0.9, 0.0)):
  """R_S = β1·format(S) + β2·r_correct(M) + β3·r_expert(S); exactly 0 when S's format fails.

  `main_correct` is the outcome of the M rollout the S episode belonged to; `expert_score`
  is the judge's score of S's subtask in [0, 1] (ignored under the reference β3 = 0).
  """
  fmt = format_ok * 1.0
  return fmt * (beta[0] + beta[1] * main_correct + beta[2] * expert_score)


class JudgeError(RuntimeError):
  """A judge raised or returned something that is not a score in [0, 1].

  The reference code counted a failed judge call as a wrong answer, which silently turns
  infrastructure failures into negative reward. We raise instead, naming the question.
  """


@runtime_checkable
class Judge(Protocol):
  """A scorer `(question, prediction, reference_or_subtask) -> float in [0, 1]`.

  For answer correctness the third argument is one acceptable answer; for r_expert it is
  the evidence expected from the subtask. An LLM judge is any callable of this shape.
  """

  def __call__(self, question: str, prediction: str, reference: str) -> float:
    ...


@dataclasses.dataclass(frozen=True)
class RuleJudge:
  """Rule-based answer judge, the fallback when exact match fails.

  Scores 1.0 when (a) the normalised reference occurs in the normalised prediction as a
  whole-word phrase and the prediction is at most `max_len_ratio` times the reference's
  length in words (so listing many candidates does not win), or (b) token F1 ≥
  `f1_threshold`. Otherwise 0.0, keeping R_M in {0, 0.1, 1.0}.
  """

  f1_threshold: float = 0.8
  max_len_ratio: float = 4.0

  def __call__(self, question: str, prediction: str, reference: str) -> float:
    del question  # the rule only compares strings
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not ref or not pred:
      return 0.0
    # Pad with spaces so containment respects word boundaries ("1984" not in "19845").
    contained = f" {ref} " in f" {pred} "
    short = len(pred.split()) <= self.max_len_ratio * len(ref.split())
    return float((contained and short) or token_f1(pred, ref) >= self.f1_threshold)


@dataclasses.dataclass(frozen=True)
class RuleExpertJudge:
  """Rule-based r_expert judge: did S return a non-empty result that covers the evidence?

  Score = 0.0 for an empty (after normalisation) result; otherwise the fraction of the
  distinct normalised evidence words that appear in the result (token recall, in [0, 1]).
  With no expected evidence, a non-empty result scores 1.0 — emptiness is then the only
  thing a rule can check.
  """

  def __call__(self, question: str, prediction: str, reference: str) -> float:
    del question
    result_words = set(normalize_answer(prediction).split())
    evidence_words = set(normalize_answer(reference).split())
    if not result_words:
      return 0.0
    if not evidence_words:
      return 1.0
    return len(evidence_words & result_words) / len(evidence_words)


@dataclasses.dataclass(frozen=True)
class GroundedJudge:
  """Rule-based r_expert for a tool user: was S's result read from what its tools returned?

  `reference` is the text of the tool replies S received. Score = the fraction of the
  result's distinct normalised words that occur in it (0.0 for an empty result): a result
  copied from a visited page scores 1, a made-up one 0, whatever the main agent then does.
  """

  def __call__(self, question: str, prediction: str, reference: str) -> float:
    del question
    result_words = set(normalize_answer(prediction).split())
    if not result_words:
      return 0.0
    return len(result_words & set(normalize_answer(reference).split())) / len(result_words)


def _call_judge(judge: Judge, question: str, prediction: str, reference: str) -> float:
  """Calls `judge` and checks its output, turning any failure into `JudgeError`."""
  try:
    score = float(judge(question, prediction, reference))
  except Exception as e:  # noqa: BLE001 - any judge failure must surface, never count as 0
    raise JudgeError(f"judge {judge!r} failed on question {question!r}: {e}") from e
  if not (math.isfinite(score) and 0.0 <= score <= 1.0):
    raise JudgeError(f"judge {judge!r} returned {score!r}, not in [0, 1], on question {question!r}")
  return score


def correctness(pred: str,
                gold: str | Sequence[str],
                *,
                judge: Judge | None = None,
                question: str = "") -> float:
  """r_correct in [0, 1]: 1.0 on exact match; otherwise the judge's best score over golds.

  `judge=None` is exact match only (the reference default); pass `RuleJudge()` or an LLM
  judge to score near misses. The judge is never called when exact match succeeds.

  Raises:
    JudgeError: if the judge raises or returns a non-finite value or one outside [0, 1].
      The error names `question`, so pass it for a useful message.
  """
  golds = _golds(gold)
  if exact_match(pred, golds):
    return 1.0
  if judge is None:
    return 0.0
  best = 0.0
  for g in golds:
    best = max(best, _call_judge(judge, question, pred, g))
    if best >= 1.0:  # no need to spend more judge calls
      break
  return best


def expert_score(subtask: str,
                 result: str,
                 evidence: str = "",
                 *,
                 judge: Judge | None = None) -> float:
  """r_expert in [0, 1]: how well S did `subtask`, by `judge` (default `RuleExpertJudge`).

  Raises:
    JudgeError: as in `correctness`; the message names the subtask.
  """
  return _call_judge(judge or RuleExpertJudge(), subtask, result, evidence)
