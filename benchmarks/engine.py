"""How well the rollout engine keeps its decode slots busy, from a record of its schedule.

  python benchmarks/engine.py --task=multihop --policy=expert --questions=2 --rollouts=8
  python benchmarks/engine.py --task=multihop --policy=random --turn_lengths=lognormal:4,1 \
      --questions=32 --rollouts=8 --slots=32,64 --out=/tmp/engine.json

The episodes run through the real jitted engine (`agents.rollout.run_episodes` over
`sampling`; MAGRPO's `magrpo.rollout.joint_rollout`) on a one-layer random model. `expert`:
each turn is the scripted expert's (its length forced on the sampler, its text what the
episode keeps); `random`: the experts' actions in turns whose lengths are drawn from
`--turn_lengths`. The benchmark wraps the sampler's jitted pieces (never edits them) and
writes an engine-independent record: every decode step (rows computed, live rows and their
lengths, KV positions read), every prefill (tokens computed and needed), every turn (its
model, tokens, first and last decode step, the turns it waited for) and every tool call's
wall time. `metrics(record)` turns any engine's record into the figures of
docs/results/engine.md, `modelled_h100_seconds` included (`step_seconds`).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

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


def longest_chain(turns: dict) -> int:
  """Tokens of the longest chain of turns, each waiting for the one before."""
  best = {}
  for tid in sorted(turns, key=lambda t: turns[t]["start"]):  # Deps start earlier.
    t = turns[tid]
    best[tid] = t["tokens"] + max([best[d] for d in t["deps"]] or [0])
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
  return sum(max(0.0, min(b, y) - max(a, x)) for a, b in intervals for x, y in merged)


def metrics(record: dict, shape) -> dict:
  """The figures of a schedule record (see the module doc), priced on model `shape`."""
  turns, steps, prefills = record["turns"], record["steps"], record["prefills"]
  kept = sum(t["tokens"] for t in turns.values())
  first = min(t["start"] for t in turns.values())
  last = max(t["end"] for t in turns.values())
  tool_s = sum(b - a for a, b in record["tools"])
  shared = [c for p in record["prompts"] for c in p if c > 1]
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


# ------------------------------------------------------------ recording today's sampler


class Recorder:
  """Wraps the sampler's jitted steps to write the schedule record (see module doc).

  `model` names who runs the next call; `forced[r]` is the length batch row r's turn stops
  at (the sampler's per-row budget, stop ids off, so a random model stops where told).
  """

  def __init__(self):
    self.model, self.forced, self.clock = None, None, 0
    self.record = dict(steps=[], prefills=[], copies=[], prompts=[], turns={}, tools=[],
                       decoding=[], decoded=0)
    self.spans: dict[int, list[int]] = {}  # Batch row -> [first, last] step of its turn.
    self._orig = {}

  def install(self):
    """Wraps the sampler's pieces in every module that holds them (the sampler's own, and any
    that imported them by name), so the record follows them if they move between modules."""
    from mgrpo_jax import sampling
    wrappers = {"decode_jit": self._decode_jit, "_prefill": self._prefill_step,
                "_take_rows": self._take_rows, "_grow": self._grow, "prefill": self._prompts}
    self._patched = []
    for name, fn in wrappers.items():
      self._orig[name] = orig = getattr(sampling, name)
      for mod in [m for k, m in list(sys.modules.items()) if k.startswith("mgrpo_jax")]:
        if getattr(mod, name, None) is orig:
          setattr(mod, name, fn)
          self._patched.append((mod, name, orig))
    return self

  def uninstall(self):
    for mod, name, orig in self._patched:
      setattr(mod, name, orig)

  def _decode_jit(self, backend=None, *, options=True):
    fn = self._orig["decode_jit"](backend, options=options)

    def run(config, params, state, sp, steps, key, window):
      b = state.n_B.shape[0]
      if self.forced is not None:
        budget = np.ones(b, np.int32)
        budget[:len(self.forced)] = self.forced
        state = state.replace(budget_B=jnp.asarray(budget))
        sp = sp.replace(stop_ids=jnp.full_like(sp.stop_ids, -1))
      n0, f0 = np.asarray(state.n_B), np.asarray(state.finish_B)
      len0 = np.asarray(state.seqs.lengths_B)
      start = time.perf_counter()
      # Waited for here (the sampler fetches it next anyway): the interval is the device's.
      out = jax.block_until_ready(fn(config, params, state, sp, steps, key, window))
      self.record["decoding"].append((start, time.perf_counter()))
      delta = np.where(f0 == 0, np.asarray(out.n_B) - n0, 0)
      for j in range(int(delta.max(initial=0))):
        live = delta > j
        self.record["steps"].append(dict(
            model=self.model, clock=self.clock + j, rows=b, live=int(live.sum()),
            live_len=int((len0[live] + j + 1).sum()), kv_read=b * window))
      for r in np.flatnonzero(delta):
        span = self.spans.setdefault(int(r), [self.clock, 0])
        span[1] = self.clock + int(delta[r]) - 1
      self.record["decoded"] += int(delta.sum())
      self.clock += int(delta.max(initial=0))
      return out

    return run

  def _prefill_step(self, config, params, tokens_BxT, lengths_B, offsets_B, cache, window,
                    experts=None):
    b, t = tokens_BxT.shape
    start = time.perf_counter()
    out = jax.block_until_ready(self._orig["_prefill"](config, params, tokens_BxT, lengths_B,
                                                       offsets_B, cache, window, experts))
    self.record["decoding"].append((start, time.perf_counter()))
    self.record["prefills"].append(dict(
        model=self.model, rows=b, computed=b * t, needed=int(np.asarray(lengths_B).sum()),
        kv_read=b * window, attn_pairs=b * t * window))
    return out

  def _take_rows(self, seqs, idx_B):
    self.record["copies"].append(int(idx_B.shape[0]) * seqs.capacity)
    return self._orig["_take_rows"](seqs, idx_B)

  def _grow(self, seqs, length):
    self.record["copies"].append(int(seqs.lengths_B.shape[0]) * seqs.capacity)
    return self._orig["_grow"](seqs, length)

  def _prompts(self, config, params, prompts, **kw):
    counts = {}
    for p in prompts:
      counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    self.record["prompts"].append(list(counts.values()))  # Rows holding each prompt's KV.
    return self._orig["prefill"](config, params, prompts, **kw)

  def tool(self, fn, latency_s: float):
    """`fn` with `latency_s` of wall time added per call, each call's interval recorded."""
    def call(*args, **kw):
      start = time.perf_counter()
      out = fn(*args, **kw)
      time.sleep(latency_s)
      self.record["tools"].append((start, time.perf_counter()))
      return out
    return call


# ------------------------------------------------------------------ forced turns


@dataclasses.dataclass
class Lengths:
  """Turn lengths: the expert's own (`kind="expert"`) or drawn from a lognormal."""

  kind: str
  mu: float = 0.0
  sigma: float = 0.0
  seed: int = 0

  def shape(self, ids: list[int], tok, limit: int, turn: str) -> list[int]:
    """`ids` made as long as a drawn length (at least the action's own, at most `limit`):
    filler inside the turn's <think>, so the action still parses. The draw depends on the
    seed and the turn's name only, so every engine gets the same lengths in any order."""
    ids = ids[:limit]
    if self.kind == "expert":
      return ids
    rng = np.random.default_rng([self.seed, zlib.crc32(turn.encode())])
    want = int(np.clip(round(rng.lognormal(self.mu, self.sigma)), 1, limit))
    extra = want - len(ids)
    if extra <= 0:
      return ids
    head = tok.encode("<think>\n")
    filler = tok.encode(".")[:1] * extra
    if ids[:len(head)] == head:
      return head + filler + ids[len(head):]
    close = tok.encode("</think>\n\n")
    return (head + filler[:max(0, extra - len(head) - len(close))] + close + ids)[:limit]


class ForcedTurns:
  """A TurnPolicy: the expert decides each turn's text, the LLM sampler decodes it (its
  length forced), and the recorder notes when each turn ran."""

  def __init__(self, role, expert, llm, rec: Recorder, lengths: Lengths, tok, limit: int):
    self.role, self.expert, self.llm, self.rec = role, expert, llm, rec
    self.lengths, self.tok, self.limit = lengths, tok, limit
    self.version = 0

  def begin(self, episodes):
    self.rec.model = self.role
    self.expert.begin(episodes)
    self.llm.begin(episodes)

  def act(self, rows, key):
    eps = [self.llm._episodes[r] for r in rows]
    turns = [self.lengths.shape(ids, self.tok, self.limit, _turn_id(ep, len(ep.turns)))
             for ep, (ids, _) in zip(eps, self.expert.act(rows, key))]
    forced = np.ones(len(self.llm._episodes), np.int32)
    forced[list(rows)] = [len(t) for t in turns]
    self.rec.model, self.rec.forced, self.rec.spans = self.role, forced, {}
    out = self.llm.act(rows, key)
    self.rec.forced = None
    for r, ids, (gen, logps) in zip(rows, turns, out):
      assert len(gen) == len(ids), (len(gen), len(ids))
      ep = self.llm._episodes[r]
      first, last = self.rec.spans[r]
      self.rec.record["turns"][_turn_id(ep, len(ep.turns))] = dict(
          model=self.role, tokens=len(ids), start=first, end=last, deps=[])
    return [(ids, logps) for ids, (_, logps) in zip(turns, out)]

  def append(self, appended):
    self.rec.model = self.role
    self.llm.append(appended)


def _turn_id(ep, i: int) -> str:
  return f"{ep.role}/{ep.q}/{ep.k}/{ep.call}/{i}"


def _agent_deps(record: dict, main_eps, sub_eps) -> None:
  """Each turn waits for its episode's previous turn and, after a delegation, for the last
  turn of the sub-agent episode it started; a sub-agent's first turn for that delegation."""
  turns = record["turns"]
  subs = {(e.q, e.k, e.call): e for e in sub_eps}
  for ep in list(main_eps) + list(sub_eps):
    for i in range(1, len(ep.turns)):
      turns[_turn_id(ep, i)]["deps"].append(_turn_id(ep, i - 1))
  for ep in main_eps:
    calls = 0
    for i, action in enumerate(ep.actions):
      sub = subs.get((ep.q, ep.k, calls)) if action == "delegate" else None
      if sub is None:
        continue
      calls += 1
      if not sub.turns:  # Aborted before its first turn (its prompt would not fit).
        continue
      turns[_turn_id(sub, 0)]["deps"].append(_turn_id(ep, i))
      if i + 1 < len(ep.turns):
        turns[_turn_id(ep, i + 1)]["deps"].append(_turn_id(sub, len(sub.turns) - 1))


# ------------------------------------------------------------------ the workloads


def _shape(vocab: int, max_len: int):
  """The one-layer random model that runs the schedule on CPU (its size changes no figure
  but wall time: the schedule is the engine's, the prices are `--price_as`'s)."""
  from mgrpo_jax import models
  return models.Qwen3Config(vocab_size=-(-vocab // 64) * 64, hidden_size=16,
                            intermediate_size=32, num_layers=1, num_heads=1, num_kv_heads=1,
                            head_dim=8, rope_theta=10_000.0, tie_embeddings=True,
                            max_position_embeddings=max(4096, max_len))


AGENT_CONFIGS = {"multihop": "task=multihop,gpu,policy=expert", "qa": "task=qa,gpu,policy=expert"}


def run_agents(args, rec: Recorder, lengths: Lengths) -> dict:
  """M-GRPO's main agent and colocated sub-agent on `args.task`; returns what ran."""
  from configs import mgrpo as mgrpo_config
  from mgrpo_jax import models
  from mgrpo_jax.agents import rollout
  from mgrpo_jax.mgrpo import play, setup, tasks
  c = mgrpo_config.get_config(AGENT_CONFIGS[args.task])
  if args.task == "qa":
    c.data.update(format="musique", eval=args.qa_data)
  env = tasks.build_env(c)
  env.tools = {name: rec.tool(fn, args.tool_latency_ms / 1e3) for name, fn in env.tools.items()}
  wiring = setup.resolve_wiring(c)
  experts = play.expert_policies(c, wiring, env)
  lim = play.limits(c)
  shape = _shape(env.tokenizer.vocab_size, lim.max_len)
  params = models.init_params(shape, jax.random.key(args.seed))
  policies = {role: ForcedTurns(role, experts[role], rollout.LLMPolicy(
      shape, params, env.tokenizer, role, limits=lim, chunk=c.sampling.chunk), rec, lengths,
      env.tokenizer, lim.max_new_tokens) for role in ("main", "sub")}
  pool = env.train if args.task == "multihop" else env.test
  pick = np.random.default_rng(args.seed).choice(len(pool), args.questions,
                                                 replace=args.questions > len(pool))
  eps, sub_eps = play.run_rollouts(c, wiring, env, policies, [pool[i] for i in pick],
                                   num_rollouts=args.rollouts, key=jax.random.key(args.seed),
                                   step=0)
  _agent_deps(rec.record, eps, sub_eps)
  return dict(config=f"configs/mgrpo.py:{AGENT_CONFIGS[args.task]}", shape=shape,
              limits=dataclasses.asdict(lim), main_episodes=len(eps), sub_episodes=len(sub_eps),
              main_format=float(np.mean([e.format_ok for e in eps])),
              sub_format=float(np.mean([e.format_ok for e in sub_eps])) if sub_eps else None)


def _code_expert(problem, agent: int) -> str:
  """The code task's scripted turn: a trivial helper; the reference solution as main (its
  signature and body, not the prompt's docstring)."""
  if agent == 0:
    return "```python\ndef aux(x):\n    return x\n```"
  sig = next(line for line in problem.prompt.splitlines()
             if line.startswith(f"def {problem.entry_point}("))
  return f"```python\n{sig}\n{problem.canonical_solution}```"


class ForcedCompletions:
  """A MAGRPO agent's `complete`: the expert's text at a forced length, recorded."""

  def __init__(self, agent, policy, examples, rec: Recorder, lengths: Lengths, limit: int):
    self.agent, self.policy, self.examples, self.rec = agent, policy, examples, rec
    self.lengths, self.limit, self.calls = lengths, limit, 0
    self.tokenizer = policy.tokenizer

  def complete(self, prompts, key):
    tok = self.tokenizer
    texts = []
    for p in prompts:
      text = tok.decode(p)
      ex = next(e for e in self.examples if f"def {e.entry_point}(" in text)
      texts.append(_code_expert(ex, self.agent))
    # Row r of turn t is (prompt, node, sample) in joint_rollout's order, whatever the engine.
    turns = [self.lengths.shape(tok.encode(t), tok, self.limit, f"{self.agent}/{self.calls}/{r}")
             for r, t in enumerate(texts)]
    self.rec.model, self.rec.spans = f"agent{self.agent}", {}
    self.rec.forced = np.asarray([len(t) for t in turns], np.int32)
    out = self.policy.complete(prompts, key)
    self.rec.forced = None
    for r, (ids, comp) in enumerate(zip(turns, out)):
      assert len(comp.generated) == len(ids), (len(comp.generated), len(ids))
      first, last = self.rec.spans[r]
      self.rec.record["turns"][f"{self.agent}/{self.calls}/{r}"] = dict(
          model=self.rec.model, tokens=len(ids), start=first, end=last, deps=[])
    self.calls += 1
    return [dataclasses.replace(comp, generated=ids, text=tok.decode(ids))
            for ids, comp in zip(turns, out)]


def run_magrpo(args, rec: Recorder, lengths: Lengths) -> dict:
  """MAGRPO's joint rollout on the code task (HumanEval, two agents, `args.turns` turns):
  `args.questions` prompts x `args.rollouts` samples per agent per node."""
  from configs import magrpo as magrpo_config
  from mgrpo_jax import models
  from mgrpo_jax import tokenizer as tk
  from mgrpo_jax.magrpo import rollout, tasks
  from mgrpo_jax.rl import joint
  arg = f"task=code,turns={args.turns}"
  c = magrpo_config.get_config(arg)
  task = tasks.build_task(c.task)
  tok = tk.load_tokenizer(c.tokenizer)
  latency, workers = args.tool_latency_ms / 1e3, c.task.workers

  base_score = task.score

  def score(examples, outputs):  # The sandbox runs `workers` joint actions at a time.
    return rec.tool(base_score, latency * -(-len(outputs) // workers))(examples, outputs)

  task = dataclasses.replace(task, score=score)
  shape = _shape(tok.vocab_size, c.max_len)
  params = models.init_params(shape, jax.random.key(args.seed))
  pick = np.random.default_rng(args.seed).choice(len(task.train), args.questions, replace=False)
  examples = [task.train[i] for i in pick]
  policies = [ForcedCompletions(i, rollout.Policy(
      shape, params, tok, max_new_tokens=c.max_new_tokens, max_len=c.max_len,
      temperature=c.sampling.temperature, top_p=c.sampling.top_p, top_k=c.sampling.top_k,
      chunk=c.sampling.chunk), examples, rec, lengths, c.max_new_tokens)
              for i in range(task.num_agents)]
  turns = rollout.joint_rollout(task, policies, examples, group=args.rollouts,
                                mode=c.joint_mode, num_turns=c.num_turns,
                                key=jax.random.key(args.seed))
  # Each completion of turn t + 1 waits for the joint action (node) it continues.
  index = joint.joint_indices(task.num_agents, args.rollouts, c.joint_mode)
  n_joint, rec_turns = len(index), rec.record["turns"]
  for t in range(1, len(turns)):
    for a in range(task.num_agents):
      for r in range(len(turns[t].completions[a])):
        node = r // args.rollouts
        parent, j = node // n_joint, node % n_joint
        rec_turns[f"{a}/{t}/{r}"]["deps"] = [
            f"{i}/{t - 1}/{parent * args.rollouts + index[j, i]}"
            for i in range(task.num_agents)]
  return dict(config=f"configs/magrpo.py:{arg}", shape=shape, group=args.rollouts,
              completions=sum(len(x) for t in turns for x in t.completions),
              mean_reward=float(np.mean([t.rewards_PxM.mean() for t in turns])))


def _parse_lengths(args) -> Lengths:
  if args.policy == "expert":
    return Lengths("expert")
  kind, _, rest = args.turn_lengths.partition(":")
  if kind != "lognormal":
    raise SystemExit(f"--turn_lengths={args.turn_lengths!r}; expected lognormal:MU,SIGMA.")
  mu, sigma = (float(x) for x in rest.split(","))
  return Lengths("lognormal", mu, sigma, seed=args.seed)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--task", choices=("multihop", "qa", "magrpo"), default="multihop")
  p.add_argument("--policy", choices=("expert", "random"), default="expert")
  p.add_argument("--turn_lengths", default="lognormal:4,1")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--questions", type=int, default=2)
  p.add_argument("--rollouts", type=int, default=8)
  p.add_argument("--slots", default="", help="MAIN,SUB (MAGRPO: per agent). Today's engine "
                 "cannot be given slots: it runs every live row; empty = the largest batch "
                 "each model ran. They are the free slots ready_waiting counts.")
  p.add_argument("--tool_latency_ms", type=float, default=50.0)
  p.add_argument("--turns", type=int, default=2, help="magrpo: turns of the joint rollout.")
  p.add_argument("--qa_data", default="/work/shared/data/musique_sample.jsonl")
  p.add_argument("--price_as", default="qwen3_8b", help="Model preset priced on an H100.")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  from mgrpo_jax import models
  rec = Recorder().install()
  start, cpu = time.perf_counter(), time.process_time()
  try:
    run = run_magrpo if args.task == "magrpo" else run_agents
    ran = run(args, rec, _parse_lengths(args))
  finally:
    rec.uninstall()
  record = rec.record
  batches = {}
  for s in record["steps"]:
    batches[s["model"]] = max(batches.get(s["model"], 0), s["rows"])
  given = [int(x) for x in args.slots.split(",")] if args.slots else []
  record["slots"] = {m: given[i] if i < len(given) else b
                     for i, (m, b) in enumerate(batches.items())}  # First to run first.
  shape = ran.pop("shape")
  out = dict(engine="today's (lock-step turns, sub-agent waves)", task=args.task,
             policy=args.policy, turn_lengths=args.turn_lengths if args.policy == "random"
             else None, seed=args.seed, questions=args.questions, rollouts=args.rollouts,
             slots=record["slots"], largest_batch=batches, tool_latency_ms=args.tool_latency_ms,
             price_as=args.price_as, command="python benchmarks/engine.py " + " ".join(
                 sys.argv[1:] if argv is None else argv),
             **metrics(record, models.get_preset(args.price_as)),
             per_model={m: _per_model(record, m) for m in batches},
             ran=dict(ran, model=dict(layers=shape.num_layers, hidden=shape.hidden_size,
                                      vocab=shape.vocab_size)),
             wall_seconds=round(time.perf_counter() - start, 1),
             cpu_seconds=round(time.process_time() - cpu, 1))
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  print(json.dumps({k: v for k, v in out.items() if k not in ("per_model", "ran")}))
  return out


def _per_model(record: dict, model: str) -> dict:
  steps = [s for s in record["steps"] if s["model"] == model]
  prefills = [p for p in record["prefills"] if p["model"] == model]
  kept = sum(t["tokens"] for t in record["turns"].values() if t["model"] == model)
  return dict(decode_steps=len(steps), kept_tokens=kept,
              slot_occupancy=round(kept / max(1, sum(s["rows"] for s in steps)), 4),
              live_over_rows=round(sum(s["live"] for s in steps)
                                   / max(1, sum(s["rows"] for s in steps)), 4),
              kv_read_over_live=round(sum(s["kv_read"] for s in steps)
                                      / max(1, sum(s["live_len"] for s in steps)), 4),
              prefill_computed_over_needed=round(sum(p["computed"] for p in prefills)
                                                 / max(1, sum(p["needed"] for p in prefills)),
                                                 4))


if __name__ == "__main__":
  main()
