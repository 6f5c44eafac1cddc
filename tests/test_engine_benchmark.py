"""The engine's schedule figures (`engine/record.py`) on hand-built records, and one real run
of benchmarks/engine.py."""

import json
import types

import pytest

from mgrpo_jax.engine import record as record_lib


def _turn(tokens, start, deps=(), model="m"):
  return dict(model=model, tokens=tokens, start=start, end=start + tokens - 1, deps=list(deps))


def _record(turns, live, slots, window=8, rows=2):
  """One model; `live[s]` rows decode at step s, each row's context 4 + s tokens."""
  steps = [dict(model="m", clock=s, rows=rows, live=n, live_len=n * (4 + s),
                kv_read=rows * window) for s, n in enumerate(live)]
  return dict(turns=turns, steps=steps, slots={"m": slots}, prefills=[], copies=[],
              prompts=[], tools=[], decoding=[], decoded=sum(t["tokens"] for t in
                                                              turns.values()))


def _qwen3_8b():
  from mgrpo_jax import models
  return models.get_preset("qwen3_8b")


# Two slots; A (3 tokens) and B (2) start at once, C (2) continues B. A work-conserving
# engine starts C the step after B ends; a lock-step one waits for A, the longest row.
_CONSERVING = {"A": _turn(3, 0), "B": _turn(2, 0), "C": _turn(2, 2, ["B"])}
_LOCK_STEP = {"A": _turn(3, 0), "B": _turn(2, 0), "C": _turn(2, 3, ["B"])}


def test_work_conserving_schedule_has_no_ready_waiting():
  engine = record_lib
  record = _record(_CONSERVING, live=[2, 2, 2, 1], slots=2)
  assert engine.ready_waiting(record) == 0
  assert engine.longest_chain(_CONSERVING) == 4  # B then C.


def test_lock_step_schedule_counts_the_waiting_turn():
  engine = record_lib
  # C is ready at step 2 (B ended at 1) and starts at 3: one step with one slot free.
  record = _record(_LOCK_STEP, live=[2, 2, 1, 1, 1], slots=2)
  assert engine.ready_waiting(record) == 1
  # With one slot, that slot is A's at step 2: nothing free, nothing counted.
  assert engine.ready_waiting(dict(record, slots={"m": 1})) == 0
  # A tool reply in flight for a step makes C ready only at 3: no wait either.
  delayed = {k: dict(v, input_steps=1 if k == "C" else 0) for k, v in _LOCK_STEP.items()}
  assert engine.ready_waiting(dict(record, turns=delayed)) == 0


def test_figures_of_the_two_schedules():
  engine = record_lib
  shape = types.SimpleNamespace(hidden_size=2, head_dim=1, num_heads=1, num_kv_heads=1,
                                intermediate_size=1, vocab_size=4, num_layers=1)
  fast = engine.metrics(_record(_CONSERVING, live=[2, 2, 2, 1], slots=2), shape)
  slow = engine.metrics(_record(_LOCK_STEP, live=[2, 2, 1, 1, 1], slots=2), shape)
  assert fast["critical_path_over_longest_chain"] == 1.0  # 4 steps, chain of 4 tokens.
  assert slow["critical_path_over_longest_chain"] == 1.25  # 5 steps.
  assert fast["slot_occupancy"] == 0.875  # 7 tokens in 4 steps x 2 slots.
  assert slow["slot_occupancy"] == 0.7  # 7 in 5 x 2.
  # Reads 2 rows x 8 slots a step; live contexts 2*4 + 2*5 + 2*6 + 1*7 = 37 tokens.
  assert fast["kv_read_over_live"] == round(4 * 16 / 37, 4)
  assert fast["tokens_discarded"] == 0 and fast["tool_latency_overlapped"] is None


def test_prefill_copies_and_tool_overlap():
  engine = record_lib
  record = _record(_CONSERVING, live=[2, 2, 2, 1], slots=2)
  record.update(prefills=[dict(model="m", rows=4, computed=64, needed=40, kv_read=64,
                               attn_pairs=1024)],
                prompts=[[8, 8], [1, 1, 1]], tools=[(0.0, 1.0), (2.0, 4.0)],
                decoding=[(0.5, 2.5), (2.4, 3.0)], decoded=9)
  m = engine.metrics(record, _qwen3_8b())
  assert m["prefill_computed_over_needed"] == 1.6
  assert m["prompt_kv_copies_per_question"] == 8.0  # Unshared prompts do not count.
  assert m["tool_latency_overlapped"] == 0.5  # 0.5 s of the first call, 1 s of the second.
  assert m["tokens_discarded"] == 2  # 9 decoded, 7 kept.
  record.update(prompts=[[1, 1]])
  assert engine.metrics(record, _qwen3_8b())["prompt_kv_copies_per_question"] == 1.0


def test_h100_price_of_a_qwen3_8b_decode_step():
  engine = record_lib
  shape = _qwen3_8b()
  # One row, nothing cached: every weight read once, 2 bytes each; Qwen3-8B has 8.19B
  # parameters, of which the 0.62B input embedding is only looked up, not read whole.
  t = engine.step_seconds(shape, tokens=1, head_rows=1, kv_read=0, kv_written=0,
                          attn_pairs=0)
  assert t == pytest.approx(2 * (8.19e9 - 151_936 * 4096) / 3.35e12, rel=0.01)
  # Prefill of 64k tokens is compute-bound: 2 FLOPs per weight per token.
  t = engine.step_seconds(shape, tokens=65_536, head_rows=1, kv_read=0, kv_written=0,
                          attn_pairs=0)
  assert t == pytest.approx(2 * 65_536 * (8.19e9 - 2 * 151_936 * 4096) / 989e12, rel=0.01)


def _run_script(load_benchmark, tmp_path, *flags) -> dict:
  out = tmp_path / "engine.json"
  load_benchmark("engine").main([*flags, "--tool_latency_ms=1", "--warmup=0", f"--out={out}"])
  return json.loads(out.read_text())


def test_script_end_to_end_on_the_smallest_workload(load_benchmark, tmp_path):
  result = _run_script(load_benchmark, tmp_path, "--task=multihop", "--policy=expert",
                       "--questions=1", "--rollouts=2")
  # A slot per episode: no ready turn waits. The slots hold one copy of the question's
  # prompt each (prefilled once), roll nothing back (closing tags are single tokens).
  assert result["ready_waiting"] == 0
  assert result["prompt_kv_copies_per_question"] == 2.0
  assert result["tokens_discarded"] == 0
  assert result["critical_path_over_longest_chain"] >= 1.0
  assert result["ran"]["main_format"] == 1.0 and result["ran"]["sub_format"] == 1.0
  assert result["modelled_h100_seconds"] > 0
  assert result["prefill_computed_over_needed"] < 1.15


def test_magrpo_children_start_as_their_joint_action_is_scored(load_benchmark, tmp_path):
  # Each joint action is scored once its agents' samples are done, and its child node's
  # turns start then, not when the node's other samples are done: no ready turn waits.
  result = _run_script(load_benchmark, tmp_path, "--task=magrpo", "--policy=expert",
                       "--questions=2", "--rollouts=2")
  assert result["ready_waiting"] == 0
  # Two turns: 2 questions x 2 agents x 2 samples, then as many per joint action (2 each).
  assert result["ran"]["completions"] == 2 * 2 * 2 * (1 + 2), result["ran"]
