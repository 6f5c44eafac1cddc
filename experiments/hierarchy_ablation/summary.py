"""The hierarchy ablation's statistics over its runs: per-variant intervals over seeds, paired
differences, question-level tests, the verdict, and the sweep's JSON merged across invocations.
"""

import json
import os
import platform
import sys
import time

import jax
import numpy as np

from experiments.hierarchy_ablation import config as ablation
from experiments.hierarchy_ablation import instrument as hi
from experiments.hierarchy_ablation.instrument import git_commit
from experiments.hierarchy_ablation.runs import Options
from mgrpo_jax import plotting

ENTRY = "python -m experiments.hierarchy_ablation.sweep"  # The command a JSON records.


def summarize(records: list[dict], first_page: dict | None = None) -> dict:
  """Per variant: mean and 95% t-interval over seeds of every eval metric, by step and final.
  `first_page` (question id -> page, `hi.first_pages`): the question-level view also by page."""
  out = {}
  for variant in dict.fromkeys(r["variant"] for r in records if r["kind"] == "rl"):
    # By seed, whichever finished first: every per-seed list below is in this order.
    runs = sorted((r for r in records if r["kind"] == "rl" and r["variant"] == variant),
                  key=lambda r: r["seed"])
    steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    keys = sorted(set.intersection(*({k for e in r["evals"] for k in e} for r in runs))
                  - {"step"})
    curves = {}
    for key in keys:
      stack = np.array([[next(e[key] for e in r["evals"] if e["step"] == s) for s in steps]
                        for r in runs])
      mean, half = plotting.t_interval(stack)
      curves[key] = dict(mean=mean.round(4).tolist(), ci95=_nan_to_none(half),
                         seeds=stack.round(4).tolist())
    final = {k: dict(mean=v["mean"][-1], ci95=v["ci95"][-1], seeds=[s[-1] for s in v["seeds"]])
             for k, v in curves.items()}
    # What RL added to the warm start: final minus first evaluation, seed by seed.
    gain = {k: [s[-1] - s[0] for s in curves[k]["seeds"]] for k in _accuracy_keys(curves)}
    out[variant] = dict(seeds=[r["seed"] for r in runs], steps=steps, curves=curves,
                        final=final, gain=_difference_intervals(gain),
                        train_means={k: float(np.mean([r["train_means"][k] for r in runs]))
                                     for k in runs[0]["train_means"]})
  if "mgrpo" in out:
    for variant, s in out.items():
      if variant != "mgrpo":
        s["mgrpo_minus"] = _difference_intervals(_minus(out["mgrpo"], s))
        s["mgrpo_vs_by_question"] = question_tests(records, "mgrpo", variant, first_page)
  # A control against the variant it controls for, the same way round (control minus it).
  for control, base in ablation.CONTROLLED.items():
    if control in out and base in out:
      out[control][f"minus_{base}"] = _difference_intervals(_minus(out[control], out[base]))
      out[control][f"vs_{base}_by_question"] = question_tests(records, control, base,
                                                              first_page)
  return out


def question_tests(records: list[dict], a: str, b: str,
                   first_page: dict | None = None) -> list[dict]:
  """The question-level view, seed by seed: of the test questions on which variants `a` and
  `b` (same seed, final weights) disagree, how many only `a` answers right (a_only) and only
  `b` (b_only), and McNemar's exact two-sided p (binomial on the discordant questions); with
  `first_page`, the same by the page a question's chain opens on (`hi.sign_test_by_page`)."""
  logs = {(r["variant"], r["seed"]): r["questions"] for r in records
          if r["kind"] == "rl" and "questions" in r}
  out = []
  for seed in sorted({s for v, s in logs if v == a} & {s for v, s in logs if v == b}):
    out.append(dict(seed=seed, **hi.mcnemar_records(logs[(a, seed)], logs[(b, seed)],
                                                    f"seed {seed}: {a} and {b}", first_page)))
  return out


def _accuracy_keys(curves: dict) -> list[str]:
  return [k for k in curves if k == "accuracy" or k.startswith("accuracy_hops")]


def _minus(one: dict, other: dict) -> dict[str, list[float]]:
  """`one`'s final accuracy minus `other`'s (two variants' summaries), per key, over the seeds
  both ran."""
  out = {}
  for key in _accuracy_keys(other["curves"]):
    if key in one["curves"]:
      mine, theirs = ({seed: s[-1] for seed, s in zip(v["seeds"], v["curves"][key]["seeds"])}
                      for v in (one, other))
      out[key] = [mine[k] - theirs[k] for k in sorted(mine.keys() & theirs.keys())]
  return out


def _difference_intervals(diffs: dict[str, list[float]]) -> dict:
  """Mean and 95% t-interval of each key's per-seed differences: an interval that excludes 0
  says the difference is beyond seed noise."""
  out = {}
  for key, diff in diffs.items():
    if diff:
      mean, half = plotting.t_interval(np.asarray(diff)[:, None])
      out[key] = dict(mean=round(float(mean[0]), 4), ci95=_nan_to_none(half)[0],
                      seeds=[round(d, 4) for d in diff])
  return out


def _nan_to_none(x: np.ndarray) -> list:
  return [None if not np.isfinite(v) else round(float(v), 4) for v in x]


def plot(records: list[dict], out_png: str, size: str) -> str:
  """Accuracy by step: mean and 95% t-interval over seeds per variant."""
  runs = {f"{r['variant']}_seed{r['seed']}": [{"step": e["step"], **{f"eval/{k}": v
                                                                     for k, v in e.items()}}
                                              for e in r["evals"]]
          for r in records if r["kind"] == "rl"}
  keys = sorted({k for recs in runs.values() for e in recs for k in e
                 if k == "eval/accuracy" or k.startswith("eval/accuracy_hops")})
  return plotting.plot_curves(runs, keys, out_png, group_by="_seed", band="t95", ncols=3,
                              title=f"Held-out accuracy, multi-hop task ({size}); "
                                    "mean and 95% t-interval over seeds")


def verdict(summary: dict, records: list[dict], margin: float = hi.EFFECT,
            seeds_needed: int | None = None) -> dict:
  """Whether the table may rank the variants: only when M-GRPO's final accuracy beats the best
  baseline that reads nothing (the no-tool guesser, the closed-book warm start) by `margin`.

  `seeds_needed` (the power analysis's): until every variant in `ablation.COMPARED` has run
  that many seeds the verdict is `provisional`, a statement about the seeds so far.
  """
  base = {r["kind"]: r["evals"][-1]["accuracy"] for r in records
          if r["kind"] in ("no_tool", "closed_book") and r["evals"][-1].get("accuracy") is not None}
  if "mgrpo" not in summary or not base:
    return dict(informative=None, reason="M-GRPO or the no-reading baselines have not run yet")
  best = max(base, key=base.get)
  lead = summary["mgrpo"]["final"]["accuracy"]["mean"] - base[best]
  ok = lead >= margin
  seeds = {v: len(summary.get(v, {}).get("seeds", [])) for v in ablation.COMPARED}
  provisional = seeds_needed is not None and min(seeds.values()) < seeds_needed
  so_far = (f" (provisional: seeds so far {', '.join(f'{v} {n}' for v, n in seeds.items())} "
            f"of {seeds_needed})") if provisional else ""
  return dict(informative=ok, provisional=provisional, seeds=seeds, seeds_needed=seeds_needed,
              baselines=base, best_baseline=best, mgrpo_lead=round(lead, 4), margin=margin,
              reason=(f"M-GRPO leads {best} by {lead:+.3f}" + (
                  "" if ok else f" < {margin}: the instrument is uninformative; the table does "
                  "not rank the variants") + so_far))


def _key(r: dict) -> str:
  return f"{r['kind']}/{r['variant']}/{r.get('seed', '')}"


def _family(r: dict) -> str | None:
  """The warm start a run started from (its WARM_START name); None for what reads none."""
  if r["kind"] == "closed_book":
    return "mgrpo"
  return ablation.WARM_START.get(r["variant"]) if r["kind"] == "rl" else None


def split_by_warm_start(records: list[dict]) -> tuple[list[dict], list[dict]]:
  """(the records of the warm starts the JSON holds, the runs that started from another).

  A warm start made again (a new machine lost the old one before it was archived) is another
  draw of the same recipe: the runs from the old one are kept aside, not mixed into the
  summary with the new one's. A run without `init_digest` predates digests: it counts as from
  another warm start once its family's warm start has a digest."""
  digests = {r["variant"]: r.get("digest") for r in records if r["kind"] == "warm_start"}
  keep, other = [], []
  for r in records:
    family = _family(r)
    known = digests.get(family) if family else None
    (other if known and r.get("init_digest") != known else keep).append(r)
  return keep, other


def earlier_runs(path: str) -> list[dict]:
  """The runs an earlier invocation wrote to `path` (none when there is no JSON yet)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f).get("runs", [])


def check_split(path: str, split: str) -> None:
  """Raises ValueError when the sweep JSON at `path` holds invocations on another evaluation
  split: validation (tuning) runs never merge into the test table, nor the reverse."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    _check_split(json.load(f), path, split)


def _check_split(old: dict, path: str, split: str) -> None:
  other = sorted({i.get("eval_split", "test") for i in old.get("invocations", [])} - {split})
  if other:
    raise ValueError(f"--out {path} holds runs evaluated on the {other[0]} split, this "
                     f"invocation evaluates on {split}: give it another --out (the default "
                     "for --eval_split=valid is hierarchy-heldout-valid-<size>.json).")


def write(records: list[dict], path: str, wall_s: float, power: dict,
          first_page: dict | None = None, *, opts: Options,
          started: float | None = None) -> list[dict]:
  """Writes the sweep's JSON, merged with the runs and invocations an earlier invocation wrote
  to `path` (a sweep split over sessions: --seed_start / --only with --reuse); returns the
  merged records the summary is made from. `first_page`: as `summarize`'s.

  `started` (time.time() when this invocation began; default: now - `wall_s`) names this
  invocation's entry in `invocations` with its command and process id: a later write of
  the same invocation replaces it, and two invocations started in the same second beside
  each other are both kept."""
  old = {}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  _check_split(old, path, opts.eval_split)
  # Runs of a JSON from before this protocol (no invocations recorded) are not merged.
  merged = {_key(r): r for r in old.get("runs", [])} if "invocations" in old else {}
  # A warm start made again, and a record (closed_book) of the new one, replace the old ones'
  # records, which are kept aside.
  made_from = lambda r: r.get("digest") if r["kind"] == "warm_start" else r.get("init_digest")
  replaced = [merged[_key(r)] for r in records if _key(r) in merged
              and (r["kind"] == "warm_start" or _family(r))
              and made_from(merged[_key(r)]) != made_from(r)]
  merged.update({_key(r): r for r in records})
  records, aside = split_by_warm_start(list(merged.values()))
  aside = old.get("other_warm_start_runs", []) + replaced + aside
  invocation = dict(
      command=" ".join([ENTRY] + sys.argv[1:]),
      commit=git_commit(), wall_s=round(wall_s, 1), eval_split=opts.eval_split,
      started=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                            time.gmtime(time.time() - wall_s if started is None else started)),
      pid=os.getpid(),
      machine=dict(cpus=os.cpu_count(), platform=platform.platform(), jax=jax.__version__,
                   devices=str(jax.devices()),
                   loadavg_at_end=[round(x, 2) for x in os.getloadavg()]))
  ident = lambda i: (i.get("started"), i.get("command"), i.get("pid"))
  invocations = [i for i in old.get("invocations", [])
                 if ident(i) != ident(invocation)] + [invocation]
  summary = summarize(records, first_page)
  covered = {v: s["seeds"] for v, s in summary.items()}
  split = opts.eval_split
  split_flag = "" if split == "test" else f" --eval_split={split}"
  out = dict(
      command=f"{ENTRY} --size={opts.size} --seeds="
              f"{power['seeds']}{split_flag} --reuse, as {len(invocations)} invocation(s) "
              f"(listed in invocations); seeds run so far per variant: {covered}",
      # The sweep as a whole: every warm start's and run's own wall time (each counted once;
      # not those of other_warm_start_runs).
      runs_wall_s=round(sum(r.get("wall_s", 0) for r in records), 1),
      invocations=invocations, power_analysis=power,
      note=("Greedy accuracy on the test split (world.holdout: whole chains of held-out "
            "entities, used for nothing else)" if split == "test" else
            "Greedy accuracy on the validation split (world.holdout; for tuning choices, not "
            "for the table)") + "; intervals are mean +- t_{0.975, n-1} * sd / "
            "sqrt(n) over seeds. Wall times include compilation and evaluation, but for a "
            "closed-book record kept from an earlier invocation (its wall_s is that "
            "invocation's).",
      verdict=verdict(summary, records, seeds_needed=power["seeds"]), summary=summary,
      runs=records,
      other_warm_start_runs=aside)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  return records


def table(summary: dict) -> str:
  """The final table: per variant, accuracy (overall, by pages needed), overflow and
  delegations at the last step, with what RL added and the paired differences."""
  lines = []
  for variant, s in summary.items():
    f = s["final"]
    cell = lambda k: (f"{f[k]['mean']:.3f}" + (f" +- {f[k]['ci95']:.3f}" if f[k]["ci95"]
                                                is not None else "")) if k in f else "-"
    hops = "  ".join(f"h{k[-1]} {cell(k)}" for k in sorted(f) if k.startswith("accuracy_hops"))
    lines.append(f"{variant:10s} step {s['steps'][-1]}: accuracy {cell('accuracy')}  {hops}  "
                 f"overflow {cell('overflow')}  delegations {cell('delegations')}")
    for name in ("gain", "mgrpo_minus",
                 *(f"minus_{b}" for b in ablation.CONTROLLED.values())):
      if "accuracy" in s.get(name, {}):
        d = s[name]["accuracy"]
        half = f" +- {d['ci95']:.3f}" if d["ci95"] is not None else ""
        lines.append(f"{'':10s} {name}: {d['mean']:+.3f}{half} (per seed {d['seeds']})")
  return "\n".join(lines)
