"""A tokenizer that needs no files: UTF-8 bytes, then the special strings and a world's words."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from mgrpo_jax.chat_format import (CONTROL_TOKENS, ENDOFTEXT, IM_END, PAD, PROTOCOL_TAGS,
                                   render_qwen3_chat)
from mgrpo_jax.tokenizer import Tokenizer


def words_pattern(words: Sequence[str]) -> re.Pattern:
  """Finds `words` in text, longest first; a word that begins (ends) with a letter or digit
  only where it does not continue one before (after) it.

  One alternation of every word, longest first, means the same, but `re` tries each word at
  each position of the text: 3.7 ms a page for the CPU demo's 287 words, against 0.04 ms
  here (benchmarks/results/tokenizer-words-cpu.json, a loaded 2-core machine). The words
  share their prefixes (a trie), so a position costs one character test unless a word
  starts there; both find the same matches (`tests/test_tokenizer.py`).
  """
  trie: dict = {}
  for w in words:
    node = trie
    for ch in w:
      node = node.setdefault(ch, {})
    node[""] = w  # The word that ends here.

  def pattern(node: dict, first: bool) -> str:
    alternatives = []
    for ch in sorted(k for k in node if k):
      head = re.escape(ch)
      if first and ch.isalnum():  # Not after a letter or digit ([^\W_]: \w less "_").
        head += f"(?<![^\\W_]{re.escape(ch)})"
      child = node[ch]
      # No branch and no word ends: one literal, so the pattern nests once per branch, not
      # once per character.
      while len(child) == 1 and "" not in child:
        (ch, child), = child.items()
        head += re.escape(ch)
      alternatives.append(head + pattern(child, False))
    # The word that ends here comes after its longer continuations, so backtracking gives the
    # longest word whose boundary holds, as the alternation does. Not before a letter or digit.
    if "" in node:
      alternatives.append("(?![^\\W_])" if node[""][-1].isalnum() else "")
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"

  return re.compile(pattern(trie, True))


class ByteTokenizer(Tokenizer):
  """A tokenizer that needs no files: ids 0..255 are UTF-8 bytes, then the special strings.

  Ids 256.. are `CONTROL_TOKENS` (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
  ``<pad>``) followed by `tags` (default `PROTOCOL_TAGS`). Special strings inside text encode
  to their single id (longest match wins), so decode(encode(text)) == text for any text
  without lone surrogates.

  `words` (after the specials) are ordinary text with an id of their own, the way a tokenizer
  trained on a corpus gives its frequent names and phrases one token: a word encodes to its
  id wherever it does not continue a longer word or number (so "Avel" is not found inside
  "Aveland"; a word that ends in a space or punctuation needs no boundary there), longest
  first, and it is neither escaped in tool replies nor skipped in decoding, unlike the
  specials. The CPU demo gives the world's names, question stems and page phrases one id
  each (`tokenizer="byte+world"`, `mgrpo_jax.tasks.tokenizer_words`).
  """

  def __init__(self, tags: Sequence[str] = PROTOCOL_TAGS, words: Sequence[str] = ()):
    specials = CONTROL_TOKENS + tuple(tags)
    if len(set(specials)) != len(specials) or not all(specials):
      raise ValueError(f"special strings must be non-empty and distinct: {specials}")
    words = tuple(words)
    bad = [w for w in words if not w.strip() or w in specials]
    bad += sorted(w for w in set(words) if words.count(w) > 1)
    if bad:
      raise ValueError(f"words must be distinct, not blank and not special strings; "
                       f"bad: {bad[:5]}")
    self._special_ids = {s: 256 + i for i, s in enumerate(specials)}
    self._specials = specials
    self._words = words
    self._word_ids = {w: 256 + len(specials) + i for i, w in enumerate(words)}
    # Longest first: regex alternation takes the first alternative that matches, so this
    # gives longest-match when one special string is a prefix of another.
    by_length = sorted(specials, key=len, reverse=True)
    self._special_re = re.compile("|".join(re.escape(s) for s in by_length))
    self._word_re = words_pattern(words) if words else None

  @property
  def vocab_size(self) -> int:
    return 256 + len(self._specials) + len(self._words)

  @property
  def words(self) -> tuple[str, ...]:
    return self._words

  @property
  def eos_id(self) -> int:
    return self._special_ids[IM_END]

  @property
  def pad_id(self) -> int:
    return self._special_ids[PAD]

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self._special_ids[IM_END], self._special_ids[ENDOFTEXT])

  @property
  def special_ids(self) -> dict[str, int]:
    return dict(self._special_ids)

  def encode(self, text: str) -> list[int]:
    """UTF-8 bytes of `text`, with each special string replaced by its single id."""
    ids: list[int] = []
    start = 0
    for match in self._special_re.finditer(text):
      self._encode_plain(text[start:match.start()], ids)
      ids.append(self._special_ids[match.group()])
      start = match.end()
    self._encode_plain(text[start:], ids)
    return ids

  def _encode_plain(self, text: str, ids: list[int]) -> None:
    """Appends the ids of `text` (no specials in it): words, else UTF-8 bytes."""
    start = 0
    for match in self._word_re.finditer(text) if self._word_re else ():
      ids.extend(text[start:match.start()].encode("utf-8"))
      ids.append(self._word_ids[match.group()])
      start = match.end()
    ids.extend(text[start:].encode("utf-8"))

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids`; invalid UTF-8 (a model's stray bytes) decodes to U+FFFD.

    Ids past the vocabulary (a model whose embedding is padded can sample them) also
    decode to U+FFFD: never an exception on model output, and never invisible text.
    """
    parts: list[str] = []
    run = bytearray()
    for i in ids:
      i = int(i)
      if 0 <= i < 256:
        run.append(i)
        continue
      if not 256 <= i < self.vocab_size:
        parts.append(run.decode("utf-8", errors="replace") + "\ufffd")
        run.clear()
        continue
      if i >= 256 + len(self._specials):  # A word is text: its bytes join the run.
        run.extend(self._words[i - 256 - len(self._specials)].encode("utf-8"))
        continue
      # Decode byte runs only between specials, so a multi-byte character is never split.
      parts.append(run.decode("utf-8", errors="replace"))
      run.clear()
      special = self._specials[i - 256]
      if not (skip_special and special in CONTROL_TOKENS):
        parts.append(special)
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)

  def render_chat(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool,
      *,
      enable_thinking: bool | None = None,
  ) -> str:
    return render_qwen3_chat(messages, add_generation_prompt, enable_thinking=enable_thinking)
