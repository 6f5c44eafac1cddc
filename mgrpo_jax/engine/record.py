"""The engine's schedule record, and the figures it gives (docs/results/engine.md).

An engine that is given a `Record` notes, on one decode clock (a step of every model that
runs counts once): every decode step (rows computed, live rows and their lengths, KV positions
read), every prefill (tokens computed and needed, KV read, query-key pairs), every cache copy
(positions), the rows holding each shared prompt, every turn (its model, tokens, first and
last step, the turns it waited for, the steps its tool reply was in flight) and the wall
intervals of tool calls and device work. `metrics(record, shape)` turns any engine's record
into the figures, `modelled_h100_seconds` included (`step_seconds`).
"""

import bisect
import dataclasses

import numpy as np

H100_BYTES_PER_S = 3.35e12  # H100 SXM HBM3.
H100_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak.
BYTES = 2  # bf16 weights and KV cache.


# ------------------------------------------------------------------ the figures of a record


def step_seconds(shape, *, tokens, head_rows, kv_read, kv_written, attn_pairs) -> float:
  """Roofline time of one forward step of model `shape` (a Qwen3Config) on an H100.

  `tokens` query tokens through every layer, `head_rows` of them through the LM head,
  `kv_read` / `kv_written` cache positions moved, `attn_pairs` (query, key) pairs scored.
  """
  d, hd, layers = shape.hidden_size, shape.head_dim, shape.num_layers
  per_layer = (d * hd * (shape.num_heads * 2 + shape.num_kv_heads * 2)
               + 3 * d * shape.intermediate_size)
  head = d * shape.vocab_size
  kv_pos = layers * 2 * shape.num_kv_heads * hd * BYTES  # Bytes of one cached position.
  moved = (layers * per_layer + head) * BYTES + (kv_read + kv_written) * kv_pos
  flops = (2 * layers * per_layer * tokens + 2 * head * head_rows
           + 4 * layers * shape.num_heads * hd * attn_pairs)
  return max(moved / H100_BYTES_PER_S, flops / H100_FLOPS)


def _ready(turns: dict) -> dict:
  """Step at which each turn could start: after every turn it waits for, plus the steps its
  own input (a tool reply) was in flight once dispatched."""
  return {tid: max([turns[d]["end"] + 1 for d in t["deps"]] or [0]) + t.get("input_steps", 0)
          for tid, t in turns.items()}


def longest_chain(turns: dict, *, tools: bool = False) -> int:
  """Tokens of the longest chain of turns, each waiting for the one before; `tools`: plus
  the steps each turn's input (a tool reply) was in flight, which no engine can shorten."""
  best = {}
  for tid in sorted(turns, key=lambda t: turns[t]["start"]):  # Deps start earlier.
    t = turns[tid]
    wait = t.get("input_steps", 0) if tools else 0
    best[tid] = t["tokens"] + wait + max([best[d] for d in t["deps"]] or [0])
  return max(best.values())


def ready_waiting(record: dict) -> int:
  """Slot-steps in which a ready turn waited while its model had a free slot."""
  turns, steps = record["turns"], record["steps"]
  horizon = max(t["end"] for t in turns.values()) + 1
  ready, total = _ready(turns), 0
  for model, slots in record["slots"].items():
    live = np.zeros(horizon + 1, np.int64)
    waiting = np.zeros(horizon + 1, np.int64)
    for s in steps:
      if s["model"] == model:
        live[s["clock"]] += s["live"]
    for tid, t in turns.items():
      if t["model"] == model and ready[tid] < t["start"]:
        waiting[ready[tid]] += 1
        waiting[t["start"]] -= 1
    waiting = np.cumsum(waiting)
    total += int(np.minimum(waiting, np.maximum(slots - live, 0)).sum())
  return total


def _overlap(intervals, spans) -> float:
  """Seconds of `intervals` covered by the union of `spans` (both lists of (start, end))."""
  merged = []
  for a, b in sorted(spans):
    if merged and a <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], b)
    else:
      merged.append([a, b])
  starts = [x for x, _ in merged]
  total = 0.0
  for a, b in intervals:
    # The merged spans are disjoint and sorted: those that can meet [a, b] start before b,
    # from the last one that starts at or before a.
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(merged) and merged[i][0] < b:
      total += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
      i += 1
  return total


def metrics(record: dict, shape) -> dict:
  """The figures of a schedule record (see the module doc), priced on model `shape`."""
  turns, steps, prefills = record["turns"], record["steps"], record["prefills"]
  kept = sum(t["tokens"] for t in turns.values())
  first = min(t["start"] for t in turns.values())
  last = max(t["end"] for t in turns.values())
  tool_s = sum(b - a for a, b in record["tools"])
  # Per prompt [episodes that started from it, copies of its KV] (an older record: [copies]).
  shared = [p[-1] for p in record["prompts"] if p[0] > 1]
  decode_s = sum(step_seconds(shape, tokens=s["rows"], head_rows=s["rows"],
                              kv_read=s["kv_read"], kv_written=s["live"],
                              attn_pairs=s["kv_read"]) for s in steps)
  prefill_s = sum(step_seconds(shape, tokens=p["computed"], head_rows=p["rows"],
                               kv_read=p["kv_read"], kv_written=p["computed"],
                               attn_pairs=p["attn_pairs"]) for p in prefills)
  kv_pos = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * BYTES
  copy_s = 2 * sum(record["copies"]) * kv_pos / H100_BYTES_PER_S  # Read and write.
  needed = sum(p["needed"] for p in prefills)
  return {
      "ready_waiting": ready_waiting(record),
      "critical_path_over_longest_chain": round((last - first + 1) / longest_chain(turns), 4),
      # The same with each chain's tool replies in flight counted as steps: 1.0 when no turn
      # of the chain that bounds the run waited on anything but its inputs.
      "critical_path_over_chain_with_tools": round(
          (last - first + 1) / longest_chain(turns, tools=True), 4),
      "slot_occupancy": round(kept / sum(s["rows"] for s in steps), 4),
      "prefill_computed_over_needed": round(sum(p["computed"] for p in prefills) / needed, 4)
                                      if needed else None,
      "kv_read_over_live": round(sum(s["kv_read"] for s in steps)
                                 / sum(s["live_len"] for s in steps), 4),
      # Copies of a prompt that several rows share (the K rollouts of a question); 1 when
      # no prompt is shared.
      "prompt_kv_copies_per_question": round(float(np.mean(shared)) if shared else 1.0, 4),
      "tokens_discarded": record["decoded"] - kept,
      "tool_latency_overlapped": round(_overlap(record["tools"], record["decoding"]) / tool_s,
                                       4) if tool_s else None,
      "modelled_h100_seconds": round(decode_s + prefill_s + copy_s, 4),
      "modelled_h100_parts": {"decode": round(decode_s, 4), "prefill": round(prefill_s, 4),
                              "copies": round(copy_s, 4)},
      "decode_steps": last - first + 1,
      "longest_chain_tokens": longest_chain(turns),
      "kept_tokens": kept,
      "slot_steps": sum(s["rows"] for s in steps),
      "turns": len(turns),
      "tool_calls": len(record["tools"]),
      "tool_seconds": round(tool_s, 3),
  }


@dataclasses.dataclass
class Record:
  """What an engine did (see the module doc); `as_dict()` is what `metrics` reads."""

  steps: list = dataclasses.field(default_factory=list)
  prefills: list = dataclasses.field(default_factory=list)
  copies: list = dataclasses.field(default_factory=list)
  prompts: list = dataclasses.field(default_factory=list)
  turns: dict = dataclasses.field(default_factory=dict)
  tools: list = dataclasses.field(default_factory=list)
  decoding: list = dataclasses.field(default_factory=list)
  decoded: int = 0
  slots: dict = dataclasses.field(default_factory=dict)
  clock: int = 0  # Decode steps so far.

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)
