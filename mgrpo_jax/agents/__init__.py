"""Agents: the M-GRPO message protocol (turn grammar, r_format validation, rendering, prompts)."""

from mgrpo_jax.agents import protocol
from mgrpo_jax.agents.protocol import (ACTIONS, FINAL_ACTION, ROLES, TAGS, EpisodeValidator,
                                       TemplateError, Turn, continuation_ids, continuation_text,
                                       format_ok, parse_turn, render_action, tool_message)

__all__ = [
  "ACTIONS", "FINAL_ACTION", "ROLES", "TAGS", "EpisodeValidator", "TemplateError", "Turn",
  "continuation_ids", "continuation_text", "format_ok", "parse_turn", "protocol",
  "render_action", "tool_message",
]
