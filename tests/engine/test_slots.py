"""The agent engine's slots: refills, chunked prefill, evicted KV, and seeds that reproduce.

A tiny random Qwen3 (f32, byte tokenizer). The references are the batched sampler
(`sampling.generate`, itself checked against transformers in tests/test_sampling.py) and the
engine run with one slot per episode.
"""

import dataclasses

import jax
import numpy as np
import pytest

from mgrpo_jax import byte_tokenizer, kv_cache_plan, models, sampling
from mgrpo_jax.agents import rollout
from mgrpo_jax.engine import lanes, prefill_plan, record as record_lib, run as engine_run

TOK = byte_tokenizer.ByteTokenizer()
PROMPTS = ["find the river", "who built the old bridge over it, and when?", "why not",
           "find the river", "a", "tell me about the harbour of the town in the north"]


@pytest.fixture(scope="module")
def tiny():
  cfg = models.get_preset("tiny", vocab_size=TOK.vocab_size)
  return cfg, models.init_params(cfg, jax.random.key(0))


def _policy(tiny, *, slots, temperature=0.0, max_new=12, max_len=256, share=False):
  cfg, params = tiny
  return rollout.LLMPolicy(cfg, params, TOK, "sub", temperature=temperature, slots=slots,
                           share_prompts=share, limits=rollout.Limits(max_turns=3, max_new_tokens=max_new,
                                                 max_len=max_len))


def _complete(policy, prompts, key, *, width=512, record=None, whole=True):
  lane = lanes.SlotLane("m", policy, key=key, num_slots=policy.slots, width=width,
                        record=record)
  lane.whole_slots = whole
  return engine_run.complete([lane], [prompts], chunk=8, record=record)[0]


# Two layouts of the keys; decode calls reading each cache whole or its first positions;
# shared prompts ("find the river" twice) held in a pool row or copied into each slot.
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("attention,whole", [("auto", True), ("ragged", True),
                                             ("auto", False)])
def test_greedy_completions_equal_the_batched_sampler_with_refills_and_chunks(
    tiny, attention, whole, share):
  cfg, params = tiny
  cfg = dataclasses.replace(cfg, attention=attention)
  tiny = cfg, params
  prompts = [TOK.encode(p) for p in PROMPTS]
  want = sampling.generate(cfg, params, prompts, max_new_tokens=12, temperature=0.0,
                           max_len=256)
  # Two slots for six prompts (each refilled), prompts prefilled 16 tokens at a time.
  got = _complete(_policy(tiny, slots=2, share=share), prompts, jax.random.key(0), width=16,
                  whole=whole)
  for i, (ids, logps, finish, _) in enumerate(got):
    n = int(want.lengths[i])
    assert ids == want.tokens[i, :n].tolist(), i
    np.testing.assert_allclose(logps, want.logprobs[i, :n], atol=2e-5)
    assert finish == want.finish_reasons[i]


def test_slots_take_the_whole_context_when_it_fits_else_grow_by_need(tiny, monkeypatch):
  cfg, params = tiny
  prompts = [TOK.encode(p) for p in PROMPTS]
  grown = []
  grow = lanes.slots_lib.grow
  monkeypatch.setattr(lanes.slots_lib, "grow",
                      lambda c, s, cap: grown.append(cap) or grow(c, s, cap))
  whole = _policy(tiny, slots=2, max_new=40)
  lane = lanes.SlotLane("m", whole, key=jax.random.key(0), num_slots=2, width=16)
  want = engine_run.complete([lane], [prompts], chunk=8)[0]
  assert lane.slots.capacity == 256 + 16 and not grown  # max_len + a chunk, from the start.
  # A KV budget below the whole context's: the slots start at what the first turns need and
  # grow (copied into a larger cache) as the rows lengthen; the turns are the same.
  small = rollout.LLMPolicy(
      cfg, params, TOK, "sub", temperature=0.0, slots=2, limits=whole.limits,
      kv_cache_budget_bytes=kv_cache_plan.kv_cache_bytes(cfg, 2, 64))
  lane = lanes.SlotLane("m", small, key=jax.random.key(0), num_slots=2, width=16)
  got = engine_run.complete([lane], [prompts], chunk=8)[0]
  assert grown and lane.slots.capacity < 256 + 16, (grown, lane.slots.capacity)
  assert [r[0] for r in got] == [r[0] for r in want]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g[1], w[1], atol=2e-5)


def test_a_small_models_prefill_pads_its_units_to_one_program_per_width(tiny, monkeypatch):
  prompts = [TOK.encode(p) for p in PROMPTS]
  shapes = []
  prefill = lanes.slots_lib.prefill
  monkeypatch.setattr(lanes.slots_lib, "prefill",
                      lambda *a: shapes.append(a[3].shape) or prefill(*a))
  policy = _policy(tiny, slots=4)
  lane = lanes.SlotLane("m", policy, key=jax.random.key(0), num_slots=4, width=16)
  padded = engine_run.complete([lane], [prompts], chunk=8)[0]
  assert shapes and {u for u, _ in shapes} == {prefill_plan.MAX_UNITS}, shapes
  shapes.clear()
  lane = lanes.SlotLane("m", policy, key=jax.random.key(0), num_slots=4, width=16)
  lane.pad_units_flops = 0  # A large model's lane: no padded unit.
  exact = engine_run.complete([lane], [prompts], chunk=8)[0]
  assert {u for u, _ in shapes} < set(prefill_plan.UNITS) and prefill_plan.MAX_UNITS not in {
      u for u, _ in shapes}, shapes
  assert [r[0] for r in padded] == [r[0] for r in exact]


@pytest.mark.parametrize("share", [False, True])
def test_a_seed_reproduces_samples_whatever_the_slots_and_order(tiny, share):
  prompts = [TOK.encode(p) for p in PROMPTS]
  key = jax.random.key(3)
  base = _complete(_policy(tiny, slots=8, temperature=1.0), prompts, key)
  # Two slots: every turn runs in another slot, at another step, beside other turns.
  few = _complete(_policy(tiny, slots=2, temperature=1.0, share=share), prompts, key)
  assert [r[0] for r in few] == [r[0] for r in base]
  # The same prompts given in reverse order, streams kept: the same samples.
  lane = lanes.SlotLane("m", _policy(tiny, slots=2, temperature=1.0, share=share), key=key,
                        num_slots=2)
  jobs = [engine_run.Job("m", i, list(p)) for i, p in enumerate(prompts)]
  for job in reversed(jobs):
    lane.add(job, job.q)
  seen = {}
  while True:
    lane.admit()
    if not lane.running():
      break
    for seat, ids, _, _ in engine_run.decode([lane], 8, None):
      seen[seat.ep.q] = ids
      lane.finish(seat.ep)
  assert [seen[i] for i in range(len(prompts))] == [r[0] for r in base]
  # And a different key samples something else.
  other = _complete(_policy(tiny, slots=8, temperature=1.0), prompts, jax.random.key(4))
  assert [r[0] for r in other] != [r[0] for r in base]


@pytest.mark.parametrize("share", [False, True])
def test_a_freed_slot_is_refilled_on_the_next_step(tiny, share):
  prompts = [TOK.encode(p) for p in PROMPTS]
  rec = record_lib.Record()
  policy = _policy(tiny, slots=2, temperature=1.0, share=share)
  lengths = {i: 2 + 2 * i for i in range(len(prompts))}  # Forced turn lengths.
  lane = lanes.SlotLane("m", policy, key=jax.random.key(0), num_slots=2, record=rec,
                        force=lambda job: [65] * lengths[job.q])
  lane.pad_units_flops = 0  # A large model's prefill: no padded unit.
  engine_run.complete([lane], [prompts], chunk=32, record=rec)
  turns = sorted(rec.turns.values(), key=lambda t: t["start"])
  assert [t["tokens"] for t in turns] == [lengths[i] for i in range(len(prompts))]
  # Whenever a turn ends, the next waiting one starts on the following step.
  ends = sorted(t["end"] for t in turns)
  for t in turns[2:]:
    assert t["start"] - 1 in ends
  record = rec.as_dict()
  assert record_lib.ready_waiting(record) == 0
  m = record_lib.metrics(record, models.get_preset("qwen3_8b"))
  # Turns of 2, 4, ..., 12 tokens in two slots, each started when one frees: slot A runs
  # 2 + 6 + 10 tokens, slot B 4 + 8 + 12; the run ends with B at step 24.
  assert m["decode_steps"] == 24 and m["kept_tokens"] == 42
  assert m["slot_occupancy"] == round(42 / 48, 4)
  # A shared prompt ("find the river" twice) is prefilled once; its KV is held once in a
  # pool row (shared prompts), else copied into each episode's slot.
  assert sum(p["needed"] for p in record["prefills"]) == sum(map(len, {tuple(p) for p in
                                                                        prompts}))
  assert len(prompts) > len({tuple(p) for p in prompts})
  assert m["prompt_kv_copies_per_question"] == (1 if share else 2)


@pytest.mark.parametrize("share", [False, True])
def test_waiting_turns_give_their_slots_up_and_get_their_kv_back(tiny, share):
  """Episodes with tool replies, one slot for four: each waiting turn's KV is saved and
  restored (with shared prompts, only its own positions: the prompt stays in its pool row);
  the episodes equal those of a run with a slot each, prompts copied."""
  limits = rollout.Limits(max_turns=3, max_new_tokens=10, max_len=512)

  def run(slots, share=False):
    cfg, params = tiny
    policy = rollout.LLMPolicy(cfg, params, TOK, "sub", temperature=1.0, slots=slots,
                               limits=limits, share_prompts=share)
    eps = [rollout.new_episode(TOK, "sub", [{"role": "user", "content": p}], q=i, k=0,
                               call=0, task=None, max_turns=3)
           for i, p in enumerate(PROMPTS[:4])]
    tools = lambda pending: [f"reply to {ep.q}: {len(ep.turns)}" for ep, _ in pending]
    return rollout.run_episodes(policy, eps, tools, tokenizer=TOK, limits=limits,
                                key=jax.random.key(5))

  one, each = run(1, share), run(4)
  assert [e.tokens for e in one] == [e.tokens for e in each]
  for a, b in zip(one, each):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def _two_turn_jobs(lane, prompts, check=None, late=()):
  """Jobs of two turns each through `lane`, a tool reply between (the waiting job gives its
  slot up when another is ready); `check()` after every admit; the jobs of `late` prompts
  added after the first admit. Returns each job's tokens, `late`'s last."""
  jobs = [engine_run.Job("m", i, list(p)) for i, p in enumerate(list(prompts) + list(late))]
  for job in jobs[:len(prompts)]:
    lane.add(job, job.q)
  first = True
  while True:
    lane.admit()
    if first:
      for job in jobs[len(prompts):]:
        lane.add(job, job.q)
      first = False
    if check:
      check()
    if not lane.running():
      return [job.tokens for job in jobs]
    for seat, ids, _, _ in engine_run.decode([lane], 8, None):
      job = seat.ep
      job.tokens += ids
      job.turns.append(ids)
      if len(job.turns) == 2:
        lane.finish(job)
      else:
        reply = TOK.encode(f" reply to {job.q}:")
        job.tokens += reply
        lane.extend(job, reply)


def test_a_pool_row_has_at_most_its_members_and_the_rest_hold_copies(tiny):
  """Rows of two members (`pool_members`) on four slots: two episodes of a prompt read its
  row; a third of it, added once the row is full, and one of three episodes of another
  prompt (more than a row's members) hold copies. Every episode samples what it does with
  copies alone."""
  river, why = TOK.encode("find the river"), TOK.encode("why not")
  prompts, late = [river, river, why, why, why], [river]
  want = _two_turn_jobs(lanes.SlotLane("m", _policy(tiny, slots=4, temperature=1.0),
                                       key=jax.random.key(2), num_slots=4), prompts, late=late)
  lane = lanes.SlotLane("m", _policy(tiny, slots=4, temperature=1.0, share=True),
                        key=jax.random.key(2), num_slots=4, pool_members=2)
  readers = {}

  def check():
    members = lane.rows.members()
    assert members.shape == (lane.pool_rows, 2)
    for seat in lane.seats.values():
      if seat.row is not None:
        readers[seat.ep.q] = seat.row
        if seat.slot is not None:  # Its slot is among its row's members.
          assert seat.slot in members[seat.row]

  got = _two_turn_jobs(lane, prompts, check, late=late)
  assert lane.slots.pool.members_PxM.shape[1] == 2
  assert sorted(readers) == [0, 1]  # River's first two; "why not" had three episodes.
  assert got == want


def test_a_pool_row_lives_while_an_episode_reads_it(tiny):
  """Three jobs share a prompt (one pool row), one does not; two slots. The row counts the
  jobs that read it, waiting or not yet started ones too, and is freed after the last."""
  prompts = [TOK.encode("find the river")] * 3 + [TOK.encode("why not")]
  shared = tuple(prompts[0])
  lane = lanes.SlotLane("m", _policy(tiny, slots=2, temperature=1.0, share=True),
                        key=jax.random.key(1), num_slots=2)
  seen = []

  def check():
    readers = [s for s in lane.seats.values() if s.prompt == shared or s.row is not None]
    if shared in lane.rows.row_of:
      row = lane.rows.row_of[shared]
      seen.append(len(readers))
      assert lane.rows.users[row] == len(readers) > 0
      for seat in readers:
        assert seat.row in (None, row)
        if seat.slot is not None and seat.row is not None:
          assert lane.rows.slot_row[seat.slot] == row
    else:
      assert not readers or not seen  # Once made, the row stays until its readers are done.

  got = _two_turn_jobs(lane, prompts, check)
  assert seen and max(seen) == 3
  assert lane.rows.users == [0] * lane.pool_rows and not lane.rows.row_of
  np.testing.assert_array_equal(lane.slots.pool.len_P, 0)
  # The same samples as with the prompt copied into each slot, and its prefix and the
  # waiting jobs' own positions saved and restored.
  copied = lanes.SlotLane("m", _policy(tiny, slots=2, temperature=1.0), key=jax.random.key(1),
                          num_slots=2)
  assert got == _two_turn_jobs(copied, prompts)


def test_shared_prompts_through_the_cascade_kernel(tiny, monkeypatch):
  # The greedy check with the Pallas cascade itself in every decode step (interpreted).
  from mgrpo_jax.models import prefix_attention
  calls = []
  original = prefix_attention.decode
  monkeypatch.setattr(prefix_attention, "decode",
                      lambda *a, **kw: calls.append(1) or original(*a, interpret=True, **kw))
  # The programs traced before the kernel was patched in would otherwise be reused.
  jax.clear_caches()
  cfg, params = tiny
  cfg = dataclasses.replace(cfg, attention="ragged")
  prompts = [TOK.encode(p) for p in PROMPTS[:4]]
  want = sampling.generate(cfg, params, prompts, max_new_tokens=12, temperature=0.0,
                           max_len=256)
  got = _complete(_policy((cfg, params), slots=2, share=True), prompts, jax.random.key(0),
                  width=16)
  assert calls
  for i, (ids, logps, finish, _) in enumerate(got):
    n = int(want.lengths[i])
    assert ids == want.tokens[i, :n].tolist(), i
    np.testing.assert_allclose(logps, want.logprobs[i, :n], atol=2e-5)
    assert finish == want.finish_reasons[i]
