"""Tokenizers: a Qwen3 HF tokenizer from a local directory, and a byte tokenizer needing no files.

Both speak Qwen3's chat format, ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, and share one
small interface (`Tokenizer`), so rollouts, losses and tests never ask which one they hold.
`write_test_hf_tokenizer` builds a real HF fast tokenizer directory offline, for tests and demos.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

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
# skip_special keeps them. Append only: a tag's position fixes its id in ByteTokenizer.
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


# ------------------------------------------------------------------------------- chat format


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

# ---------------------------------------------------------------------------- ByteTokenizer


def words_pattern(words: Sequence[str]) -> re.Pattern:
  """Finds `words` in text, longest first; a word that begins (ends) with a letter or digit
  only where it does not continue one before (after) it.

  One alternation of every word, longest first, means the same, but `re` tries each word at
  each position of the text: 3.7 ms a page for the CPU demo's 287 words, against 0.04 ms
  here (benchmarks/results/tokenizer-words-cpu.json, a loaded 2-core machine). The words
  share their prefixes (a trie), so a position costs one character test unless a word
  starts there. At a trie node the longer continuations come before the word that ends
  there, so backtracking gives the longest word whose boundary holds, as the alternation
  does (`tests/test_tokenizer.py` checks that both find the same matches). A run of
  characters without a branch is one literal: the pattern nests once per branch, not per
  character.
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
      while len(child) == 1 and "" not in child:  # No branch and no word ends: a literal.
        (ch, child), = child.items()
        head += re.escape(ch)
      alternatives.append(head + pattern(child, False))
    if "" in node:  # Not before a letter or digit.
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


# ------------------------------------------------------------------------------ HFTokenizer


def _check_tokenizer_dir(path: pathlib.Path) -> None:
  if not path.is_dir():
    raise FileNotFoundError(
        f"tokenizer directory {str(path)!r} does not exist (only local directories are "
        "loaded; nothing is downloaded)")
  present = {p.name for p in path.iterdir()}
  missing = [] if "tokenizer_config.json" in present else ["tokenizer_config.json"]
  if "tokenizer.json" not in present and not {"vocab.json", "merges.txt"} <= present:
    missing.append("tokenizer.json (or vocab.json + merges.txt)")
  if missing:
    raise FileNotFoundError(f"tokenizer directory {str(path)!r} is missing {', '.join(missing)}; "
                            f"it holds {sorted(present)}")


def _generation_eos_ids(path: pathlib.Path) -> list[int]:
  # Qwen3 stops on both <|im_end|> and <|endoftext|>; generation_config.json says which.
  config_file = path / "generation_config.json"
  if not config_file.exists():
    return []
  eos = json.loads(config_file.read_text()).get("eos_token_id")
  if eos is None:
    return []
  return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


class HFTokenizer(Tokenizer):
  """An HF tokenizer (with its chat template) loaded from a local directory.

  `eos_id` is ``<|im_end|>`` when the vocabulary has it (chat rollouts end there, even for a
  base checkpoint whose configured eos is ``<|endoftext|>``); `stop_ids` adds ``<|endoftext|>``
  and any eos ids in the directory's generation_config.json.
  """

  def __init__(self, directory: str | os.PathLike):
    path = pathlib.Path(directory)
    _check_tokenizer_dir(path)
    # Imported here: transformers takes seconds to import, and ByteTokenizer users need none.
    from transformers import AutoTokenizer

    self.directory = path
    self.hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not self.hf_tokenizer.chat_template:
      raise ValueError(f"tokenizer in {str(path)!r} has no chat template")
    added = self.hf_tokenizer.added_tokens_decoder
    self._special_ids = {token.content: i for i, token in sorted(added.items())}
    eos = self._special_ids.get(IM_END, self.hf_tokenizer.eos_token_id)
    if eos is None:
      raise ValueError(f"tokenizer in {str(path)!r} has neither {IM_END} nor an eos token")
    self._eos_id = int(eos)
    stops = [self._eos_id, self._special_ids.get(ENDOFTEXT), *_generation_eos_ids(path)]
    self._stop_ids = tuple(dict.fromkeys(s for s in stops if s is not None))
    pad = self.hf_tokenizer.pad_token_id
    self._pad_id = int(pad) if pad is not None else self._special_ids.get(ENDOFTEXT, eos)
    self._vocab_size = len(self.hf_tokenizer)

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._stop_ids

  @property
  def special_ids(self) -> dict[str, int]:
    return dict(self._special_ids)

  def encode(self, text: str) -> list[int]:
    return self.hf_tokenizer.encode(text, add_special_tokens=False)

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    return self.hf_tokenizer.decode(
        [int(i) for i in ids],
        skip_special_tokens=skip_special,
        # Cleanup would rewrite " ." to "." and break decode(encode(text)) == text.
        clean_up_tokenization_spaces=False,
    )

  def render_chat(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool,
      *,
      enable_thinking: bool | None = None,
  ) -> str:
    # Passed only when set: the template tests `enable_thinking is defined`.
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return self.hf_tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )


# -------------------------------------------------------------------- test tokenizer builder

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation
# runs, newlines and whitespace; each piece is then byte-level encoded.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_WORDS = (
    "the of and to in is that for it with as was on be by this are from at or an which "
    "question answer search result visit page agent main sub delegate context think tool "
    "response reward policy model token train step what who when where why how many year "
    "city river paper author number first last report summary code function return value "
    "def if else for while print import list dict str int sum len range True False None").split()
_UNICODE = ("café", "naïve", "Zürich", "東京", "北京大学", "Москва", "λ", "→", "✓", "😀")


def _synthetic_corpus(num_lines: int = 1500, seed: int = 0) -> list[str]:
  """Deterministic mixed text (prose, numbers, code, chat and tags) to train a small BPE."""
  rng = random.Random(seed)
  lines = []
  for _ in range(num_lines):
    words = rng.choices(_WORDS, k=rng.randint(3, 14))
    if rng.random() < 0.2:
      words.insert(rng.randrange(len(words) + 1), rng.choice(_UNICODE))
    sentence = " ".join(words).capitalize() + rng.choice(".?!:")
    kind = rng.randrange(4)
    if kind == 0:
      lines.append(f"{sentence} {rng.randint(0, 99999)} + {rng.random():.3f}")
    elif kind == 1:
      lines.append(f"def f(x):\n    return x * {rng.randint(2, 9)}  # {sentence}\n")
    elif kind == 2:
      tag = rng.choice(PROTOCOL_TAGS[::2])
      lines.append(f"{IM_START}user\n{sentence}{IM_END}\n{tag}{sentence}{tag[0]}/{tag[1:]}")
    else:
      lines.append(sentence)
  return lines


def write_test_hf_tokenizer(
    directory: str | os.PathLike,
    *,
    texts: Sequence[str] | None = None,
    vocab_size: int = 1024,
    tags: Sequence[str] = PROTOCOL_TAGS,
) -> pathlib.Path:
  """Writes a small, real HF fast tokenizer in Qwen3's format to `directory`, offline.

  A byte-level BPE with Qwen3's normalizer (NFC) and pre-tokenizer split, trained on `texts`
  (default: a generated corpus) up to `vocab_size` entries (all 256 bytes included, so any
  text encodes). Then, as in Qwen3, the added tokens follow the BPE ids: ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>`` as special tokens and `tags` as non-special ones; eos is
  ``<|im_end|>``, pad ``<|endoftext|>``, and the chat template is `QWEN3_CHAT_TEMPLATE`.
  `AutoTokenizer.from_pretrained(directory)` loads the result. Returns the directory.
  """
  # Imported here: only test and demo code builds tokenizers.
  from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import trainers
  from transformers import PreTrainedTokenizerFast

  raw = RawTokenizer(models.BPE())
  raw.normalizer = normalizers.NFC()
  raw.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  raw.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  raw.train_from_iterator(_synthetic_corpus() if texts is None else list(texts), trainer)
  # normalized=False so NFC never rewrites a special string before it is matched.
  controls = (ENDOFTEXT, IM_START, IM_END)  # Qwen3 has no <pad>: it pads with <|endoftext|>.
  raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
  raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])

  hf = PreTrainedTokenizerFast(
      tokenizer_object=raw,
      eos_token=IM_END,
      pad_token=ENDOFTEXT,
      chat_template=QWEN3_CHAT_TEMPLATE,
      clean_up_tokenization_spaces=False,
      model_max_length=131072,  # Qwen3's context length.
  )
  path = pathlib.Path(directory)
  path.mkdir(parents=True, exist_ok=True)
  hf.save_pretrained(str(path))
  return path


# Byte tokenizers with a generated world's words (`mgrpo_jax.mgrpo.tasks.tokenizer_words`).
WORLD_SPECS = ("byte+names", "byte+world", "byte+phrases", "byte+phrases+ids")


def load_tokenizer(spec: str | os.PathLike, *, words: Sequence[str] = ()) -> Tokenizer:
  """"byte" -> ByteTokenizer(); "byte+names", "byte+world", "byte+phrases" or
  "byte+phrases+ids" -> ByteTokenizer(words=words) (a world's names; its names and phrases;
  its phrases only; its phrases and doc ids, one id each: picked by
  `mgrpo_jax.mgrpo.tasks.tokenizer_words`); anything else is a local
  directory -> HFTokenizer."""
  if str(spec) == "byte":
    return ByteTokenizer()
  if str(spec) in WORLD_SPECS:
    if not words:
      raise ValueError(f'tokenizer "{spec}" needs the words (words=...) of a world')
    return ByteTokenizer(words=words)
  return HFTokenizer(spec)


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds an HF tokenizer (what `HFTokenizer` loads)."""
  try:
    _check_tokenizer_dir(pathlib.Path(directory))
  except FileNotFoundError:
    return False
  return True


def resolve_spec(spec: str, checkpoint: str | os.PathLike = "") -> str:
  """The tokenizer a config means: `spec` when it names one, else (`spec` "") the checkpoint's.

  A checkpoint (a local HF directory) is read with its own tokenizer and chat template unless
  the config names another; without a checkpoint "" is the byte tokenizer. Raises
  FileNotFoundError when "" asks for a checkpoint's tokenizer and it has none.
  """
  if spec:
    return str(spec)
  if not checkpoint:
    return "byte"
  if not has_tokenizer_files(checkpoint):
    raise FileNotFoundError(
        f"config.tokenizer='' means the checkpoint's own tokenizer, but {str(checkpoint)!r} has "
        "no tokenizer files (tokenizer.json and tokenizer_config.json); copy them there or "
        "name a tokenizer directory in config.tokenizer.")
  return os.fspath(checkpoint)


def describe(tokenizer: Tokenizer) -> str:
  """A tokenizer as an error message names it: its directory, or the byte tokenizer."""
  if isinstance(tokenizer, HFTokenizer):
    return f"the tokenizer in {str(tokenizer.directory)!r} ({tokenizer.vocab_size} ids)"
  return f"the byte tokenizer ({tokenizer.vocab_size} ids)"


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> bool:
  """Writes an HF tokenizer's files (with its chat template) to `directory`, so that a model
  exported there loads with `AutoTokenizer`; False for the byte tokenizer (no HF files)."""
  if not isinstance(tokenizer, HFTokenizer):
    return False
  tokenizer.hf_tokenizer.save_pretrained(os.fspath(directory))
  # Stop ids beyond the tokenizer's own eos (Qwen3's <|endoftext|>) live in the generation
  # config; `save_hf` writes none, so the source's is carried when it has one.
  source = tokenizer.directory / "generation_config.json"
  target = pathlib.Path(directory) / "generation_config.json"
  if source.exists() and not target.exists():
    target.write_text(source.read_text())
  return True
