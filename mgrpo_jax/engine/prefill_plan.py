"""Which chunks one prefill call of the engine computes, and at what padded shape.

A lane's ready tokens (prompts, tool replies' continuations) are prefilled in chunks of at
most `max_width` tokens per slot. One call computes a [units, width] batch: `units` one of
UNITS, `width` the longest chunk's length rounded up to a power of two (at least 16), and
above WIDTH_STEP to a multiple of it: few distinct shapes, so few compiles. Whatever in
that batch is not a chunk's token is computed for nothing. A forward of fewer tokens than
RIDGE_TOKENS is bound by reading the weights: padding it is free, and a second call would
read them again; past it, every padded token costs compute. So the chunks, longest first,
are split into calls of consecutive chunks at the least total price (`call_price`); the
first is made. A small model's calls (`pad_to_max`) instead always take MAX_UNITS units of
power-of-two widths: there a padded row costs less than compiling another program.
"""

from typing import Sequence

from mgrpo_jax import kv_cache_plan

UNITS = (1, 2, 4, 8, 16)  # Slots prefilled in one call: its batch sizes (few compiles).
MAX_UNITS = UNITS[-1]
MIN_WIDTH = 16
WIDTH_STEP = 128  # Widths above it are its multiples (one more program each, not a 2x pad).
# An H100's bf16 tensor-core peak over its HBM bandwidth (989 TFLOP/s / 3.35 TB/s): a
# token's forward is 2 FLOPs a parameter and a parameter 2 bytes, so a forward of fewer
# tokens than this takes the time of reading the weights once.
RIDGE_TOKENS = 295


def call_price(tokens: int) -> int:
  """A forward of `tokens` padded tokens, in tokens' time: at least one read of the
  weights (RIDGE_TOKENS)."""
  return max(RIDGE_TOKENS, tokens)


def width_of(pending: int, max_width: int, *, fine: bool = True) -> int:
  """The padded width of a chunk of `pending` tokens (at most `max_width`); `fine`: above
  WIDTH_STEP a multiple of it, else a power of two."""
  n = min(pending, max_width)
  if fine and n > WIDTH_STEP:
    return -(-n // WIDTH_STEP) * WIDTH_STEP
  return kv_cache_plan.bucket(n, MIN_WIDTH)


def next_call(pending: Sequence[int], max_width: int, *,
              pad_to_max: bool = False) -> tuple[list[int], int, int]:
  """The next prefill call over slots with `pending` tokens each (all > 0): (the indices of
  the slots it takes a chunk from, its units, its width): the longest chunks, see the
  module doc."""
  order = sorted(range(len(pending)), key=lambda i: -min(pending[i], max_width))
  chunks = [min(pending[i], max_width) for i in order]
  if pad_to_max:
    width = width_of(chunks[0], max_width, fine=False)
    take = [j for j, c in enumerate(chunks)
            if width_of(c, max_width, fine=False) * 2 > width][:MAX_UNITS]
    return [order[j] for j in take], MAX_UNITS, width
  # The cheapest split of the chunks, longest first, into calls of consecutive chunks
  # (cost[i]: of chunks i..; cut[i]: where the call from i ends); the first is this one.
  units_of = lambda n: next(u for u in UNITS if u >= n)
  cost, cut = [0] * (len(chunks) + 1), [0] * len(chunks)
  for i in range(len(chunks) - 1, -1, -1):
    width = width_of(chunks[i], max_width)
    ends = range(i + 1, min(len(chunks), i + MAX_UNITS) + 1)
    price = {j: call_price(units_of(j - i) * width) + cost[j] for j in ends}
    cut[i] = min(ends, key=lambda j: (price[j], -j))  # Ties: the longer call.
    cost[i] = price[cut[i]]
  return order[:cut[0]], units_of(cut[0]), width_of(chunks[0], max_width)
