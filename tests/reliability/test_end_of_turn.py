"""End-of-turn stripping is linear in the reply and strips exactly what it did before."""

import time

import hypothesis
from hypothesis import strategies as st

from mgrpo_jax import chat_format
from mgrpo_jax.agents import protocol as pr


def _quadratic_reference(text: str) -> str:
  """The implementation at 2819582, kept as the reference for the results."""
  text = text.rstrip()
  while text.endswith(pr.END_OF_TURN):
    for marker in pr.END_OF_TURN:
      text = text.removesuffix(marker).rstrip()
  return text


_PIECES = st.sampled_from([chat_format.IM_END, chat_format.ENDOFTEXT, " ", "\n", "\t", "\u3000",
                           "x", "<|im", "_end|>", "<answer>y</answer>", "|>", "<|endof"])


@hypothesis.given(st.lists(_PIECES, max_size=40), st.text(max_size=20))
@hypothesis.settings(max_examples=400, deadline=None)
def test_same_results_as_the_old_implementation(pieces, prefix):
  text = prefix + "".join(pieces)
  assert pr.strip_end_of_turn(text) == _quadratic_reference(text)


def test_many_trailing_markers_take_linear_time():
  n = 40_000  # 400 KB of markers; the quadratic version needed ~0.2 s here, 13 s at 4 MB.
  small = "<answer>x</answer>" + (chat_format.IM_END + " ") * n
  big = "<answer>x</answer>" + (chat_format.IM_END + " ") * (10 * n)
  timings = []
  for text in (small, big):
    t0 = time.perf_counter()
    assert pr.strip_end_of_turn(text) == "<answer>x</answer>"
    timings.append(time.perf_counter() - t0)
  # Ten times the markers: about ten times the time (quadratic would be about a hundred).
  assert timings[1] < 30 * timings[0] + 0.05, timings
