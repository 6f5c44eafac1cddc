"""Shared checks for agent episodes."""

import numpy as np
import pytest

from mgrpo_jax import byte_tokenizer


def _check_sequence(ep, tok=byte_tokenizer.ByteTokenizer()):
  """The loss mask covers exactly the turns' generated tokens, in order, after the prompt."""
  toks, mask = np.asarray(ep.tokens), np.asarray(ep.loss_mask, bool)
  assert len(ep.tokens) == len(ep.loss_mask) == len(ep.logprobs)
  assert tok.decode(toks[mask]) == "".join(ep.turns)
  # Everything before the first generated token is the chat-template prompt.
  first = int(np.argmax(mask)) if mask.any() else len(toks)
  assert tok.decode(toks[:first]).endswith("<|im_start|>assistant\n")
  assert np.all(np.asarray(ep.logprobs)[~mask] == 0)


@pytest.fixture(scope="session")
def check_sequence():
  return _check_sequence
