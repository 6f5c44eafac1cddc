"""The prefill planner: which chunks a call takes, padded to which shape."""

import itertools

import pytest

from mgrpo_jax.engine import prefill_plan as plan


def _drain(pending, max_width, **kw):
  """Every call `next_call` makes until nothing is pending: [(units, width, chunks)]."""
  pending, calls = list(pending), []
  while any(pending):
    live = [i for i, p in enumerate(pending) if p]
    take, units, width = plan.next_call([pending[i] for i in live], max_width, **kw)
    chunks = []
    for j in take:
      i = live[j]
      chunks.append(min(pending[i], max_width))
      pending[i] -= chunks[-1]
    calls.append((units, width, chunks))
  return calls


@pytest.mark.parametrize("pending", [[5], [300, 290], [1700, 40, 900, 512, 513, 3],
                                     [600] * 5, [17] * 23, list(range(1, 40))])
def test_every_token_is_prefilled_once_in_a_call_that_holds_it(pending):
  calls = _drain(pending, 512)
  assert sum(sum(c) for _, _, c in calls) == sum(pending)
  for units, width, chunks in calls:
    assert units in plan.UNITS and len(chunks) <= units
    # The longest chunk sets the width; widths are few (one program each).
    assert width == plan.width_of(max(chunks), 512)
    assert width in (16, 32, 64, 128, 256, 384, 512)


def test_many_long_chunks_are_split_rather_than_padded():
  # Five chunks of 512: padding to 8 units computes 8 x 512 tokens, a call of 4 and one of
  # 1 compute 5 x 512, and both are past the ridge (bound by compute, not the weights).
  calls = _drain([512] * 5, 512)
  assert [(u, len(c)) for u, _, c in calls] == [(4, 4), (1, 1)]


def test_short_chunks_are_padded_into_one_call():
  # Five chunks of 16 tokens: 8 x 16 = 128 padded tokens cost less than reading the
  # weights twice.
  calls = _drain([16] * 5, 512)
  assert [(u, len(c)) for u, _, c in calls] == [(8, 5)]


def _padded_price(pending, max_width):
  """The price of prefilling `pending` as a call taking every chunk within 2x of the
  longest's power-of-two width, padded to the next unit count (the rule before costs)."""
  rest, total = list(pending), 0
  while any(rest):
    idx = [i for i, p in enumerate(rest) if p]
    idx.sort(key=lambda i: -min(rest[i], max_width))
    width = plan.width_of(rest[idx[0]], max_width, fine=False)
    take = [i for i in idx if plan.width_of(rest[i], max_width, fine=False) * 2 > width]
    take = take[:plan.MAX_UNITS]
    total += plan.call_price(next(u for u in plan.UNITS if u >= len(take)) * width)
    for i in take:
      rest[i] -= min(rest[i], max_width)
  return total


def test_the_plan_is_no_dearer_than_padding_to_the_next_unit_count():
  """Priced by `call_price`, the planner's calls cost no more than the rule before it, over
  many mixes of lengths, and less on some."""
  cheaper = 0
  for lengths in itertools.product([20, 140, 300, 512, 700], repeat=4):
    for extra in (1, 3, 6, 11):
      pending = list(lengths) * extra
      ours = sum(plan.call_price(u * w) for u, w, _ in _drain(pending, 512))
      before = _padded_price(pending, 512)
      assert ours <= before, (pending, ours, before)
      cheaper += ours < before
  assert cheaper > 0


def test_pad_to_max_always_takes_the_largest_unit_count():
  assert all(u == plan.MAX_UNITS for u, _, _ in _drain([3, 70, 512, 9], 512,
                                                          pad_to_max=True))
