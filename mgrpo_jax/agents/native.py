"""The native protocol: agents call their tools in the checkpoint's own tool-calling format.

`config.protocol = "native"` (the default "tags" is `protocol.py`'s grammar). Each role's tools
are declared as JSON schemas (`tools`) that the checkpoint's chat template renders into the
system turn (`render_chat`: `apply_chat_template(messages, tools=...)`). A turn is

    turn := ws [ "<think>" text "</think>" ] ( call_turn | final_turn ) ws
    call_turn  := [ text ] "<tool_call>" json "</tool_call>"
    final_turn := text                      (non-empty, no <tool_call>)

where `json` is ``{"name": <tool>, "arguments": {<argument>: <string>, ...}}``, as Qwen3 was
post-trained to write it. The tools: "delegate" (main; arguments `subtask` and optional
`context`), "python" (main and single; `code`), "search" (sub and single; `query`) and
"visit" (sub and single; `page`, a document id or title). A final turn is the role's final
action ("answer" for main and single, "result" for sub) with the message text, stripped,
as its argument; it ends the episode. Text before a call is the model's preamble: allowed
and not read. The environment answers a call with a `tool` message, which the template
renders as a user turn holding ``<tool_response>...</tool_response>``.

One call per turn. A turn holding several `<tool_call>` blocks is refused as a format failure
("2 tool calls in one turn"), not run in order: the engine answers each turn with one tool
message, an episode's observations stay one per turn in both protocols, and the scripted
experts and r_format read them the same way. Any other bad call is a format failure too,
with its reason recorded in the episode (`EpisodeValidator.failure`): malformed JSON, a name
that is not one of the role's tools, a missing, unexpected, empty or non-string argument,
text after the call, an unclosed call, a stray control token, a misplaced think block.

`parse_turn` returns the same `protocol.Turn` as the tag grammar (action, argument, context,
think), so the engine, the tools and the rewards see no difference; `from_tags` renders a
tag turn (a scripted expert's) as the native turn that means the same.

Token-in/token-out: a live sequence is the generation prompt rendered with the tools, then
per turn the generated tokens, the end-of-turn token and `continuation_text` (the tool turn
and the next generation prompt), appended and never re-rendered. It equals what the
template renders for the conversation (`conversation_messages`) wherever the template
allows it: every turn in canonical form (`render_turn`: the think block as
``<think>\\n...\\n</think>\\n\\n``, the call's JSON as the template's `tojson` writes it),
and not for the last assistant message or earlier reasoning that the template rewrites
(see `continuation.continuation_text`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping, Sequence

from mgrpo_jax import chat_format as cf
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.agents import continuation, prompts, protocol, validator

PROTOCOLS = ("tags", "native")
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"

# Each tool's JSON schema (the OpenAI function format that HF chat templates render).
_SCHEMAS = {
  "delegate": ("Give a subtask to the sub-agent, which researches it with a document library "
               "and reports back.",
               {"subtask": "The subtask, as a self-contained question.",
                "context": "What the sub-agent needs to know (optional)."}, ("subtask",)),
  "python": ("Run Python code and return what it prints.",
             {"code": "The Python program."}, ("code",)),
  "search": ("Search the document library.", {"query": "The search query."}, ("query",)),
  "visit": ("Read a document of the library.", {"page": "The document's id or title."},
            ("page",)),
}
# The argument a tool's turn carries as `Turn.argument` (delegate's context is `Turn.context`).
_MAIN_ARGUMENT = {"delegate": "subtask", "python": "code", "search": "query", "visit": "page"}
ROLE_TOOLS = {role: tuple(a for a in protocol.ACTIONS[role] if a in _SCHEMAS)
              for role in protocol.ROLES}


def tool_schema(name: str) -> dict:
  """The JSON schema of one tool, as `apply_chat_template(tools=...)` takes it."""
  description, arguments, required = _SCHEMAS[name]
  return {"type": "function", "function": {
      "name": name, "description": description,
      "parameters": {"type": "object",
                     "properties": {a: {"type": "string", "description": d}
                                    for a, d in arguments.items()},
                     "required": list(required)}}}


def tools(role: str) -> list[dict]:
  """The JSON schemas of `role`'s tools (its final action is a message, not a tool)."""
  return [tool_schema(n) for n in ROLE_TOOLS[role]]


# ------------------------------------------------------------------------------------ parsing

_THINK_RE = re.compile(r"\s*<think>(.*?)</think>", re.S)
_CONTROL_RE = re.compile("|".join(re.escape(c) for c in cf.CONTROL_TOKENS))


def _fail(error: str) -> protocol.Turn:
  return protocol.Turn(ok=False, error=error)


def _call(body: str, role: str) -> protocol.Turn | str:
  """The turn of one call's JSON body, or why it is not a valid call of `role`."""
  try:
    call = json.loads(body)
  except json.JSONDecodeError as e:
    return f"malformed tool call JSON ({e.msg} at character {e.pos})"
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    return "a tool call must be a JSON object with a string \"name\""
  name, arguments = call["name"], call.get("arguments", {})
  if set(call) - {"name", "arguments"}:
    return f"tool call has unexpected keys {sorted(set(call) - {'name', 'arguments'})}"
  if name not in ROLE_TOOLS[role]:
    return (f"unknown tool {name!r} for the {role} agent (its tools: "
            f"{', '.join(ROLE_TOOLS[role])})")
  if not isinstance(arguments, dict):
    return f"the arguments of {name!r} must be a JSON object"
  _, declared, required = _SCHEMAS[name]
  for a in required:
    if a not in arguments:
      return f"tool {name!r} is missing argument {a!r}"
  for a, v in arguments.items():
    if a not in declared:
      return f"tool {name!r} has no argument {a!r}"
    if not isinstance(v, str):
      return f"argument {a!r} of {name!r} is a {type(v).__name__}, not a string"
    if not v.strip():
      return f"argument {a!r} of {name!r} is empty"
  context = arguments.get("context")
  return protocol.Turn(ok=True, action=name, argument=arguments[_MAIN_ARGUMENT[name]].strip(),
                       context=None if context is None else context.strip())


def parse_turn(text: Any, role: str) -> protocol.Turn:
  """Parses one generated turn of `role` in the native format (see the module docstring).

  Never raises on any `text`; an unknown `role` raises ValueError.
  """
  if role not in protocol.ROLES:
    raise ValueError(f"role must be one of {protocol.ROLES}, got {role!r}")
  if not isinstance(text, str):
    return _fail(f"turn is a {type(text).__name__}, not a str")
  text = protocol.strip_end_of_turn(text)
  m = _CONTROL_RE.search(text)
  if m:
    return _fail(f"stray {m.group()} inside the turn")
  think = None
  m = _THINK_RE.match(text)
  if m:
    think, text = m.group(1).strip(), text[m.end():]
  if "<think>" in text or "</think>" in text:
    return _fail("a think block must come first, once")
  n = text.count(TOOL_CALL)
  if n == 0:
    if END_TOOL_CALL in text:
      return _fail(f"{END_TOOL_CALL} without {TOOL_CALL}")
    if not text.strip():
      return _fail("empty final message (no tool call and no text)")
    return protocol.Turn(ok=True, action=protocol.FINAL_ACTION[role], argument=text.strip(),
                         think=think)
  if n > 1:
    return _fail(f"{n} tool calls in one turn (one call per turn)")
  _, _, rest = text.partition(TOOL_CALL)
  body, closed, after = rest.partition(END_TOOL_CALL)
  if not closed:
    return _fail(f"unclosed {TOOL_CALL}")
  if after.strip():
    return _fail(f"text after the tool call: {after.strip()[:40]!r}")
  turn = _call(body, role)
  if isinstance(turn, str):
    return _fail(turn)
  return protocol.Turn(ok=True, action=turn.action, argument=turn.argument,
                       context=turn.context, think=think)


class EpisodeValidator(validator.EpisodeValidator):
  """r_format of a native episode: `validator.EpisodeValidator` with the native parser."""

  def __init__(self, role: str, max_turns: int):
    super().__init__(role, max_turns, parse=parse_turn)


# ---------------------------------------------------------------------------------- rendering


def _arguments(action: str, argument: str, context: str | None) -> dict[str, str]:
  args = {_MAIN_ARGUMENT[action]: argument}
  if context is not None:
    args["context"] = context
  return args


def _call_text(name: str, arguments: Mapping[str, str]) -> str:
  # As Qwen3's template writes a call: its `tojson` is json.dumps(ensure_ascii=False).
  return (f'{TOOL_CALL}\n{{"name": "{name}", "arguments": '
          f'{json.dumps(dict(arguments), ensure_ascii=False)}}}\n{END_TOOL_CALL}')


def render_turn(action: str, argument: str, *, think: str | None = None,
                context: str | None = None) -> str:
  """A well-formed native turn (an expert's or SFT target's), without end-of-turn, in the
  canonical form the template re-renders unchanged. `parse_turn` gives the inputs back."""
  if context is not None and action != "delegate":
    raise ValueError(f"only delegate carries a context, not {action!r}")
  argument = argument.strip()
  if not argument:
    raise ValueError(f"empty argument for {action!r}")
  head = ""
  if think is not None:
    if not think.strip():
      raise ValueError("empty think (pass None for no think block)")
    head = f"<think>\n{think.strip()}\n</think>\n\n"
  if action in ("answer", "result"):
    return head + argument
  if action not in _SCHEMAS:
    raise ValueError(f"unknown action {action!r}")
  return head + _call_text(action, _arguments(action, argument,
                                              None if context is None else context.strip()))


def from_tags(text: str, role: str) -> str:
  """The native turn that means what the tag turn `text` of `role` means (a scripted expert
  speaks tags; its native twin makes the same decisions). Raises ValueError on an invalid
  tag turn."""
  turn = protocol.parse_turn(text, role)
  if not turn.ok:
    raise ValueError(f"not a valid {role} turn: {turn.error}")
  return render_turn(turn.action, turn.argument, think=turn.think, context=turn.context)


def assistant_message(turn_text: str) -> dict[str, Any]:
  """The assistant message of a turn, as a chat template takes it: content, and the call as
  `tool_calls` (the template renders it back as `<tool_call>` JSON)."""
  text = protocol.strip_end_of_turn(turn_text)
  if TOOL_CALL not in text:
    return {"role": "assistant", "content": text}
  content, _, rest = text.partition(TOOL_CALL)
  call = json.loads(rest.partition(END_TOOL_CALL)[0])
  if content.endswith("\n") and not content.endswith("</think>\n\n"):
    content = content[:-1]  # The template writes "\n" between content and the call.
  return {"role": "assistant", "content": content, "tool_calls": [
      {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}


def conversation_messages(messages: Sequence[Mapping], turns: Sequence[str],
                          replies: Sequence[str], *, specials: Iterable[str] = ()) -> list[dict]:
  """The conversation of an episode as messages: its prompt, then each turn and the tool
  message of its reply (`replies` may be one shorter than `turns`)."""
  out = [dict(m) for m in messages]
  for i, turn in enumerate(turns):
    out.append(assistant_message(turn))
    if i < len(replies):
      out.append(protocol.tool_message(replies[i], specials=specials))
  return out


_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n"
               "<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name "
               "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_text(tools_: Sequence[Mapping]) -> str:
  """The declaration of `tools_` that Qwen3's template writes into the system turn."""
  lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools_)
  return f"{_TOOLS_HEAD}{lines}{_TOOLS_TAIL}"


def render_qwen3_tools_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                            tools_: Sequence[Mapping] | None = None, *,
                            enable_thinking: bool | None = None) -> str:
  """Renders messages, tools and tool calls exactly as Qwen3's chat template does (the byte
  tokenizer's template; `chat_format.render_qwen3_chat` without tools and calls)."""
  messages = [dict(m) for m in messages]
  head = ""
  if tools_:
    system = messages.pop(0)["content"] + "\n\n" if messages and messages[0]["role"] == "system" \
        else ""
    head = f"{cf.IM_START}system\n{system}{tools_text(tools_)}{cf.IM_END}\n"
  for m in messages:
    calls = m.pop("tool_calls", None)
    if m["role"] != "assistant" or not calls:
      continue
    # The template writes the calls after the (think-stripped) content, "\n" apart.
    content = m["content"]
    visible = content.split("</think>")[-1].lstrip("\n") if "</think>" in content else content
    text = "\n".join(_call_text(c.get("function", c)["name"], c.get("function", c)["arguments"])
                     for c in calls)
    m["content"] = content + ("\n" if visible else "") + text
  return head + cf.render_qwen3_chat(messages, add_generation_prompt,
                                     enable_thinking=enable_thinking)


# Stands for an argument's value in `vocabulary`: JSON writes it unchanged, and no fixed
# string of the protocol holds it.
_VALUE = "\u2063"


def vocabulary() -> tuple[str, ...]:
  """The native protocol's fixed strings, as this module renders them: each role's tool
  declarations (`tools_text`), each tool's call up to its argument's value, the text between
  delegate's subtask and context, and the call's end (`render_turn`).

  A byte tokenizer gives them one id each in a native run (`tasks.tokenizer_words`), as a
  tokenizer trained on native traces would make them tokens and as it gives the tags their
  ids: a native prompt and call then cost what the tag ones do, not a thousand bytes of
  schemas per prompt.
  """
  words = [tools_text(tools(role)) for role in protocol.ROLES]
  for name in _SCHEMAS:
    context = _VALUE if name == "delegate" else None
    words += _call_text(name, _arguments(name, _VALUE, context)).split(_VALUE)
  return tuple(dict.fromkeys(words))


def render_chat(tokenizer: tk.Tokenizer, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool, role: str, *,
                enable_thinking: bool | None = None) -> str:
  """`messages` with `role`'s tools, rendered by the tokenizer's own chat template (the byte
  tokenizer: Qwen3's, `render_qwen3_tools_chat`). Raises continuation.TemplateError when the
  template does not render tools."""
  hf = getattr(tokenizer, "hf_tokenizer", None)
  if hf is None:
    return render_qwen3_tools_chat(messages, add_generation_prompt, tools(role),
                                   enable_thinking=enable_thinking)
  kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
  try:
    text = hf.apply_chat_template([dict(m) for m in messages], tools=tools(role),
                                  tokenize=False, add_generation_prompt=add_generation_prompt,
                                  **kwargs)
  except Exception as e:  # Jinja's raise_exception, or a template that cannot take tools.
    raise continuation.TemplateError(
        f"config.protocol='native' needs a chat template that renders tools and tool "
        f"calls; this one fails: {e}") from e
  if '"name": "' + ROLE_TOOLS[role][0] + '"' not in text:
    raise continuation.TemplateError("config.protocol='native' needs a chat template that renders "
                                 "tools; this one leaves them out of the prompt.")
  return text


def prompt_ids(tokenizer: tk.Tokenizer, messages: Sequence[Mapping], role: str) -> list[int]:
  """Token ids of an episode's generation prompt: `messages` with `role`'s tools."""
  return tokenizer.encode(render_chat(tokenizer, messages, True, role))


def continuation_text(tokenizer: tk.Tokenizer, tool_content: str, role: str, *,
                      enable_thinking: bool | None = None) -> str:
  """The text a tool reply adds to a live native sequence after the turn's end of turn: the
  tool turn and the next generation prompt, derived from the template as
  `continuation.continuation_text` derives it, for a call turn with and without a think block.
  Raises continuation.TemplateError unless both are prefix-stable and give the same text."""
  messages = [{"role": "system", "content": "probe system"}, {"role": "user", "content": "q"}]
  prompt = render_chat(tokenizer, messages, True, role)
  end_of_turn = tokenizer.decode([tokenizer.eos_id])
  tool = protocol.tool_message(tool_content, specials=tokenizer.special_ids)
  name = ROLE_TOOLS[role][0]
  deltas = []
  for think in ("probe reasoning", None):
    reply = render_turn(name, "probe", think=think)
    live = prompt + reply + end_of_turn
    full = render_chat(tokenizer, messages + [assistant_message(reply), tool], True, role,
                       enable_thinking=enable_thinking)
    if not full.startswith(live):
      raise continuation.TemplateError(
          "the chat template is not prefix-stable for tool calls: after a tool message it "
          f"renders the call differently.\nlive sequence: {live!r}\ntemplate render: {full!r}")
    deltas.append(full[len(live):])
  if deltas[0] != deltas[1]:
    raise continuation.TemplateError(f"the tool turn depends on the call before it: {deltas}")
  return deltas[0]


def continuation_ids(tokenizer: tk.Tokenizer, tool_content: str, role: str, *,
                     enable_thinking: bool | None = None) -> list[int]:
  """Token ids of `continuation_text`, to append after the end-of-turn token."""
  return tokenizer.encode(continuation_text(tokenizer, tool_content, role,
                                            enable_thinking=enable_thinking))


def stop_strings(role: str) -> tuple[str, ...]:
  """Where a native turn stops: the end of its call, or the end of turn (a final message)."""
  del role  # Every role stops alike.
  return (END_TOOL_CALL, *protocol.END_OF_TURN)


def stop_token_ids(tokenizer: tk.Tokenizer, role: str) -> tuple[int, ...]:
  """Ids of `stop_strings`; KeyError when `</tool_call>` is not one token (then generation
  stops on text)."""
  del role
  return tuple(dict.fromkeys([tokenizer.token_id(END_TOOL_CALL), *tokenizer.stop_ids]))


# ------------------------------------------------------------------------------------ prompts

_MAIN_SYSTEM = ("You are the main agent. Answer the question; a sub-agent can research "
                "subtasks for you (the delegate tool). Call one tool per turn. When you know "
                "the answer, reply with the short final answer alone, without a tool call.")
_SUB_SYSTEM = ("You are a sub-agent doing one subtask for the main agent, with a document "
               "library (the search and visit tools). Call one tool per turn. When you are "
               "done, reply with your report for the main agent, without a tool call.")
_SINGLE_SYSTEM = ("You are a research agent with a document library (the search and visit "
                  "tools) and Python. Answer the question yourself. Call one tool per turn. "
                  "When you know the answer, reply with the short final answer alone, without "
                  "a tool call.")


def main_messages(question: str) -> list[dict[str, str]]:
  """[system, user] messages that start a native main-agent episode."""
  return [{"role": "system", "content": _MAIN_SYSTEM},
          {"role": "user", "content": prompts.main_user_prompt(question)}]


def sub_messages(subtask: str, context: str | None = None) -> list[dict[str, str]]:
  """[system, user] messages that start a native sub-agent episode."""
  return [{"role": "system", "content": _SUB_SYSTEM},
          {"role": "user", "content": prompts.sub_user_prompt(subtask, context)}]


def single_messages(question: str) -> list[dict[str, str]]:
  """[system, user] messages that start a native single-agent episode."""
  return [{"role": "system", "content": _SINGLE_SYSTEM},
          {"role": "user", "content": prompts.main_user_prompt(question)}]


# ------------------------------------------------------------------- either protocol, by name


class Dialect:
  """What the rollout engine asks of a protocol, for "tags" (`protocol.py`) or "native"."""

  def __init__(self, name: str):
    if name not in PROTOCOLS:
      raise ValueError(f"config.protocol={name!r}; expected one of {PROTOCOLS}.")
    self.name = name
    self.native = name == "native"

  def messages(self, role: str, text: str, context: str | None = None) -> list[dict]:
    """[system, user] messages that start a `role` episode on a question or subtask."""
    module = globals() if self.native else vars(prompts)
    if role == "sub":
      return module["sub_messages"](text, context)
    return module[f"{role}_messages"](text)

  def prompt_ids(self, tokenizer: tk.Tokenizer, messages, role: str) -> list[int]:
    if self.native:
      return prompt_ids(tokenizer, messages, role)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

  def validator(self, role: str, max_turns: int) -> validator.EpisodeValidator:
    cls = EpisodeValidator if self.native else validator.EpisodeValidator
    return cls(role, max_turns)

  def continuation_ids(self, tokenizer: tk.Tokenizer, reply: str, role: str) -> list[int]:
    if self.native:
      return continuation_ids(tokenizer, reply, role)
    return continuation.continuation_ids(tokenizer, reply)

  def stops(self, tokenizer: tk.Tokenizer, role: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop token ids, stop strings): the closing tags as ids where each is one token, else
    matched on text."""
    ids_fn, strings_fn = ((stop_token_ids, stop_strings) if self.native
                          else (protocol.stop_token_ids, protocol.stop_strings))
    try:
      return ids_fn(tokenizer, role), ()
    except KeyError:
      return tuple(tokenizer.stop_ids), strings_fn(role)

  def from_tags(self, text: str, role: str) -> str:
    """A scripted expert's tag turn in this protocol."""
    return from_tags(text, role) if self.native else text
