"""The M-GRPO agent protocol: turn grammar, strict parsing, r_format validation and rendering.

Three roles speak it. "main" (M) and "sub" (S) are the two agents of M-GRPO (algorithm.md 1.1);
"single" is the single-agent GRPO baseline (algorithm.md 1.7): one agent with every tool itself.

Turn grammar. A turn is the text an agent generates for one assistant message:

    turn   := ws [ "<think>" text "</think>" ws ] action ws
    main   := "<delegate>" subtask "</delegate>" | "<python>" code "</python>"
            | "<answer>" text "</answer>"
    sub    := "<search>" text "</search>" | "<visit>" text "</visit>" | "<result>" text "</result>"
    single := "<search>" text "</search>" | "<visit>" text "</visit>" | "<python>" code "</python>"
            | "<answer>" text "</answer>"
    subtask := text [ "<context>" text "</context>" ] text

- ``text`` holds no protocol tag (`TAGS`) and no control token (``<|im_start|>`` ...); other
  angle brackets ("x < 3", "<div>") are plain text. Only whitespace may sit outside tags.
- At most one think block, and it comes first; exactly one action, from the agent's own role.
- The argument (the action's text, minus a delegate's context block) is stripped and must be
  non-empty; so must a context block when present. The think text may be empty.
- Trailing end-of-turn markers (``<|im_end|>``, ``<|endoftext|>``) and whitespace are removed
  before parsing, so a turn may be passed with or without the token that closed it.

Actions. "delegate" (M) runs a whole S episode on the subtask, with the context block as S's
context; "python" (M and single, the reasoning tool) runs the code in the sandbox and returns
its output; "search" and "visit" (S and single) call a tool. After each of these the
environment appends a tool message (`tool_message`), which Qwen3's chat template renders as a
user turn holding ``<tool_response>\\n...\\n</tool_response>``; for a delegation its content is
S's result. "answer" (M and single) and "result" (S) are final: they end the episode.

Generation stops at the closing action tags or the end of turn (`stop_strings`,
`stop_token_ids`); every tag is a single token in both tokenizers (tokenizer.PROTOCOL_TAGS).

r_format (algorithm.md 1.2) is 1 iff every turn parses, the episode ends with the role's final
action, no turn follows it, and it does so within `max_turns` turns (`EpisodeValidator`).

Building sequences. A live rollout is the generation prompt, then for each turn the generated
tokens, the end-of-turn token and `continuation_text` (the tool turn and the next generation
prompt), appended and never re-rendered; see `continuation_text` for why re-rendering a whole
conversation with the template does not in general reproduce the live sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable

from mgrpo_jax import tokenizer as tk

__all__ = [
  "ACTIONS",
  "END_OF_TURN",
  "FINAL_ACTION",
  "ROLES",
  "TAGS",
  "EpisodeValidator",
  "TemplateError",
  "Turn",
  "continuation_ids",
  "continuation_text",
  "escape_specials",
  "format_ok",
  "main_messages",
  "main_system_prompt",
  "main_user_prompt",
  "parse_turn",
  "render_action",
  "single_messages",
  "single_system_prompt",
  "stop_strings",
  "stop_token_ids",
  "strip_end_of_turn",
  "sub_messages",
  "sub_system_prompt",
  "sub_user_prompt",
  "tool_message",
]

ROLES = ("main", "sub", "single")
ACTIONS = {
  "main": ("delegate", "python", "answer"),
  "sub": ("search", "visit", "result"),
  "single": ("search", "visit", "python", "answer"),
}
FINAL_ACTION = {"main": "answer", "sub": "result", "single": "answer"}
# Every action once, with the first role that has it: the owner an error names (single adds
# no action of its own, so the tags and their order stay those of main and sub).
_ALL_ACTIONS = {a: next(r for r in ROLES if a in ACTIONS[r]) for r in ROLES for a in ACTIONS[r]}
_TAG_NAMES = ("think", *_ALL_ACTIONS, "context", "tool_response")
# Every tag string of the protocol; each must be one token (tokenizer.PROTOCOL_TAGS).
TAGS = tuple(f"<{s}{n}>" for n in _TAG_NAMES for s in ("", "/"))
END_OF_TURN = (tk.IM_END, tk.ENDOFTEXT)

# One lexer for tags and control tokens; everything between matches is text.
_TOKEN_RE = re.compile(
  "<(/?)(" + "|".join(_TAG_NAMES) + ")>|(" + "|".join(re.escape(c) for c in tk.CONTROL_TOKENS) + ")"
)
_SNIPPET = 40  # characters of offending text quoted in an error


def _check_role(role: str) -> None:
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


# ------------------------------------------------------------------------------------ parsing


@dataclasses.dataclass(frozen=True)
class Turn:
  """One parsed turn. When `ok` is False, `error` says why and the other fields are empty."""

  ok: bool
  action: str | None = None  # "delegate", "python", "answer", "search", "visit" or "result"
  argument: str = ""  # the action's text, stripped (a delegate's context block removed)
  context: str | None = None  # a delegate's <context> text, stripped; None when absent
  think: str | None = None  # the think text, stripped; None when there was no think block
  error: str | None = None


def _fail(error: str) -> Turn:
  return Turn(ok=False, error=error)


def _snippet(text: str) -> str:
  text = text.strip()
  return repr(text if len(text) <= _SNIPPET else text[:_SNIPPET] + "...")


def strip_end_of_turn(text: str) -> str:
  """`text` without trailing whitespace and end-of-turn markers (any number, any order)."""
  # Walks an end index back and slices once: linear, where stripping a copy per marker was
  # quadratic in the number of trailing markers (a 4 MB reply of them took 13 s).
  end = len(text.rstrip())
  while True:
    for marker in END_OF_TURN:
      if text.endswith(marker, 0, end):
        end -= len(marker)
        while end and text[end - 1].isspace():
          end -= 1
        break
    else:
      return text[:end]


def _lex(text: str) -> list[tuple[str, str]]:
  """(kind, value) events: ("text", s), ("open", name), ("close", name), ("control", s)."""
  events, start = [], 0
  for m in _TOKEN_RE.finditer(text):
    if m.start() > start:
      events.append(("text", text[start : m.start()]))
    if m.group(3):
      events.append(("control", m.group(3)))
    else:
      events.append(("close" if m.group(1) else "open", m.group(2)))
    start = m.end()
  if start < len(text):
    events.append(("text", text[start:]))
  return events


def _describe(kind: str, value: str) -> str:
  return {"open": f"<{value}>", "close": f"</{value}>"}.get(kind, value)


def _read_block(events, pos: int, name: str, allow_context: bool):
  """Reads the body of <name> starting at events[pos].

  Returns (the text before and after a context block, context text or None, position after
  the closing tag), or an error string. Only a delegate may hold one <context> block.
  """
  parts, context = [""], None
  while pos < len(events):
    kind, value = events[pos]
    if kind == "text":
      parts[-1] += value
    elif kind == "close" and value == name:
      return parts, context, pos + 1
    elif kind == "open" and value == "context" and allow_context and context is None:
      # A context block holds plain text only: <context>, optional text, </context>.
      body = events[pos + 1 : pos + 3]
      if body[:1] == [("close", "context")]:
        context, pos = "", pos + 2
      elif len(body) == 2 and body[0][0] == "text" and body[1] == ("close", "context"):
        context, pos = body[0][1], pos + 3
      else:
        return f"unclosed or nested <context> inside <{name}>"
      parts.append("")
      continue
    else:
      return f"{_describe(kind, value)} inside <{name}>"
    pos += 1
  return f"unclosed <{name}>"


def _parse(events, role: str) -> Turn:
  think = action = None
  argument, context = "", None
  pos = 0
  while pos < len(events):
    kind, value = events[pos]
    if kind == "text":
      if value.strip():
        return _fail(f"text outside tags: {_snippet(value)}")
      pos += 1
      continue
    if kind == "control":
      return _fail(f"stray {value} inside the turn")
    if kind == "close":
      return _fail(f"</{value}> without a matching <{value}>")
    if value == "think":
      if action is not None:
        return _fail("<think> after the action")
      if think is not None:
        return _fail("more than one <think> block")
    elif value in ACTIONS[role]:
      if action is not None:
        return _fail(f"more than one action (<{action}> then <{value}>)")
    elif value in _ALL_ACTIONS:
      owner = _ALL_ACTIONS[value]
      return _fail(f"<{value}> is an action of the {owner} agent, not the {role} agent")
    else:
      return _fail(f"<{value}> outside an action")
    block = _read_block(events, pos + 1, value, allow_context=value == "delegate")
    if isinstance(block, str):
      return _fail(block)
    parts, block_context, pos = block
    if value == "think":
      think = "".join(parts).strip()
      continue
    action = value
    # Text before and after a context block is one subtask; the join keeps a line break.
    argument = "\n".join(p.strip() for p in parts if p.strip())
    if not argument:
      return _fail(f"empty <{value}>")
    if block_context is not None:
      context = block_context.strip()
      if not context:
        return _fail("empty <context>")
  if action is None:
    return _fail("no action (expected one of " + ", ".join(f"<{a}>" for a in ACTIONS[role]) + ")")
  return Turn(ok=True, action=action, argument=argument, context=context, think=think)


def parse_turn(text: Any, role: str) -> Turn:
  """Parses one generated turn of `role` (one of `ROLES`) strictly (see the module docstring).

  Never raises on any `text` (model output is arbitrary; a non-string is an invalid turn); an
  unknown `role` is a programming error and raises ValueError.
  """
  _check_role(role)
  if not isinstance(text, str):
    return _fail(f"turn is a {type(text).__name__}, not a str")
  return _parse(_lex(strip_end_of_turn(text)), role)


# --------------------------------------------------------------------------------- validation


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
    _check_role(role)
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
      return _fail("turn after the episode ended")
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


# ---------------------------------------------------------------------------------- rendering


def _check_plain(name: str, text: str) -> str:
  if not isinstance(text, str):
    raise TypeError(f"{name} must be a str, got {type(text).__name__}")
  m = _TOKEN_RE.search(text)
  if m:
    raise ValueError(f"{name} contains {m.group()!r}, which would not parse; see escape_specials")
  return text.strip()


def render_action(
  action: str, argument: str, *, think: str | None = None, context: str | None = None
) -> str:
  """The text of a well-formed turn (an expert's or SFT target's), without end-of-turn.

  The think block is ``<think>\\n{think}\\n</think>\\n\\n``: Qwen3's template re-renders a
  turn's reasoning in exactly this form, so such a turn survives a template round trip. Inputs
  are stripped; `parse_turn(render_action(...), role)` gives them back. Raises ValueError on an
  unknown action, a context outside delegate, an empty argument, think or context, or text
  holding a protocol tag or control token.
  """
  if action not in _ALL_ACTIONS:
    raise ValueError(f"action must be one of {tuple(_ALL_ACTIONS)}, got {action!r}")
  if context is not None and action != "delegate":
    raise ValueError(f"only delegate carries a context, not {action!r}")
  argument = _check_plain("argument", argument)
  if not argument:
    raise ValueError(f"empty argument for {action!r}")
  parts = []
  if think is not None:
    think = _check_plain("think", think)
    if not think:
      # Qwen3's template drops an empty think block from earlier turns (not prefix-stable).
      raise ValueError("empty think (pass None for no think block)")
    parts.append(f"<think>\n{think}\n</think>\n\n")
  parts.append(f"<{action}>{argument}")
  if context is not None:
    context = _check_plain("context", context)
    if not context:
      raise ValueError("empty context (pass None for no context)")
    parts.append(f"\n<context>{context}</context>")
  parts.append(f"</{action}>")
  return "".join(parts)


def escape_specials(text: str, specials: Iterable[str] = ()) -> str:
  """`text` with protocol tags, control tokens and `specials` defused: ``<`` -> ``&lt;``.

  Tool output and prompts come from outside the policy; a ``<|im_end|>`` or ``</tool_response>``
  inside them would otherwise encode as that single token and forge a turn boundary or tag.
  """
  extra = frozenset(s for s in specials if s.startswith("<"))
  return _escape_re(extra).sub(lambda m: "&lt;" + m.group()[1:], text)


@functools.lru_cache(maxsize=16)
def _escape_re(extra: frozenset[str]) -> re.Pattern:
  # Longest first: alternation takes the first match, and no target may hide a longer one.
  targets = sorted({*TAGS, *tk.CONTROL_TOKENS, *extra}, key=len, reverse=True)
  return re.compile("|".join(re.escape(t) for t in targets))


def tool_message(content: str, *, specials: Iterable[str] = ()) -> dict[str, str]:
  """The tool message that answers a delegate, python, search or visit action.

  Its content is `content` with special strings escaped (`escape_specials`) but NOT wrapped:
  Qwen3's chat template itself renders a "tool" message as
  ``<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n``, so
  wrapping here would nest two <tool_response> blocks.
  """
  return {"role": "tool", "content": escape_specials(content, specials)}


# A reply in canonical think form and one with none: continuation_text checks both, because
# Qwen3's template treats an assistant turn differently with and without reasoning.
_PROBE_REPLIES = (
  "<think>\nprobe reasoning\n</think>\n\n<answer>probe</answer>",
  "<delegate>probe</delegate>",
)
_PROBE_PROMPT = ({"role": "system", "content": "probe system"}, {"role": "user", "content": "q"})


class TemplateError(ValueError):
  """A chat template is not prefix-stable where the rollout needs it to be."""


def continuation_text(tokenizer: tk.Tokenizer, tool_content: str, *,
                      enable_thinking: bool | None = None) -> str:
  """The text a tool reply adds to a live sequence, right after the assistant's end of turn.

  That is, from just after the finished turn's ``<|im_end|>`` through the next generation
  prompt; with Qwen3's template:
  ``\\n<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n``
  ``<|im_start|>assistant\\n``
  (plus an empty think block when `enable_thinking` is False).

  It is derived from the tokenizer's own template: render [system, user] with a bare
  generation prompt, append a reply and the end-of-turn token (the live turn; an empty think
  block forced by `enable_thinking=False` would sit between the two), and take what the
  template renders after that for [system, user, reply, tool]. Raises
  TemplateError unless the live part is a prefix of that render, for a reply with a canonical
  think block and for one with none.

  What is and is not prefix-stable with Qwen3's template: appending a tool message and a new
  generation prompt never rewrites earlier text, provided each earlier reply is either
  without think or in canonical form (`render_action`). Re-rendering a whole conversation
  rewrites: (1) a reply whose think block is empty or not in canonical whitespace (the
  template drops or normalises it); (2) the empty think blocks that `enable_thinking=False`
  puts into every generation prompt (dropped from earlier turns); (3) the last assistant
  message, which gains an empty think block when it has none; (4) every reasoning block
  before the last user query. So rollouts append, and never re-render.
  """
  messages = list(_PROBE_PROMPT)
  prompt = tokenizer.render_chat(messages, True)
  end_of_turn = tokenizer.decode([tokenizer.eos_id])
  tool = tool_message(tool_content, specials=tokenizer.special_ids)
  deltas = []
  for reply in _PROBE_REPLIES:
    live = prompt + reply + end_of_turn
    full = tokenizer.render_chat(messages + [{"role": "assistant", "content": reply}, tool], True,
                                 enable_thinking=enable_thinking)
    if not full.startswith(live):
      raise TemplateError(
        "the chat template is not prefix-stable: after a tool message it renders the earlier "
        f"assistant turn differently.\nlive sequence: {live!r}\ntemplate render: {full!r}")
    deltas.append(full[len(live):])
  if deltas[0] != deltas[1]:
    raise TemplateError(f"the tool turn depends on the assistant turn before it: {deltas}")
  return deltas[0]


def continuation_ids(tokenizer: tk.Tokenizer, tool_content: str, *,
                     enable_thinking: bool | None = None) -> list[int]:
  """Token ids of `continuation_text`, to append after the end-of-turn token.

  The text starts right after ``<|im_end|>`` and every piece of it is cut at special tokens,
  so encoding it alone gives the same ids as encoding the whole sequence.
  """
  text = continuation_text(tokenizer, tool_content, enable_thinking=enable_thinking)
  return tokenizer.encode(text)


def stop_strings(role: str) -> tuple[str, ...]:
  """Where generation of a `role` turn stops: its closing action tags, then end of turn."""
  _check_role(role)
  return tuple(f"</{a}>" for a in ACTIONS[role]) + END_OF_TURN


def stop_token_ids(tokenizer: tk.Tokenizer, role: str) -> tuple[int, ...]:
  """Ids of `stop_strings(role)` that are tags, then `tokenizer.stop_ids`.

  Raises KeyError when a closing tag is not a single token of `tokenizer`.
  """
  tags = [tokenizer.token_id(s) for s in stop_strings(role) if s not in END_OF_TURN]
  return tuple(dict.fromkeys([*tags, *tokenizer.stop_ids]))


# ------------------------------------------------------------------------------------ prompts

# Short on purpose: tiny models learn the format from SFT, and every prompt token costs context.
_MAIN_SYSTEM = """\
You are the main agent. Answer the question; a sub-agent can research subtasks for you.
Each turn: optionally think in <think>...</think>, then exactly one action:
<delegate>subtask<context>what the sub-agent needs to know</context></delegate> gives a subtask \
to the sub-agent (context is optional); its report comes back in <tool_response>...</tool_response>.
<python>code</python> runs Python and returns what it prints.
<answer>short final answer</answer> ends the episode.
Write nothing outside these tags."""

_SUB_SYSTEM = """\
You are a sub-agent doing one subtask for the main agent, with a document library.
Each turn: optionally think in <think>...</think>, then exactly one action:
<search>query</search> searches the library; results come back in \
<tool_response>...</tool_response>.
<visit>document id or title</visit> reads a document.
<result>report for the main agent</result> ends your subtask.
Write nothing outside these tags."""

_SINGLE_SYSTEM = """\
You are a research agent with a document library. Answer the question yourself.
Each turn: optionally think in <think>...</think>, then exactly one action:
<search>query</search> searches the library; results come back in \
<tool_response>...</tool_response>.
<visit>document id or title</visit> reads a document.
<python>code</python> runs Python and returns what it prints.
<answer>short final answer</answer> ends the episode.
Write nothing outside these tags."""


def main_system_prompt() -> str:
  """The main agent's system prompt: its two actions and the tag format."""
  return _MAIN_SYSTEM


def sub_system_prompt() -> str:
  """The sub-agent's system prompt: its three actions and the tag format."""
  return _SUB_SYSTEM


def single_system_prompt() -> str:
  """The single agent's system prompt: every tool, the final answer and the tag format."""
  return _SINGLE_SYSTEM


# The fixed text that opens the user turns above, for tokenizers that give it one id each.
PROMPT_WORDS: tuple[str, ...] = ("Question: ", "Subtask: ", "\nContext: ")


def main_user_prompt(question: str) -> str:
  """The main agent's user turn for `question` (special strings escaped)."""
  return f"Question: {escape_specials(question)}"


def sub_user_prompt(subtask: str, context: str | None = None) -> str:
  """The sub-agent's user turn for a delegated `subtask` and its optional `context`."""
  text = f"Subtask: {escape_specials(subtask)}"
  if context:
    text += f"\nContext: {escape_specials(context)}"
  return text


def main_messages(question: str) -> list[dict[str, str]]:
  """[system, user] messages that start a main-agent episode."""
  return [{"role": "system", "content": main_system_prompt()},
          {"role": "user", "content": main_user_prompt(question)}]


def sub_messages(subtask: str, context: str | None = None) -> list[dict[str, str]]:
  """[system, user] messages that start a sub-agent episode."""
  return [{"role": "system", "content": sub_system_prompt()},
          {"role": "user", "content": sub_user_prompt(subtask, context)}]


def single_messages(question: str) -> list[dict[str, str]]:
  """[system, user] messages that start a single-agent episode (the main agent's user turn)."""
  return [{"role": "system", "content": single_system_prompt()},
          {"role": "user", "content": main_user_prompt(question)}]
