"""How well the agent engine keeps its decode slots busy, from the record of its schedule.

  python benchmarks/engine.py --task=multihop --policy=expert --questions=2 --rollouts=8
  python benchmarks/engine.py --task=multihop --policy=random --turn_lengths=lognormal:4,1 \
      --questions=32 --rollouts=8 --slots=32,64 --out=/tmp/engine.json

The episodes run through the real engine (`agents.rollout.rollout_main` over
`engine/run.py`'s lanes of slots; MAGRPO's `magrpo.rollout.joint_rollout`) on a one-layer
random model, the engine keeping its schedule record (`engine/record.py`). `expert`: each
turn is the scripted expert's (its length forced on the sampler, its text what the episode
keeps); `random`: the experts' actions in turns whose lengths are drawn from
`--turn_lengths`. The figures are `engine.record.metrics` of the record, priced on
`--price_as` (docs/results/engine.md). The engine before slots was measured once, by a
recorder of its own, into benchmarks/results/engine-old-*.json.
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
import numpy as np  # noqa: E402

from mgrpo_jax import kv_cache_plan  # noqa: E402
from mgrpo_jax.engine import lanes, record as record_lib  # noqa: E402

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



def _shape(vocab: int, max_len: int, attention: str):
  """The one-layer random model that runs the schedule on CPU (its size changes no figure
  but wall time: the schedule is the engine's, the prices are `--price_as`'s). With
  attention="ragged" the record counts the KV the GPU kernel reads (on CPU the XLA path
  runs: the same numbers, read to the window)."""
  from mgrpo_jax import models
  return models.Qwen3Config(vocab_size=-(-vocab // 64) * 64, hidden_size=16,
                            intermediate_size=32, num_layers=1, num_heads=1, num_kv_heads=1,
                            head_dim=8, rope_theta=10_000.0, tie_embeddings=True,
                            max_position_embeddings=max(4096, max_len), attention=attention)


AGENT_CONFIGS = {"multihop": "task=multihop,gpu,policy=expert", "qa": "task=qa,gpu,policy=expert"}


def _latency(fn, seconds: float):
  """`fn` with `seconds` of wall time added per call (a remote service's round trip)."""
  def call(*args, **kw):
    out = fn(*args, **kw)
    time.sleep(seconds)
    return out
  return call


def _forced(expert, lengths: Lengths, tok, limit: int):
  """The lane's `force`: the expert's next turn of an episode, at the drawn length."""
  return lambda ep: lengths.shape(expert.turn_ids(ep), tok, limit,
                                  f"{ep.role}/{ep.q}/{ep.k}/{ep.call}/{len(ep.turns)}")


def run_agents(args, record, lengths: Lengths, slots: list) -> dict:
  """M-GRPO's main agent and colocated sub-agent on `args.task`; returns what ran."""
  from configs import mgrpo as mgrpo_config
  from mgrpo_jax import models
  from mgrpo_jax.agents import rollout
  from mgrpo_jax.mgrpo import play, setup, tasks
  c = mgrpo_config.get_config(AGENT_CONFIGS[args.task])
  if args.task == "qa":
    c.data.update(format="musique", eval=args.qa_data)
  env = tasks.build_env(c)
  env.tools = {name: _latency(fn, args.tool_latency_ms / 1e3) for name, fn in env.tools.items()}
  wiring = setup.resolve_wiring(c)
  experts = play.expert_policies(c, wiring, env)
  lim = play.limits(c)
  shape = _shape(env.tokenizer.vocab_size, lim.max_len, args.attention)
  params = models.init_params(shape, jax.random.key(args.seed))
  policies = {role: rollout.LLMPolicy(shape, params, env.tokenizer, role, limits=lim,
                                      chunk=c.sampling.chunk,
                                      slots=slots[i] if i < len(slots) else 0,
                                      share_prompts=args.share_prompts)
              for i, role in enumerate(("main", "sub"))}
  force = {role: _forced(experts[role], lengths, env.tokenizer, lim.max_new_tokens)
           for role in policies}
  pool = env.train if args.task == "multihop" else env.test
  pick = np.random.default_rng(args.seed).choice(len(pool), args.questions,
                                                 replace=args.questions > len(pool))
  key = jax.random.key(args.seed)
  service = play.colocated_sub_agent(c, env, policies["sub"], key)
  eps = rollout.rollout_main(policies["main"], service, [pool[i] for i in pick],
                             num_rollouts=args.rollouts, tokenizer=env.tokenizer, limits=lim,
                             key=jax.random.fold_in(key, 0), tools={"python": env.tools["python"]},
                             system_prompt=c.world.system_prompt, record=record, force=force)
  sub_eps = service.episodes
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


def _forced_code(agent: int, examples, lengths: Lengths, tok, limit: int):
  """A MAGRPO lane's `force`: the code expert's text for a job's prompt, at a drawn length
  (row r of turn t named `agent/t/r`, joint_rollout's order whatever the engine)."""

  def force(job):
    text = tok.decode(job.tokens)
    ex = next(e for e in examples if f"def {e.entry_point}(" in text)
    return lengths.shape(tok.encode(_code_expert(ex, agent)), tok, limit,
                         f"{agent}/{job.k}/{job.q}")

  return force


def run_magrpo(args, record, lengths: Lengths, slots: list) -> dict:
  """MAGRPO's joint rollout on the code task (HumanEval, two agents, `args.turns` turns):
  `args.questions` prompts x `args.rollouts` samples per agent per node."""
  from configs import magrpo as magrpo_config
  from mgrpo_jax import models
  from mgrpo_jax import tokenizer_io
  from mgrpo_jax.magrpo import rollout, tasks
  arg = f"task=code,turns={args.turns}"
  c = magrpo_config.get_config(arg)
  task = tasks.build_task(c.task)
  tok = tokenizer_io.load_tokenizer(c.tokenizer)
  latency, workers = args.tool_latency_ms / 1e3, c.task.workers
  base_score = task.score

  def score(examples, outputs):  # The sandbox runs `workers` joint actions at a time.
    start = time.perf_counter()
    out = _latency(base_score, latency * -(-len(outputs) // workers))(examples, outputs)
    record.tools.append((start, time.perf_counter()))
    return out

  task = dataclasses.replace(task, score=score)
  shape = _shape(tok.vocab_size, c.max_len, args.attention)
  params = models.init_params(shape, jax.random.key(args.seed))
  pick = np.random.default_rng(args.seed).choice(len(task.train), args.questions, replace=False)
  examples = [task.train[i] for i in pick]
  policies = []
  for i in range(task.num_agents):
    pol = rollout.Policy(shape, params, tok, max_new_tokens=c.max_new_tokens, max_len=c.max_len,
                         temperature=c.sampling.temperature, top_p=c.sampling.top_p,
                         top_k=c.sampling.top_k, chunk=c.sampling.chunk,
                         slots=slots[i] if i < len(slots) else 0,
                         share_prompts=args.share_prompts)
    pol.record = record
    pol.force = _forced_code(i, examples, lengths, tok, c.max_new_tokens)
    policies.append(pol)
  turns = rollout.joint_rollout(task, policies, examples, group=args.rollouts,
                                mode=c.joint_mode, num_turns=c.num_turns,
                                key=jax.random.key(args.seed))
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
  p.add_argument("--slots", default="", help="MAIN,SUB (MAGRPO: per agent) decode slots; "
                 "empty: one per episode that can run at once (a power of two).")
  p.add_argument("--tool_latency_ms", type=float, default=50.0)
  p.add_argument("--turns", type=int, default=2, help="magrpo: turns of the joint rollout.")
  p.add_argument("--qa_data", default="/work/shared/data/musique_sample.jsonl")
  p.add_argument("--attention", default="ragged", choices=("ragged", "auto"),
                 help="The decode attention priced: each row to its own length (ragged, GPU) "
                 "or every slot to the window (auto: XLA).")
  p.add_argument("--price_as", default="qwen3_8b", help="Model preset priced on an H100.")
  p.add_argument("--share_prompts", action="store_true",
                 help="A prompt several episodes start from held once, in a pool row.")
  p.add_argument("--warmup", type=int, default=1, help="Run the workload this many times "
                 "before the measured run: its programs compiled (once per run of training), "
                 "so compiling does not hold the engine while tools run.")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  from mgrpo_jax import models
  record = record_lib.Record()
  # The schedule of the priced model (Qwen3-8B), not the one-layer model run here's: its
  # prefill pads no unit, and its slots grow by need (their whole context is far over 1 GiB).
  lanes.PAD_UNITS_FLOPS = 0
  kv_cache_plan.WHOLE_CONTEXT_BYTES = 0
  given = [int(x) for x in args.slots.split(",")] if args.slots else []
  run = run_magrpo if args.task == "magrpo" else run_agents
  start = time.perf_counter()
  for _ in range(args.warmup):
    run(args, record_lib.Record(), _parse_lengths(args), given)
  warmup_s = time.perf_counter() - start
  start, cpu = time.perf_counter(), time.process_time()
  ran = run(args, record, _parse_lengths(args), given)
  record = record.as_dict()
  shape = ran.pop("shape")
  models_ran = list(record["slots"])
  out = dict(engine="slots (engine/run.py)", task=args.task,
             policy=args.policy, turn_lengths=args.turn_lengths if args.policy == "random"
             else None, seed=args.seed, questions=args.questions, rollouts=args.rollouts,
             slots=record["slots"], tool_latency_ms=args.tool_latency_ms,
             price_as=args.price_as, attention=args.attention,
             share_prompts=args.share_prompts,
             command="python benchmarks/engine.py " + " ".join(
                 sys.argv[1:] if argv is None else argv),
             **record_lib.metrics(record, models.get_preset(args.price_as)),
             per_model={m: _per_model(record, m) for m in models_ran},
             ran=dict(ran, model=dict(layers=shape.num_layers, hidden=shape.hidden_size,
                                      vocab=shape.vocab_size)),
             warmup=args.warmup, warmup_seconds=round(warmup_s, 1),
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
