"""Qwen3's chat format: its special strings, the protocol's tag vocabulary and the renderer.

Every tokenizer speaks ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; `render_qwen3_chat` and
its jinja twin `QWEN3_CHAT_TEMPLATE` write it for tokenizers that carry no template of their own.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<pad>"

# Control tokens: dropped by `decode(..., skip_special=True)`, like HF's special tokens.
CONTROL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, PAD)

# The role line that opens every chat turn ("<|im_start|>user\n"): plain text, which a tokenizer
# trained on chats gives one token each (`byte+world`).
ROLE_WORDS: tuple[str, ...] = ("system\n", "user\n", "assistant\n")

# Agent-protocol tags, one token each so a tiny model emits a tag in one step. They are content,
# not control (Qwen3 likewise keeps `<think>` as a non-special added token), so decoding with
# skip_special keeps them. Append only: a tag's position fixes its id in ByteTokenizer. The
# protocol's grammar (`agents.protocol.TAGS` is this tuple) must name every tag here.
PROTOCOL_TAGS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<delegate>",
    "</delegate>",
    "<answer>",
    "</answer>",
    "<search>",
    "</search>",
    "<visit>",
    "</visit>",
    "<result>",
    "</result>",
    "<tool_response>",
    "</tool_response>",
    "<context>",
    "</context>",
    "<python>",
    "</python>",
)  # fmt: skip

_ROLES = ("system", "user", "assistant", "tool")
_EMPTY_THINK = "<think>\n\n</think>\n\n"


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
  for i, m in enumerate(messages):
    if m.get("role") not in _ROLES:
      raise ValueError(f"message {i}: role {m.get('role')!r} is not one of {_ROLES}")
    if not isinstance(m.get("content"), str):
      raise ValueError(f"message {i}: content must be a string, got {m.get('content')!r}")
    if m.get("tool_calls"):
      raise ValueError(f"message {i}: tool_calls are not supported by this chat format")


def _last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
  # The last user turn that is a real query, not tool output passed back as a user turn.
  for i in range(len(messages) - 1, -1, -1):
    m = messages[i]
    c = m["content"]
    if m["role"] == "user" and not (c.startswith("<tool_response>") and
                                    c.endswith("</tool_response>")):
      return i
  return len(messages) - 1


def _render_assistant(message: Mapping[str, Any], *, after_query: bool, last: bool) -> str:
  content = message["content"]
  reasoning = message.get("reasoning_content")
  if reasoning is None:
    reasoning = ""
    if "</think>" in content:
      reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
      content = content.split("</think>")[-1].lstrip("\n")
  # Qwen3 keeps a think block only for turns after the last query; earlier turns lose their
  # reasoning, and the final turn gets an (empty) block even when it had none.
  if after_query and (last or reasoning):
    body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
  else:
    body = content
  return f"{IM_START}assistant\n{body}{IM_END}\n"


def render_qwen3_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    *,
    enable_thinking: bool | None = None,
) -> str:
  """Renders messages exactly as Qwen3's chat template does when no tools are given.

  Each system or user turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Assistant turns
  follow Qwen3's think handling: a turn after the last user query that is the final message
  (or carries reasoning, as `reasoning_content` or a ``<think>...</think>`` prefix) renders as
  ``<|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}<|im_end|>\\n``;
  earlier assistant turns drop their reasoning. Consecutive "tool" messages share one user turn,
  each wrapped in ``\\n<tool_response>\\n...\\n</tool_response>``. The generation prompt is
  ``<|im_start|>assistant\\n``, followed by an empty think block when `enable_thinking` is False.

  Unlike Qwen3's template, which silently drops unknown roles, this raises ValueError on them,
  on non-string content and on `tool_calls` (function calling is not rendered).
  """
  messages = list(messages)
  _check_messages(messages)
  n = len(messages)
  last_query = _last_query_index(messages)
  parts = []
  if n and messages[0]["role"] == "system":
    parts.append(f"{IM_START}system\n{messages[0]['content']}{IM_END}\n")
  for i, m in enumerate(messages):
    role, content = m["role"], m["content"]
    if role == "user" or (role == "system" and i > 0):
      parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    elif role == "assistant":
      parts.append(_render_assistant(m, after_query=i > last_query, last=i == n - 1))
    elif role == "tool":
      if i == 0 or messages[i - 1]["role"] != "tool":
        parts.append(f"{IM_START}user")
      parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
      if i == n - 1 or messages[i + 1]["role"] != "tool":
        parts.append(f"{IM_END}\n")
  if add_generation_prompt:
    parts.append(f"{IM_START}assistant\n")
    if enable_thinking is False:
      parts.append(_EMPTY_THINK)
  return "".join(parts)


# A simplified Qwen3 chat template (the jinja twin of `render_qwen3_chat`). Qwen3's own template
# also renders a `tools` list into the system turn and assistant `tool_calls` as <tool_call>
# JSON; this one raises on both instead. For everything else its output is identical.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}{{ raise_exception('this chat template does not render tools') }}{% endif %}
{%- if messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(searching=true, last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.searching and message.role == 'user'
          and not (message.content.startswith('<tool_response>')
                   and message.content.endswith('</tool_response>')) %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is not string %}
        {{- raise_exception('message content must be a string') }}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.tool_calls %}
            {{- raise_exception('this chat template does not render tool_calls') }}
        {%- endif %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n')
                                       .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n')
                + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role != 'system' %}
        {{- raise_exception('unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
