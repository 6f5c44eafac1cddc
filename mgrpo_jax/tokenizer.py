"""The tokenizer interface: what rollouts, losses and tests need from any tokenizer.

Two tokenizers implement it (`byte_tokenizer.ByteTokenizer`, `hf_tokenizer.HFTokenizer`), so the
code that holds one never asks which; `tokenizer_io.load_tokenizer` builds one from a config.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable


class Tokenizer(Protocol):
  """What the rest of mgrpo_jax needs from a tokenizer.

  `encode` never inserts special tokens (no BOS/EOS): callers build sequences explicitly, so
  the tokens a loss mask covers are exactly the tokens a policy produced. Messages are dicts
  with "role" (system, user, assistant or tool) and "content" (a string).
  """

  @property
  def vocab_size(self) -> int:
    """Number of token ids in use (not padded; see `padded_vocab_size`)."""

  @property
  def eos_id(self) -> int:
    """The id that ends an assistant turn (`<|im_end|>`)."""

  @property
  def pad_id(self) -> int:
    """The id used to pad batches."""

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Every id that should stop generation, `eos_id` first."""

  @property
  def special_ids(self) -> dict[str, int]:
    """Every added token (control tokens and single-token tags): string -> id."""

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special strings inside it become their single ids."""

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids`; with `skip_special`, control tokens are dropped (tags are kept)."""

  def render_chat(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool,
      *,
      enable_thinking: bool | None = None,
  ) -> str:
    """Qwen3 chat-format string of `messages` (see `render_qwen3_chat`)."""

  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, Any]],
      *,
      add_generation_prompt: bool,
      enable_thinking: bool | None = None,
  ) -> list[int]:
    """Token ids of `render_chat(messages, ...)`; im_start/im_end are single ids."""
    text = self.render_chat(messages, add_generation_prompt, enable_thinking=enable_thinking)
    return self.encode(text)

  def token_id(self, token: str) -> int:
    """The id of `token` when it is a single token; KeyError otherwise."""
    if token in self.special_ids:
      return self.special_ids[token]
    ids = self.encode(token)
    if len(ids) != 1:
      raise KeyError(f"{token!r} is not a single token (it encodes to {ids})")
    return ids[0]

  def padded_vocab_size(self, multiple: int = 128) -> int:
    """`vocab_size` rounded up to `multiple`, for embedding tables that shard evenly."""
    return -(-self.vocab_size // multiple) * multiple
