"""The M-GRPO agent protocol: turn grammar, its strict parser and its renderer.

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
`stop_token_ids`); every tag is a single token in both tokenizers (`TAGS` is
`chat_format.PROTOCOL_TAGS`).

r_format is checked by `agents.validator`, the tool turn a rollout appends is derived by
`agents.continuation`, and the prompts that open an episode live in `agents.prompts`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable

from mgrpo_jax import chat_format as cf
from mgrpo_jax import tokenizer as tk

__all__ = [
  "ACTIONS",
  "END_OF_TURN",
  "FINAL_ACTION",
  "ROLES",
  "TAGS",
  "Turn",
  "check_role",
  "escape_specials",
  "parse_turn",
  "render_action",
  "stop_strings",
  "stop_token_ids",
  "strip_end_of_turn",
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
# no action of its own, so the tags stay those of main and sub).
_ALL_ACTIONS = {a: next(r for r in ROLES if a in ACTIONS[r]) for r in ROLES for a in ACTIONS[r]}
_TAG_NAMES = ("think", *_ALL_ACTIONS, "context", "tool_response")
# Every tag string of the protocol: the tokenizers' single-token tags, in their id order.
TAGS = cf.PROTOCOL_TAGS
# A tag on one side only would lex as text here, or encode as several tokens there.
if set(TAGS) != {f"<{s}{n}>" for n in _TAG_NAMES for s in ("", "/")}:
  raise ValueError(f"the grammar's tags {_TAG_NAMES} are not chat_format.PROTOCOL_TAGS {TAGS}")
END_OF_TURN = (cf.IM_END, cf.ENDOFTEXT)

# One lexer for tags and control tokens; everything between matches is text.
_TOKEN_RE = re.compile(
  "<(/?)(" + "|".join(_TAG_NAMES) + ")>|(" + "|".join(re.escape(c) for c in cf.CONTROL_TOKENS) + ")"
)
_SNIPPET = 40  # characters of offending text quoted in an error


def check_role(role: str) -> None:
  """Raises ValueError unless `role` is one of `ROLES`."""
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
  check_role(role)
  if not isinstance(text, str):
    return _fail(f"turn is a {type(text).__name__}, not a str")
  return _parse(_lex(strip_end_of_turn(text)), role)


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
  targets = sorted({*TAGS, *cf.CONTROL_TOKENS, *extra}, key=len, reverse=True)
  return re.compile("|".join(re.escape(t) for t in targets))


def tool_message(content: str, *, specials: Iterable[str] = ()) -> dict[str, str]:
  """The tool message that answers a delegate, python, search or visit action.

  Its content is `content` with special strings escaped (`escape_specials`) but NOT wrapped:
  Qwen3's chat template itself renders a "tool" message as
  ``<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n``, so
  wrapping here would nest two <tool_response> blocks.
  """
  return {"role": "tool", "content": escape_specials(content, specials)}



# --------------------------------------------------------------------------------------- stops


def stop_strings(role: str) -> tuple[str, ...]:
  """Where generation of a `role` turn stops: its closing action tags, then end of turn."""
  check_role(role)
  return tuple(f"</{a}>" for a in ACTIONS[role]) + END_OF_TURN


def stop_token_ids(tokenizer: tk.Tokenizer, role: str) -> tuple[int, ...]:
  """Ids of `stop_strings(role)` that are tags, then `tokenizer.stop_ids`.

  Raises KeyError when a closing tag is not a single token of `tokenizer`.
  """
  tags = [tokenizer.token_id(s) for s in stop_strings(role) if s not in END_OF_TURN]
  return tuple(dict.fromkeys([*tags, *tokenizer.stop_ids]))
