"""What a tool reply appends to a live sequence, derived from the tokenizer's chat template.

A live rollout is the generation prompt, then for each turn the generated
tokens, the end-of-turn token and `continuation_text` (the tool turn and the next generation
prompt), appended and never re-rendered; see `continuation_text` for why re-rendering a whole
conversation with the template does not in general reproduce the live sequence.
"""

from __future__ import annotations

from mgrpo_jax import tokenizer as tk
from mgrpo_jax.agents.protocol import tool_message

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
