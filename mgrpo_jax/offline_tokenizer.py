"""A small, real HF tokenizer in Qwen3's format, built offline for the demo, notebooks and tests."""

from __future__ import annotations

import os
import pathlib
import random
from typing import Sequence

from mgrpo_jax.chat_format import (ENDOFTEXT, IM_END, IM_START, PROTOCOL_TAGS,
                                   QWEN3_CHAT_TEMPLATE)

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
