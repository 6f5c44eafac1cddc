"""The hierarchy ablation's instrument and statistics: everything that needs no training.

Run by `python -m experiments.hierarchy_ablation.sweep --instrument` (its baselines by every sweep):
the split and leak statistics of the task, the baselines that train nothing (the no-tool
guesser; the scripted experts noise-free, the ceiling, and slipping as the warm start's
teacher), the power analysis that sets the sweep's seeds, and how many runs fit a session.
"""

import collections
import functools
import json
import os
import platform
import subprocess
import time

import numpy as np
from scipy import stats

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from experiments.hierarchy_ablation import config as ablation
from mgrpo_jax import evaluate
from mgrpo_jax.agents import experts
from mgrpo_jax.envs import multihop
from mgrpo_jax.envs import world as world_lib
from mgrpo_jax.mgrpo import sft, tasks
from mgrpo_jax.rl import rewards

SIZE_FLAG, EXTRA = ablation.SIZE_FLAG, ablation.EXTRA


@functools.cache
def git_commit() -> str:
  """HEAD's commit, with "+dirty" when tracked files differ from it ("unknown" outside git),
  as of the first call: the code this process runs, which a commit made while it runs (the
  sweep's invocations last hours) does not change. `sweep.main` calls it before
  anything is built (from the repository, as every invocation runs)."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


# The power analysis, fixed before the runs. The paired sd of M-GRPO minus
# frozen_sub over 5 seeds in the first CPU sweep (hierarchy-sweep-cpu.json at 0ce0b92): 5.4
# points. It is taken as the sd of the per-seed difference whatever the evaluation size (a
# conservative reading: part of it was the 128 questions' binomial noise, which a larger
# evaluation shrinks).
PAIRED_SD, EFFECT, POWER, ALPHA = 0.054, 0.05, 0.80, 0.05


def mcnemar(correct_a, correct_b) -> dict:
  """Two evaluations of the same questions (per-question correctness, same order): how many
  only `a` answers right (a_only), only `b` (b_only), and McNemar's exact two-sided p (the
  binomial test at 1/2 on the discordant questions; 1 when there are none)."""
  if len(correct_a) != len(correct_b):
    raise ValueError(f"{len(correct_a)} and {len(correct_b)} questions: not the same evaluation")
  a_only = sum(bool(x) and not y for x, y in zip(correct_a, correct_b))
  b_only = sum(bool(y) and not x for x, y in zip(correct_a, correct_b))
  p = stats.binomtest(a_only, a_only + b_only).pvalue if a_only + b_only else 1.0
  return dict(a_only=a_only, b_only=b_only, mcnemar_p=float(f"{p:.3g}"))


def sign_test_by_page(correct_a, correct_b, pages) -> dict:
  """The question-level comparison with the page as its unit. Questions whose chains open on
  the same page are not independent (the test split's 286 questions open on 30 pages, and on
  24 of them the warm start's first sub-agent calls are all right or all wrong:
  split_pages.py), so McNemar's p overstates what the questions show. Per first
  page, `a`'s right answers minus `b`'s: how many pages favour `a` (a_pages) and `b`
  (b_pages), and the exact two-sided sign test's p over them."""
  net: dict[str, int] = {}
  for x, y, page in zip(correct_a, correct_b, pages, strict=True):
    net[page] = net.get(page, 0) + int(bool(x)) - int(bool(y))
  a_pages, b_pages = sum(v > 0 for v in net.values()), sum(v < 0 for v in net.values())
  p = stats.binomtest(a_pages, a_pages + b_pages).pvalue if a_pages + b_pages else 1.0
  return dict(pages=len(net), a_pages=a_pages, b_pages=b_pages, page_sign_p=float(f"{p:.3g}"))


def mcnemar_records(a: dict, b: dict, what: str, first_page: dict | None = None) -> dict:
  """`mcnemar` of two per-question records (`play.question_record`), which must hold the same
  questions in the same order (`what` names the pair in the error); with `first_page`
  (question id -> the page its chain opens on), `sign_test_by_page` too."""
  if a["question_ids"] != b["question_ids"]:
    raise ValueError(f"{what} evaluated different questions; no paired comparison")
  out = mcnemar(a["correct"], b["correct"])
  if first_page is not None:
    unknown = [q for q in a["question_ids"] if q not in first_page]
    if unknown:
      raise ValueError(f"{what}: {len(unknown)} questions (e.g. {unknown[0]}) are not this "
                       "task's evaluation questions; no page to group them by")
    out.update(sign_test_by_page(a["correct"], b["correct"],
                                 [first_page[q] for q in a["question_ids"]]))
  return out


def first_pages(questions) -> dict[str, str]:
  """Question id -> the doc id of its chain's first page (`sign_test_by_page`'s unit)."""
  return {q.id: q.hops[0].doc_id if q.hops else q.id for q in questions}


def paired_t_power(n: int, effect: float, sd: float, alpha: float = ALPHA) -> float:
  """Power of the two-sided paired t-test over `n` pairs to detect a mean difference `effect`
  when the differences have sd `sd` (non-central t with n - 1 degrees of freedom)."""
  df, ncp = n - 1, effect / sd * np.sqrt(n)
  crit = stats.t.ppf(1 - alpha / 2, df)
  return float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def power_analysis(num_test: int, *, sd: float = PAIRED_SD, effect: float = EFFECT,
                   power: float = POWER, alpha: float = ALPHA) -> dict:
  """The seeds (paired by seed) for `power` to see `effect` between M-GRPO and frozen_sub, and
  the evaluation size: every test question (`num_test`), with its binomial sd at p = 0.5."""
  n = 2
  while paired_t_power(n, effect, sd, alpha) < power:
    n += 1
  return dict(
      test="two-sided paired t-test over seeds, unit = seed (M-GRPO minus frozen_sub, same "
           "seed, same warm start, same test questions)",
      paired_sd=sd, paired_sd_source="hierarchy-sweep-cpu.json at 0ce0b92: M-GRPO minus "
      "frozen_sub, 5 seeds, final accuracy (+4.5 +- 6.7 points)", effect=effect, alpha=alpha,
      target_power=power, seeds=n, power_at_seeds=round(paired_t_power(n, effect, sd, alpha), 4),
      power_at_seeds_minus_1=round(paired_t_power(n - 1, effect, sd, alpha), 4),
      normal_approximation_seeds=round(((stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))
                                        * sd / effect) ** 2, 2),
      eval_questions=num_test,
      eval_binomial_sd_at_half=round(float(np.sqrt(0.25 / num_test)), 4),
      computation="smallest n with P(|T| > t_{1-alpha/2, n-1}) >= power, T ~ noncentral t(n-1, "
                  "effect / sd * sqrt(n)) (scipy.stats.nct); evaluation on the whole test split")


def no_tool_run(size: str, eval_split: str) -> dict:
  """The guesser that reads nothing (envs.multihop.no_tool_guesser) on the eval questions."""
  c = mgrpo_config.get_config(f"task=multihop,{SIZE_FLAG[size]}")
  c.eval_split = eval_split
  env = tasks.build_env(c)
  guess = multihop.no_tool_guesser(env.train)
  out = {}
  for split in ("valid", "test"):
    questions = getattr(env, split)[:c.num_eval_questions]
    right = [bool(rewards.exact_match(guess(q), q.answer)) for q in questions]
    out[split] = dict(accuracy=round(float(np.mean(right)), 4) if right else None,
                      questions=len(right))
  return dict(kind="no_tool", variant="no_tool", config=f"configs/mgrpo.py:task=multihop,"
              f"{SIZE_FLAG[size]}", rule="majority training answer per (template, final "
              "attribute), else per attribute; 'no' for yes/no; the first-named entity for "
              "'earlier' comparisons", evals=[{"step": 0, **out[c.eval_split]}], splits=out)


def expert_run(size: str, variant: str, eval_split: str, workdir: str, *,
               teacher: bool = False) -> dict:
  """The scripted experts under the same budget (no training): noise-free (the ceiling), or
  with `teacher` slipping as often as the warm start's demonstrations do."""
  arg = f"task=multihop,{SIZE_FLAG[size]},{EXTRA[variant]},policy=expert"
  c = mgrpo_config.get_config(arg)
  c.eval_split = eval_split
  if teacher:
    c.expert_noise = sft_config.get_config(arg).sft.expert_noise
  workdir = os.path.join(workdir, f"{'teacher' if teacher else 'expert'}-{variant}")
  os.makedirs(workdir, exist_ok=True)
  result = evaluate.run(c, workdir)
  return dict(kind="teacher" if teacher else "expert", config=f"configs/mgrpo.py:{arg}",
              expert_noise=c.expert_noise, variant=variant,
              evals=[{"step": 0, **{k: v for k, v in result.items()
                                    if isinstance(v, (int, float)) and k != "step"}}])


def baselines(size: str, eval_split: str, workdir: str) -> list[dict]:
  """What needs no training: the no-tool guesser, and the experts noise-free and slipping as
  the warm start's teacher, for the pair, the single agent and its full-context control."""
  return [no_tool_run(size, eval_split)] + [
      expert_run(size, v, eval_split, workdir, teacher=t) for t in (False, True)
      for v in ("mgrpo", "single", "single_full_context")]


SESSION_S = 100 * 60  # Each invocation of the sweep must fit 100 minutes on 2 cores.


def session_budget(sweep_json: dict, session_s: float = SESSION_S) -> dict:
  """How many RL runs fit one invocation, from a timed sweep's records: with the warm start
  (and its closed-book evaluation) in the same invocation, and with them reused."""
  runs = sweep_json["runs"]
  warm = sum(r["wall_s"] for r in runs if r["kind"] in ("warm_start", "closed_book"))
  rl = [r["wall_s"] for r in runs if r["kind"] == "rl"]
  if not rl:
    raise ValueError("the timing JSON holds no RL run")
  per_run = float(np.mean(rl))
  # The runs come from every invocation (a sweep split over sessions), not only the last.
  invocations = sweep_json["invocations"]
  return dict(source=sweep_json.get("command", invocations[-1]["command"]),
              loadavg_at_end=[i["machine"]["loadavg_at_end"] for i in invocations],
              warm_start_and_closed_book_s=round(warm, 1), rl_run_s=round(per_run, 1),
              rl_runs=[dict(variant=r["variant"], seed=r["seed"], wall_s=r["wall_s"],
                            rollout_s=r["rollout_s"], update_s=r["update_s"]) for r in runs
                       if r["kind"] == "rl"],
              session_s=session_s, warm_start_fits_session=warm < session_s,
              runs_per_session_with_warm_start=max(0, int((session_s - warm) // per_run)),
              runs_per_session_warm_start_reused=int(session_s // per_run))


def other_worlds(size: str, env: tasks.Env) -> dict:
  """The warm start's other worlds (`sft.other_worlds`): how many names they bring, how many
  are the task's, and how many of their pages name a held-out entity (dropped)."""
  c = sft_config.get_config(f"task=multihop,{SIZE_FLAG[size]}")
  others = sft.other_world_envs(c)
  titles = [d.title for o in others for d in o.documents]
  task_names = {d.title for d in env.documents} | set(env.held_out_names)
  rows = len(sft.corpus_rows(env, others)) - len(env.documents)
  return dict(worlds=len(others), questions_per_world=len(others[0].train + others[0].test)
              if others else 0, task_training_pages=len(env.documents),
              pages=len(titles), distinct_names=len(set(titles)),
              names_shared_with_the_task=len(set(titles) & task_names),
              pages_dropped_naming_a_held_out_entity=len(titles) - rows)


def instrument(path: str, size: str, workdir: str, *, command: str, timing: str = "") -> dict:
  """The cheap measurements (no training), written to `path`: split and leak statistics,
  `baselines`, the power analysis; with `timing` (a timed sweep's JSON) the session budget."""
  t0 = time.perf_counter()
  c = mgrpo_config.get_config(f"task=multihop,{SIZE_FLAG[size]}")
  env = tasks.build_env(c)
  the_world = world_lib.generate_world(tasks.world_config(c))
  train_pages = {h.doc_id for q in env.train for h in q.hops}
  held = {s: {h.doc_id for q in getattr(env, s) for h in q.hops} for s in ("valid", "test")}
  corpus = {d.doc_id for d in env.documents}
  # How often the page a sub-agent needs is not the first search hit (the choice of hit is
  # part of its job): each hop's entity searched by name through the tool, as the experts do.
  ranks = [next((i for i, (doc, _) in enumerate(experts.parse_hits(env.tools["search"](
      h.entity))) if doc == h.doc_id), None) for q in env.test for h in q.hops]
  # Search replies in training traces may list a held-out page as a hit (its snippet: one
  # sentence, which may name a training entity in a distractor); never its facts' pages in a
  # chain. How often, for the searches the experts make on training questions:
  held_pages = set().union(*held.values())
  train_replies = [experts.parse_hits(env.tools["search"](h.entity))
                   for q in env.train for h in q.hops]
  splits = dict(
      train_searches_listing_a_held_out_page=round(float(np.mean(
          [any(doc in held_pages for doc, _ in hits) for hits in train_replies])), 4),
      questions={s: len(getattr(env, s)) for s in ("train", "valid", "test")},
      pages={p: sum(e.part == p for e in the_world.entities) for p in world_lib.PARTS},
      held_out_pages_in_training_chains={s: len(v & train_pages) for s, v in held.items()},
      held_out_pages_in_warm_start_corpus={s: len(v & corpus) for s, v in held.items()},
      leaking_questions=sum(multihop.leaks(the_world, q) for q in env.train + env.valid
                            + env.test),
      test_hops={n: sum(len(q.hops) == n for q in env.test) for n in (1, 2, 3, 4)},
      test_answer_attributes=dict(sorted(collections.Counter(
          q.hops[-1].attribute for q in env.test).items())),
      comparisons=sum(bool(q.compare) for q in env.train + env.valid + env.test),
      search_k=c.world.search_k, name_similarity=c.world.name_similarity,
      test_hops_own_page_first_hit=round(float(np.mean([r == 0 for r in ranks])), 4),
      test_hops_own_page_in_hits=round(float(np.mean([r is not None for r in ranks])), 4))
  splits["warm_start_other_worlds"] = other_worlds(size, env)
  c_eval = c.copy_and_resolve_references()
  records = baselines(size, c_eval.eval_split, workdir)
  out = dict(command=command,
             commit=git_commit(), wall_s=round(time.perf_counter() - t0, 1),
             config=f"configs/mgrpo.py:task=multihop,{SIZE_FLAG[size]}",
             eval_split=c_eval.eval_split, num_eval_questions=min(c.num_eval_questions,
                                                                  len(env.test)),
             splits=splits, power_analysis=power_analysis(min(c.num_eval_questions,
                                                              len(env.test))),
             baselines=records,
             machine=dict(cpus=os.cpu_count(), platform=platform.platform(),
                          loadavg_at_end=[round(x, 2) for x in os.getloadavg()]))
  if timing:
    with open(timing) as f:
      out["session_budget"] = session_budget(json.load(f))
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  return out
