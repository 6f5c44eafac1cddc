"""Bytes exchanged per step and exchange latency per main-agent turn (decoupled M-GRPO).

  python benchmarks/exchange.py                        # file:// exchange in a temp dir
  python benchmarks/exchange.py --exchange=file:///mnt/shared/x --steps=5
  python benchmarks/exchange.py --exchange='{"driver": "s3", "bucket": "b", "path": "x",
      "endpoint": "http://127.0.0.1:5000", "aws_region": "us-east-1"}'

The main agent and the sub-agent run as two threads of this process, each with its own
`Exchange` object on the same store (the pattern of tests/test_decoupled.py), with the
scripted experts as policies so that the main agent delegates on most turns. Per step the
main side runs Q questions x K rollouts (`rollout_main` through `ExchangeSubAgent`),
then publishes R_M / correct / format; the sub side serves every wave (`serve_step`) and
reads the outcome back.

Reported per step: the bytes written + read by both sides (`Exchange.stats()`: stored JSON
records with their envelope, raw array bytes plus commit records), next to the bytes of
the sub-agent trajectories that the reference implementation (MrlX) ships from the
sub-agent's rollout workers to the trainer instead. That figure is a conservative lower
bound: per token 4 bytes (int32 id) + 4 bytes (float32 behaviour log-prob) + 1 byte (loss
mask), with no framing, padding, attention masks, rewards or serialisation overhead. The
tokens are counted with this repo's byte tokenizer (1 token per UTF-8 byte), which
inflates the count relative to a BPE tokenizer, so a second, BPE-equivalent figure
divides it by 4 (about 4 bytes of English per BPE token): the honest comparison lies
between the two, and we quote the smaller.

Latency per main-agent turn (one wave: put the requests and the wave record, wait for
every result) is the main side's wall-clock round trip. It includes the sub-agent's own
work on the wave (expert policies here, cheap), measured separately on the sub side; the
difference is the exchange's overhead (writes, polling with backoff, reads).

Writes benchmarks/results/exchange-<device>.json; the last line printed is the ratio.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mgrpo_jax.mgrpo import delegation  # noqa: E402
from mgrpo_jax import byte_tokenizer  # noqa: E402
from mgrpo_jax.agents import experts, rollout  # noqa: E402
from mgrpo_jax.envs import retrieval, search, world  # noqa: E402
from mgrpo_jax.exchange import Exchange  # noqa: E402
from mgrpo_jax.mgrpo import hierarchy  # noqa: E402

TOK = byte_tokenizer.ByteTokenizer()
MRLX_BYTES_PER_TOKEN = 4 + 4 + 1  # int32 id + float32 log-prob + uint8 loss mask.
BYTES_PER_BPE_TOKEN = 4  # English text per BPE token (for the BPE-equivalent figure).


class TimedService:
  """The sub side's service, timing each wave it serves."""

  def __init__(self, inner):
    self.inner, self.seconds = inner, []

  @property
  def episodes(self):
    return self.inner.episodes

  def delegate(self, requests):
    start = time.perf_counter()
    out = self.inner.delegate(requests)
    self.seconds.append(time.perf_counter() - start)
    return out


class TimedExchangeSubAgent(delegation.ExchangeSubAgent):
  """The main side's `ExchangeSubAgent`, timing each wave's round trip."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.seconds, self.sizes = [], []

  def delegate(self, requests):
    start = time.perf_counter()
    out = super().delegate(requests)
    self.seconds.append(time.perf_counter() - start)
    self.sizes.append(len(requests))
    return out


def _summary(xs):
  xs = list(xs)
  if not xs:
    return {"n": 0}
  return {"n": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs),
          "p90": float(np.percentile(xs, 90)), "max": max(xs)}


def run(args) -> dict:
  w = world.generate_world(world.WorldConfig(seed=args.seed))
  index = retrieval.Bm25Retriever.from_documents(w.documents)
  questions = world.make_questions(w, num=args.queries * args.steps, seed=args.seed + 1)
  limits = rollout.Limits(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                          max_len=args.max_len, max_delegations=args.max_delegations)
  tmp = None
  url = args.exchange
  if url is None:
    tmp = tempfile.mkdtemp(prefix="exchange-bench-")
    url = f"file://{tmp}/exchange"
  main_ex, sub_ex = Exchange(url, run=f"bench-{os.getpid()}-{time.time_ns()}"), None
  sub_ex = Exchange(url, run=main_ex.run)

  steps = []
  for step in range(args.steps):
    qs = questions[step * args.queries:(step + 1) * args.queries]
    key = jax.random.fold_in(jax.random.key(args.seed), step)
    sub_policy = rollout.ExpertPolicy(experts.SubExpert(noise=args.noise), TOK,
                                      seed=1000 + step, version=step)
    service = TimedService(rollout.ColocatedSubAgent(
        sub_policy, TOK, search.local_tools(index), limits=limits, key=key))
    served, errors = {}, []

    def sub_side():
      try:
        served["outcome"] = delegation.serve_step(sub_ex, service, step, timeout_s=120)
      except Exception as e:  # Surfaced below.
        errors.append(e)

    main_ex.stats(reset=True)
    sub_ex.stats(reset=True)
    thread = threading.Thread(target=sub_side)
    start = time.perf_counter()
    thread.start()
    main_side = TimedExchangeSubAgent(main_ex, step=step, timeout_s=120)
    main_policy = rollout.ExpertPolicy(experts.MainExpert(noise=args.noise), TOK,
                                       seed=2000 + step, version=step)
    eps = rollout.rollout_main(main_policy, main_side, qs, num_rollouts=args.rollouts,
                               tokenizer=TOK, limits=limits, key=key, step=step)
    outcome = hierarchy.main_outcomes(eps, [q.answer for q in qs], len(qs), args.rollouts)
    delegation.publish_outcome(main_ex, step, outcome, main_side.waves)
    thread.join(timeout=300)
    wall = time.perf_counter() - start
    if errors or thread.is_alive():
      raise RuntimeError(f"sub side failed at step {step}: {errors}")
    np.testing.assert_array_equal(served["outcome"].correct, outcome.correct)

    ms, ss = main_ex.stats(), sub_ex.stats()
    sub_eps = service.episodes
    traj_tokens = sum(len(e.tokens) for e in sub_eps)
    exchanged = ms["bytes_written"] + ms["bytes_read"] + ss["bytes_written"] + ss["bytes_read"]
    by_kind = {}
    for side in (ms, ss):
      for kind, c in side["by_kind"].items():
        d = by_kind.setdefault(kind, {"bytes_written": 0, "bytes_read": 0})
        d["bytes_written"] += c.get("bytes_written", 0)
        d["bytes_read"] += c.get("bytes_read", 0)
    # Pair the main side's round trips with the sub side's service times, wave by wave.
    overhead = [rt - sv for rt, sv in zip(main_side.seconds, service.seconds)]
    steps.append({
        "step": step, "wall_s": wall, "waves": main_side.waves,
        "delegations": len(sub_eps), "wave_sizes": main_side.sizes,
        "main_accuracy": float(np.mean(outcome.correct)),
        "exchange": {
            "bytes_written": ms["bytes_written"] + ss["bytes_written"],
            "bytes_read": ms["bytes_read"] + ss["bytes_read"],
            "bytes_total": exchanged,
            "records_written": ms["records_written"] + ss["records_written"],
            "polls": ms["polls"] + ss["polls"],
            "by_kind": by_kind},
        "sub_trajectories": {
            "episodes": len(sub_eps), "tokens_byte_tokenizer": traj_tokens,
            "mrlx_bytes_lower_bound": traj_tokens * MRLX_BYTES_PER_TOKEN,
            "mrlx_bytes_bpe_equivalent":
                traj_tokens * MRLX_BYTES_PER_TOKEN // BYTES_PER_BPE_TOKEN},
        "wave_round_trip_s": main_side.seconds,
        "wave_sub_service_s": service.seconds,
        "wave_exchange_overhead_s": overhead,
    })

  if tmp is not None:
    shutil.rmtree(tmp, ignore_errors=True)
  cat = lambda f: [x for s in steps for x in s[f]]
  per_step = lambda f: statistics.fmean(f(s) for s in steps)
  exchanged = per_step(lambda s: s["exchange"]["bytes_total"])
  written = per_step(lambda s: s["exchange"]["bytes_written"])
  mrlx = per_step(lambda s: s["sub_trajectories"]["mrlx_bytes_lower_bound"])
  mrlx_bpe = per_step(lambda s: s["sub_trajectories"]["mrlx_bytes_bpe_equivalent"])
  result = {
      "benchmark": "exchange",
      "device": jax.devices()[0].device_kind, "platform": platform.platform(),
      "cpu_count": os.cpu_count(), "exchange": json.dumps(main_ex.spec, sort_keys=True),
      "config": {k: getattr(args, k) for k in ("queries", "rollouts", "steps", "max_turns",
                                               "max_new_tokens", "max_len",
                                               "max_delegations", "noise", "seed")},
      "assumptions": {
          "mrlx_bytes_per_token": MRLX_BYTES_PER_TOKEN,
          "mrlx_bytes_note": "sub-agent trajectories as int32 ids + float32 log-probs + "
                             "uint8 loss mask, no framing/padding/rewards: a lower bound",
          "bpe_equivalent_note": f"byte-tokenizer token count / {BYTES_PER_BPE_TOKEN} "
                                 "(~4 bytes of English text per BPE token)",
          "exchange_bytes_note": "Exchange.stats() of both sides, written + read: JSON "
                                 "records with envelope, raw array bytes + commit records; "
                                 "zarr .zarray metadata (~150 B per array) not counted",
          "latency_note": "round trip per main-agent turn (wave) on the main side; "
                          "overhead = round trip - sub-agent service time of that wave"},
      "summary": {
          "bytes_exchanged_per_step": exchanged,
          "bytes_written_per_step": written,
          "mrlx_trajectory_bytes_per_step_lower_bound": mrlx,
          "mrlx_trajectory_bytes_per_step_bpe_equivalent": mrlx_bpe,
          "ratio_mrlx_bpe_equivalent_over_exchange": mrlx_bpe / exchanged,
          "ratio_mrlx_byte_tokens_over_exchange": mrlx / exchanged,
          # MrlX's trajectories are shipped once; counting only our writes is the
          # like-for-like comparison (each record is also read once by the peer).
          "ratio_mrlx_bpe_equivalent_over_exchange_written": mrlx_bpe / written,
          "delegations_per_step": per_step(lambda s: s["delegations"]),
          "waves_per_step": per_step(lambda s: s["waves"]),
          "exchange_bytes_per_delegation":
              exchanged / max(1.0, per_step(lambda s: s["delegations"])),
          "wave_round_trip_s": _summary(cat("wave_round_trip_s")),
          "wave_sub_service_s": _summary(cat("wave_sub_service_s")),
          "wave_exchange_overhead_s": _summary(cat("wave_exchange_overhead_s")),
          "step_wall_s": _summary(s["wall_s"] for s in steps)},
      "steps": steps,
  }
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--exchange", default=None, help="URL or JSON spec (default: temp file://)")
  p.add_argument("--queries", type=int, default=4)
  p.add_argument("--rollouts", type=int, default=8)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--max_turns", type=int, default=6)
  p.add_argument("--max_new_tokens", type=int, default=160)
  p.add_argument("--max_len", type=int, default=4096)
  p.add_argument("--max_delegations", type=int, default=4)
  p.add_argument("--noise", type=float, default=0.2)
  p.add_argument("--seed", type=int, default=4)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  result = run(args)
  s = result["summary"]
  out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"exchange-{jax.default_backend()}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  ms = lambda d: f"mean {1e3 * d['mean']:.1f} ms, median {1e3 * d['median']:.1f} ms " \
                 f"(n={d['n']})" if d["n"] else "n=0"
  print(f"exchange: {result['exchange']}")
  print(f"Q={args.queries} x K={args.rollouts}, {args.steps} steps: "
        f"{s['delegations_per_step']:.1f} delegations and {s['waves_per_step']:.1f} waves "
        f"per step")
  print(f"bytes exchanged per step (written + read, both sides): "
        f"{s['bytes_exchanged_per_step']:,.0f} ({s['exchange_bytes_per_delegation']:,.0f} "
        f"per delegation); written only: {s['bytes_written_per_step']:,.0f}")
  print(f"MrlX sub-agent trajectory bytes per step (lower bound, 9 B/token): "
        f"{s['mrlx_trajectory_bytes_per_step_lower_bound']:,.0f} with byte tokens, "
        f"{s['mrlx_trajectory_bytes_per_step_bpe_equivalent']:,.0f} BPE-equivalent")
  print(f"wave round trip: {ms(s['wave_round_trip_s'])}; sub-agent work: "
        f"{ms(s['wave_sub_service_s'])}; exchange overhead: "
        f"{ms(s['wave_exchange_overhead_s'])}")
  print(f"wrote {out}")
  print(f"trajectory bytes / exchange bytes (BPE-equivalent lower bound): "
        f"{s['ratio_mrlx_bpe_equivalent_over_exchange']:.1f}x written+read, "
        f"{s['ratio_mrlx_bpe_equivalent_over_exchange_written']:.1f}x written only")


if __name__ == "__main__":
  main()
