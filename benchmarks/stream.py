"""Streamed delegations: how long each one waits for its answer, in decode steps.

  python benchmarks/stream.py                           # Q=4 x K=8, turns lognormal:4,1
  python benchmarks/stream.py --questions=8 --rollouts=8 --turn_lengths=lognormal:4,1 \
      --out=/tmp/stream.json

The decoupled protocol's two sides as two threads over a file:// exchange (each with its own
`Exchange`): the main agent is the scripted expert of `task=multihop` (it delegates every
hop) behind `ExchangeSubAgent`, which streams each delegation; the sub-agent program's
`serve_step` admits each request into its running engine and answers it as its episode ends.
The sub-agent is the one-layer random model of benchmarks/engine.py whose turns are the sub
expert's actions at lengths drawn from `--turn_lengths` (its forced turns), and its engine
keeps a schedule record (`engine/record.py`).

For every delegation, from the record: its answer latency in the sub-agent engine's decode
steps, from its admission to its last token (`streamed`); and the latency a wave barrier
would have given it on the same schedule, until the last delegation sent in the same batch
was done (`wave_barrier`: a lower bound for the protocol before streaming, which also
served one batch after another). Decode steps are the engine's clock, the same on any
hardware (up to when requests arrive). Writes benchmarks/results/stream-<backend>.json.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import mgrpo as mgrpo_config  # noqa: E402
from mgrpo_jax import models  # noqa: E402
from mgrpo_jax.agents import rollout  # noqa: E402
from mgrpo_jax.engine import record as record_lib  # noqa: E402
from mgrpo_jax.exchange import Exchange  # noqa: E402
from mgrpo_jax.mgrpo import delegation, play, setup, tasks  # noqa: E402


def _engine_benchmark():
  """benchmarks/engine.py (its random model and forced turns), loaded by path."""
  spec = importlib.util.spec_from_file_location("engine_benchmark",
                                                os.path.join(HERE, "engine.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class _Batches(delegation.ExchangeSubAgent):
  """The main side, noting the keys of each batch it sends."""

  def __init__(self, *args, **kw):
    super().__init__(*args, **kw)
    self.batches = []

  def send(self, requests):
    self.batches.append([k[1:] for k in self._keys(requests)])
    return super().send(requests)


class _Recorded(rollout.ColocatedSubAgent):
  """The sub side's service, its engine keeping `record` and forcing `force`'s turns."""

  record, force = None, None

  def serve(self, feed, **kw):
    return super().serve(feed, record=self.record, force=self.force, **kw)


def _summary(xs) -> dict:
  xs = list(xs)
  return {"n": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs),
          "p90": float(np.percentile(xs, 90)), "max": max(xs)}


def run(args) -> dict:
  eb = _engine_benchmark()
  c = mgrpo_config.get_config(eb.AGENT_CONFIGS["multihop"])
  env, wiring = tasks.build_env(c), setup.resolve_wiring(c)
  lim = play.limits(c)
  experts = play.expert_policies(c, wiring, env)
  shape = eb._shape(env.tokenizer.vocab_size, lim.max_len, "auto")
  params = models.init_params(shape, jax.random.key(args.seed))
  lengths = eb.Lengths("lognormal", *map(float, args.turn_lengths.split(":")[1].split(",")),
                       seed=args.seed)
  sub_policy = rollout.LLMPolicy(shape, params, env.tokenizer, "sub", limits=lim,
                                 chunk=c.sampling.chunk)
  key = jax.random.key(args.seed)
  sub = _Recorded(sub_policy, env.tokenizer,
                  {k: v for k, v in env.tools.items() if k in ("search", "visit")},
                  limits=lim, key=jax.random.fold_in(key, 1), system_prompt=c.world.system_prompt)
  sub.record = record_lib.Record()
  sub.force = {"sub": eb._forced(experts["sub"], lengths, env.tokenizer, lim.max_new_tokens)}
  pick = np.random.default_rng(args.seed).choice(len(env.train), args.questions, replace=False)
  questions = [env.train[i] for i in pick]

  with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
    url = f"file://{tmp}/exchange"
    main_side = _Batches(Exchange(url, run="stream"), step=0, timeout_s=600)
    errors = []

    def serve():
      try:
        delegation.serve_step(Exchange(url, run="stream"), sub, 0, timeout_s=600,
                              read_outcome=False, rows=args.questions * args.rollouts)
      except Exception as e:  # Surfaced below.
        errors.append(e)

    thread = threading.Thread(target=serve)
    start = time.perf_counter()
    thread.start()
    eps = rollout.rollout_main(experts["main"], main_side, questions,
                               num_rollouts=args.rollouts, tokenizer=env.tokenizer, limits=lim,
                               key=jax.random.fold_in(key, 0),
                               tools={"python": env.tools["python"]},
                               system_prompt=c.world.system_prompt)
    main_side.close()
    thread.join(timeout=600)
    wall = time.perf_counter() - start
    if errors or thread.is_alive():
      raise RuntimeError(f"The sub side failed: {errors}")

  turns = sub.record.turns
  span = {}  # (q, k, call) -> (admitted at, last token at), on the decode clock.
  for tid, t in turns.items():
    q, k, call, i = map(int, tid.split("/")[1:])
    first, last = span.get((q, k, call), (None, -1))
    span[q, k, call] = (t["ready"] if i == 0 else first, max(last, t["end"]))
  streamed, barrier, early = [], [], 0
  for batch in main_side.batches:
    done = max(span[d][1] for d in batch if d in span)
    for d in batch:
      if d in span:
        admitted, end = span[d]
        streamed.append(end - admitted + 1)
        barrier.append(done - admitted + 1)
        early += end < done
  s, b = _summary(streamed), _summary(barrier)
  return {
      "benchmark": "stream", "config": f"configs/mgrpo.py:{eb.AGENT_CONFIGS['multihop']}",
      "args": vars(args), "main_episodes": len(eps), "delegations": len(streamed),
      "batches": len(main_side.batches),
      "batch_size": _summary(len(x) for x in main_side.batches),
      "answer_latency_steps": {"streamed": s, "wave_barrier": b},
      "mean_latency_ratio_barrier_over_streamed": b["mean"] / s["mean"],
      "answered_before_their_batch_was_done": early / max(1, len(streamed)),
      "decode_steps": sub.record.clock,
      "result_polls_per_delegation": main_side.polls / max(1, main_side.requests),
      "wall_s": wall, "device": jax.devices()[0].device_kind}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--questions", type=int, default=4)
  p.add_argument("--rollouts", type=int, default=8)
  p.add_argument("--turn_lengths", default="lognormal:4,1")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  result = run(args)
  out = args.out or os.path.join(HERE, "results", f"stream-{jax.default_backend()}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  lat = result["answer_latency_steps"]
  print(f"{result['delegations']} delegations in {result['batches']} batches (mean size "
        f"{result['batch_size']['mean']:.1f}); answer latency in decode steps: streamed mean "
        f"{lat['streamed']['mean']:.0f} (p90 {lat['streamed']['p90']:.0f}), a wave barrier "
        f"mean {lat['wave_barrier']['mean']:.0f} (p90 {lat['wave_barrier']['p90']:.0f}); "
        f"{100 * result['answered_before_their_batch_was_done']:.0f}% answered before their "
        f"batch was done; {out}")


if __name__ == "__main__":
  main()
