"""Tokenizers by name: the one a config names, loaded, resolved against a checkpoint, described
in errors, and saved beside an exported model."""

from __future__ import annotations

import os
import pathlib
from typing import Sequence

from mgrpo_jax.byte_tokenizer import ByteTokenizer
from mgrpo_jax.hf_tokenizer import HFTokenizer, has_tokenizer_files
from mgrpo_jax.tokenizer import Tokenizer

# Byte tokenizers with a generated world's words (`mgrpo_jax.mgrpo.tasks.tokenizer_words`).
WORLD_SPECS = ("byte+names", "byte+world", "byte+phrases", "byte+phrases+ids")


def load_tokenizer(spec: str | os.PathLike, *, words: Sequence[str] = ()) -> Tokenizer:
  """"byte" -> ByteTokenizer(words=words) (none, or a native run's protocol strings);
  "byte+names", "byte+world", "byte+phrases" or "byte+phrases+ids" ->
  ByteTokenizer(words=words) (a world's names; its names and phrases; its phrases only; its
  phrases and doc ids, one id each: picked by `mgrpo_jax.mgrpo.tasks.tokenizer_words`);
  anything else is a local directory -> HFTokenizer."""
  if str(spec) == "byte":
    return ByteTokenizer(words=words)
  if str(spec) in WORLD_SPECS:
    if not words:
      raise ValueError(f'tokenizer "{spec}" needs the words (words=...) of a world')
    return ByteTokenizer(words=words)
  return HFTokenizer(spec)


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
