"""An HF tokenizer with its chat template, loaded from a local directory."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping, Sequence

from mgrpo_jax.chat_format import ENDOFTEXT, IM_END
from mgrpo_jax.tokenizer import Tokenizer


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


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds an HF tokenizer (what `HFTokenizer` loads)."""
  try:
    _check_tokenizer_dir(pathlib.Path(directory))
  except FileNotFoundError:
    return False
  return True
