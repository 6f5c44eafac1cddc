"""Agents: the M-GRPO message protocol, the rollout engine's episodes and the scripted experts.

  protocol      turn grammar, its strict parser and renderer, tags and stops
  native        the checkpoint's own tool calls (config.protocol="native"): schemas, parser
  validator     r_format of an episode, one turn at a time
  continuation  the tool turn a rollout appends, derived from the chat template
  prompts       system prompts and user turns that open an episode
  rollout       episodes as state machines driven by the engine
  experts, qa_experts   scripted policies (SFT targets, evaluation baselines)
"""
