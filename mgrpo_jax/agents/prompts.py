"""The prompts that open an episode of each role: system prompts and user turns."""

from __future__ import annotations

from mgrpo_jax.agents.protocol import escape_specials

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
