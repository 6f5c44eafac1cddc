"""r_format of an agent episode: a state machine fed one turn at a time.

r_format (algorithm.md 1.2) is 1 iff every turn parses, the episode ends with the role's final
action, no turn follows it, and it does so within `max_turns` turns (`EpisodeValidator`).
"""

from __future__ import annotations

from typing import Any, Iterable

from mgrpo_jax.agents.protocol import FINAL_ACTION, Turn, check_role, parse_turn


class EpisodeValidator:
  """r_format of one agent episode, as a state machine fed one turn at a time.

  `step` parses a turn and advances; the episode is `done` after the final action ("answer"
  for main and single, "result" for sub), after the first invalid turn (the episode ends early as a
  format failure), after `max_turns` turns, or after `abort`. `format_ok` is r_format: True
  iff the episode ended with its final action within `max_turns` turns, every turn parsed and
  no turn came after the end. `failure` says why not (the first reason; None when ok).
  Never raises on turn text.
  """

  def __init__(self, role: str, max_turns: int, *, parse=None):
    """`parse(text, role) -> Turn` reads a turn (default `parse_turn`; native.parse_turn)."""
    check_role(role)
    if not isinstance(max_turns, int) or max_turns < 1:
      raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    self.role = role
    self.max_turns = max_turns
    self.turns: list[Turn] = []
    self._done = False
    self._finished = False  # ended with the final action
    self._failure: str | None = None
    self._parse = parse or parse_turn

  def _end(self, failure: str | None) -> None:
    self._done = True
    if self._failure is None:
      self._failure = failure

  def step(self, turn_text: Any) -> Turn:
    """Parses the next turn and advances the episode; returns the parsed turn."""
    n = len(self.turns) + 1
    if self._done:
      self._end(f"turn {n} after the episode ended")
      return Turn(ok=False, error="turn after the episode ended")
    turn = self._parse(turn_text, self.role)
    self.turns.append(turn)
    if not turn.ok:
      self._end(f"turn {n}: {turn.error}")
    elif turn.action == FINAL_ACTION[self.role]:
      self._finished = True
      self._end(None)
    elif n >= self.max_turns:
      self._end(f"no <{FINAL_ACTION[self.role]}> within max_turns={self.max_turns}")
    return turn

  def abort(self, reason: str) -> None:
    """Ends the episode as a format failure, e.g. when its context would overflow."""
    self._end(f"aborted: {reason}")

  @property
  def done(self) -> bool:
    """True when no further turn may be generated."""
    return self._done

  @property
  def format_ok(self) -> bool:
    """r_format of the episode so far (False while it is still running)."""
    return self._finished and self._failure is None

  @property
  def failure(self) -> str | None:
    """Why `format_ok` is False; None when it is True."""
    if self._failure is None and not self._finished:
      return f"episode has not ended with <{FINAL_ACTION[self.role]}> ({len(self.turns)} turns)"
    return self._failure

  @property
  def final(self) -> Turn | None:
    """The final-action turn (its argument is the answer or result), when format_ok."""
    return self.turns[-1] if self.format_ok else None


def format_ok(turn_texts: Iterable[Any], role: str, max_turns: int) -> bool:
  """r_format of a whole episode given as its turns' texts (see `EpisodeValidator`)."""
  validator = EpisodeValidator(role, max_turns)
  for text in turn_texts:
    validator.step(text)
  return validator.format_ok
