"""The hierarchy ablation's configs: every variant runs the same experiment but for its wiring."""

import dataclasses
import json
import os
import re
import shutil
import sys
import time

import numpy as np
import pytest

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from experiments.hierarchy_ablation import archive as archive_lib
from experiments.hierarchy_ablation import config as ablation
from experiments.hierarchy_ablation import instrument as hi
from experiments.hierarchy_ablation import (rl_run_record, runs, save_warm_start, split_pages,
                                            sub_skill_drill, summary, warm_start_probe)
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step


def _flat(c, prefix=""):
  out = {}
  for k, v in c.items():
    if hasattr(v, "items"):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.mark.parametrize("module", [mgrpo_config, sft_config])
@pytest.mark.parametrize("size", ["cpu", "gpu", "smoke"])
def test_variants_share_data_budgets_recipe_and_updates(module, size):
  """Resolved configs field by field: only `variant` differs from M-GRPO's (same world and
  questions, limits, sampling, optimisers, steps, evaluation, warm-start recipe)."""
  args = list(ablation.hierarchy_sweep(size, seeds=1))
  assert [mgrpo_config.get_config(a).variant for a in args] == list(
      ablation.VARIANTS)
  controls = dict(ablation.hierarchy_controls(size, seeds=1))
  assert list(controls) == ["single_full_context"]
  configs = {a: _flat(module.get_config(a)) for a in args + list(controls.values())}
  reference = configs[args[0]]
  assert reference["variant"] == "mgrpo" and reference["world.kind"] == "multihop"
  for arg, flat in configs.items():
    assert flat.keys() == reference.keys()
    differ = {k for k in flat if flat[k] != reference[k]}
    # The declared differences: the single agent's warm start keeps only correct
    # demonstrations from 10x the questions, asked by 10x the worlds (the same share per
    # world, the same pages: tests/test_train.py); its control's context holds every page.
    allowed = {"variant"}
    if "variant=single" in arg and module is sft_config:
      allowed |= {"sft.only_correct", "sft.num_questions", "sft.trace_worlds"}
      assert flat["sft.only_correct"] and not reference["sft.only_correct"]
      assert flat["sft.num_questions"] == 10 * reference["sft.num_questions"]
      assert flat["sft.trace_worlds"] + 1 == 10 * (reference["sft.other_worlds"] + 1)
    if "full_context" in arg:
      # Its micro-batches hold a row of its max_len (packing changes no loss).
      allowed |= {"limits.max_len", "main_model.max_tokens_per_micro",
                  "sub_model.max_tokens_per_micro"}
      assert flat["limits.max_len"] > reference["limits.max_len"]
      assert flat["main_model.max_tokens_per_micro"] >= flat["limits.max_len"]
    assert differ <= allowed, (arg, {k: (flat[k], reference[k]) for k in differ})
    setup.resolve_wiring(module.get_config(arg), training=module is mgrpo_config)


def test_seeds_differ_only_in_seed():
  a, b = (_flat(mgrpo_config.get_config(f"task=multihop,runlocal,variant=single,seed={s}"))
          for s in (0, 2))
  assert {k for k in a if a[k] != b[k]} == {"seed"}


def test_every_variant_has_a_wiring():
  assert set(mgrpo_config.VARIANTS) == set(setup.WIRINGS)
  w = setup.WIRINGS
  assert w["unaligned"].align.mode == "pad" and w["mgrpo"].align.mode == "sample"
  assert (w["unaligned"].roles, w["unaligned"].trained) == (w["mgrpo"].roles, w["mgrpo"].trained)


def test_unaligned_sub_batch_holds_every_episode_once():
  """variant=unaligned on real (expert) rollouts: each sub episode is one row, padding rows
  are masked, and the row count is a multiple of Q*K; mgrpo's aligned batch is [Q*K*D] rows."""
  import jax
  import numpy as np

  from mgrpo_jax.mgrpo import tasks

  c = mgrpo_config.get_config("task=multihop,smoke,variant=unaligned,policy=expert")
  env = tasks.build_env(c)
  rows = {}
  for variant in ("unaligned", "mgrpo"):
    c.variant = variant
    w = setup.resolve_wiring(c)
    policies = play.expert_policies(c, w, env, noise=0.3, seed=1)
    eps, sub_eps = play.run_rollouts(c, w, env, policies, env.train[:c.num_queries],
                                     num_rollouts=c.num_rollouts, key=jax.random.key(0),
                                     step=0)
    rollouts = play.Rollouts(env, env.train[:c.num_queries], eps, sub_eps)
    batches, m = mgrpo_step.batches(c, w, rollouts, jax.random.key(1))
    b, n = batches["sub"], len(sub_eps)
    rows[variant] = b.tokens.shape[0]
    assert n > c.num_queries * c.num_rollouts  # multi-hop: several calls per rollout
    if variant == "unaligned":
      unit = c.num_queries * c.num_rollouts
      assert b.tokens.shape[0] == unit * -(-n // unit)
      assert (b.loss_mask.sum(1) > 0).sum() == n and b.loss_mask[n:].sum() == 0
      length, pad = b.tokens.shape[1], env.tokenizer.pad_id
      want = sorted(tuple(e.tokens) + (pad,) * (length - len(e.tokens)) for e in sub_eps)
      assert sorted(tuple(int(x) for x in t) for t in np.asarray(b.tokens)[:n]) == want
    else:
      assert rows[variant] == c.num_queries * c.num_rollouts * c.align_d


def test_sweep_summary_intervals_by_hand():
  """summary.summarize: per variant, mean and 95% t-interval over seeds."""
  run = lambda seed, accs: dict(kind="rl", variant="mgrpo", seed=seed, train_means={},
                                evals=[{"step": s, "accuracy": a, "accuracy_hops2": a / 2}
                                       for s, a in zip((0, 10), accs)])
  records = [run(0, (0.1, 0.4)), run(2, (0.3, 0.9)), run(1, (0.2, 0.5)),
             dict(kind="expert", variant="mgrpo", evals=[{"step": 0, "accuracy": 1.0}])]
  s = summary.summarize(records)["mgrpo"]
  assert s["steps"] == [0, 10] and s["seeds"] == [0, 1, 2]
  # Final accuracies (0.4, 0.5, 0.9): mean 0.6, s = 0.26458, t_{0.975, 2} = 4.302653.
  assert abs(s["final"]["accuracy"]["mean"] - 0.6) < 1e-9
  assert abs(s["final"]["accuracy"]["ci95"] - 4.302653 * 0.264575 / 3 ** 0.5) < 1e-3
  assert s["curves"]["accuracy_hops2"]["mean"] == [0.1, 0.3]
  assert s["final"]["accuracy"]["seeds"] == [0.4, 0.5, 0.9]  # in seed order, as `seeds`


def test_sweep_paired_differences_by_hand():
  """The sweep's per-seed differences: RL's gain over the warm start and M-GRPO minus each."""
  run = lambda variant, seed, accs: dict(kind="rl", variant=variant, seed=seed, train_means={},
                                         evals=[{"step": s, "accuracy": a}
                                                for s, a in zip((0, 10), accs)])
  records = [run("mgrpo", 0, (0.3, 0.5)), run("mgrpo", 1, (0.3, 0.6)),
             run("mgrpo", 2, (0.3, 0.4)), run("frozen_sub", 0, (0.3, 0.3)),
             run("frozen_sub", 1, (0.3, 0.5)), run("frozen_sub", 3, (0.3, 0.9))]
  s = summary.summarize(records)
  gain = s["mgrpo"]["gain"]["accuracy"]
  assert gain["seeds"] == [0.2, 0.3, 0.1] and abs(gain["mean"] - 0.2) < 1e-9
  # sd of (0.2, 0.3, 0.1) is 0.1; t_{0.975, 2} = 4.302653.
  assert abs(gain["ci95"] - 4.302653 * 0.1 / 3 ** 0.5) < 1e-3
  # Only seeds both variants ran are paired (0 and 1): 0.5 - 0.3 and 0.6 - 0.5.
  minus = s["frozen_sub"]["mgrpo_minus"]["accuracy"]
  assert minus["seeds"] == [0.2, 0.1] and abs(minus["mean"] - 0.15) < 1e-9
  assert "mgrpo_minus" not in s["mgrpo"]
  assert not any(k.startswith(("minus_", "vs_")) for v in s.values() for k in v)


def test_control_minus_the_agent_it_controls_by_hand():
  """The full-context control is paired by seed with the single agent (control minus single,
  by seed and by question), besides M-GRPO minus the control; without `single`, neither."""
  ids = ["q1", "q2", "q3"]
  run = lambda variant, seed, final, correct: dict(
      kind="rl", variant=variant, seed=seed, train_means={},
      evals=[{"step": 0, "accuracy": 0.1}, {"step": 10, "accuracy": final}],
      questions=dict(question_ids=ids, correct=correct))
  records = [run("mgrpo", 0, 0.2, [True, False, False]),
             run("single", 0, 0.3, [False, True, False]),
             run("single", 1, 0.25, [False, False, False]),
             run("single_full_context", 0, 0.5, [True, True, True]),
             run("single_full_context", 1, 0.45, [True, False, False])]
  s = summary.summarize(records)["single_full_context"]
  minus = s["minus_single"]["accuracy"]
  assert minus["seeds"] == [0.2, 0.2] and abs(minus["mean"] - 0.2) < 1e-9
  assert s["mgrpo_minus"]["accuracy"]["seeds"] == [-0.3]  # seed 0 only: 0.2 - 0.5
  # Seed 0: the control alone answers q1 and q3 (p = 2 * 0.5^2); seed 1: q1 (p = 1).
  assert s["vs_single_by_question"] == [dict(seed=0, a_only=2, b_only=0, mcnemar_p=0.5),
                                        dict(seed=1, a_only=1, b_only=0, mcnemar_p=1.0)]
  without = summary.summarize([r for r in records if r["variant"] != "single"])
  assert "minus_single" not in without["single_full_context"]


def test_reuse_refuses_a_changed_config_or_commit():
  """--reuse keeps a finished run only when its config and commit are this invocation's."""
  config = runs.config_record(mgrpo_config.get_config("task=multihop,smoke,variant=mgrpo"))
  done = dict(wall_s=1.0, config=config, commit="abc")
  runs.check_reusable(done, config, "abc")  # The same run: kept.
  changed = json.loads(json.dumps(config))
  changed["main_optim"]["learning_rate"] = 1e-5
  changed["world"]["holdout"] = [0.1, 0.1]
  with pytest.raises(ValueError, match=r"main_optim\.learning_rate: 0\.0002 -> 1e-05"):
    runs.check_reusable(done, changed, "abc")
  with pytest.raises(ValueError, match=r"world\.holdout"):
    runs.check_reusable(done, changed, "abc")
  with pytest.raises(ValueError, match="commit 'abc'.*'def'"):
    runs.check_reusable(done, config, "def")
  runs.check_reusable(done, config, "def", any_commit=True)
  with pytest.raises(ValueError, match="config differs"):  # A run from before configs were kept.
    runs.check_reusable(dict(wall_s=1.0), config, "abc")
  # Fields added since a run: their defaults (the training split's RL, as every run then).
  split = dict(config, rl_worlds=0, rl_hop_weights=[])
  older = {k: v for k, v in split.items() if k not in ("rl_worlds", "rl_hop_weights")}
  runs.check_reusable(dict(done, config=older), split, "abc")
  with pytest.raises(ValueError, match=r"rl_worlds: 0 -> 1000"):
    runs.check_reusable(dict(done, config=older), config, "abc")
  # A warm start reads none of RL's fields: one made under other RL defaults is kept, one
  # with another warm-start setting is not.
  warm = runs.config_record(sft_config.get_config("task=multihop,smoke,variant=mgrpo"))
  before = dict(warm, rl_worlds=0, rl_hop_weights=[], num_queries=3, num_steps=30)
  with pytest.raises(ValueError, match="num_queries: 3 -> 2"):
    runs.check_reusable(dict(done, config=before), warm, "abc")
  runs.check_reusable(dict(done, config=before), warm, "abc", ignore=runs.WARM_START_IGNORES)
  before["sft"] = dict(before["sft"], num_questions=1)
  with pytest.raises(ValueError, match=r"sft\.num_questions"):
    runs.check_reusable(dict(done, config=before), warm, "abc", ignore=runs.WARM_START_IGNORES)


def test_reuse_resumes_an_unfinished_run_and_counts_its_earlier_time(tmp_path):
  """An invocation stopped mid-run (a session's end) leaves progress.json: --reuse goes on in
  the same workdir (the run resumes from its checkpoints) and adds the time already spent;
  a changed config is refused; without --reuse the run starts from scratch."""
  config = runs.config_record(mgrpo_config.get_config("task=multihop,smoke,variant=mgrpo"))
  workdir = str(tmp_path / "run")
  checkpoint = os.path.join(workdir, "checkpoint")

  class Stopped(Exception):
    pass

  def first():  # Writes a "checkpoint", then the invocation ends before the run does.
    open(checkpoint, "w").close()
    time.sleep(0.3)
    raise Stopped

  commit = runs.git_commit()
  t0 = time.perf_counter()
  with pytest.raises(Stopped):
    runs._timed(workdir, first, config, reuse=True, any_commit=False, heartbeat_s=0.05)
  elapsed = time.perf_counter() - t0
  assert not os.path.exists(os.path.join(workdir, "done.json"))
  with open(os.path.join(workdir, "progress.json")) as f:
    spent = json.load(f)["wall_s"]  # The last heartbeat's count.
  assert 0.1 <= spent <= elapsed
  changed = json.loads(json.dumps(config))
  changed["num_steps"] += 1
  with pytest.raises(ValueError, match=r"unfinished run's config differs in num_steps"):
    runs._timed(workdir, lambda: None, changed, reuse=True, any_commit=False)
  resumed = []
  wall = runs._timed(workdir, lambda: resumed.append(os.path.exists(checkpoint)), config,
                     reuse=True, any_commit=False)
  assert resumed == [True] and wall >= spent
  with open(os.path.join(workdir, "done.json")) as f:
    assert json.load(f)["resumed_after_s"] == spent
  assert runs._run_commits(workdir) == [commit]  # Both parts at this commit: named once.
  assert not os.path.exists(os.path.join(workdir, "progress.json"))
  kept = runs._timed(workdir, lambda: None, config, reuse=True, any_commit=False)
  assert kept == wall  # Finished: kept.
  runs._timed(workdir, lambda: resumed.append(os.path.exists(checkpoint)), config, reuse=False,
              any_commit=False)
  assert resumed == [True, False]  # From scratch.


def test_a_run_resumed_at_another_commit_records_both(tmp_path, monkeypatch):
  """An unfinished run that invocations at later commits go on with (--reuse_any_commit)
  keeps every commit it was made at, oldest first; a progress.json from before they were
  kept gives its one commit."""
  config = {"seed": 0}
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "progress.json"), "w") as f:
    json.dump(dict(wall_s=5.0, config=config, commit="a1"), f)  # No "commits": older code.

  def stopped():
    raise KeyboardInterrupt  # The session ended mid-run.

  monkeypatch.setattr(runs, "git_commit", lambda: "b2")
  with pytest.raises(ValueError, match="commit 'a1'"):  # Without --reuse_any_commit.
    runs._timed(workdir, lambda: None, config, reuse=True, any_commit=False)
  with pytest.raises(KeyboardInterrupt):
    runs._timed(workdir, stopped, config, reuse=True, any_commit=True)
  monkeypatch.setattr(runs, "git_commit", lambda: "c3")
  runs._timed(workdir, lambda: None, config, reuse=True, any_commit=True)
  assert runs._run_commits(workdir) == ["a1", "b2", "c3"]
  with open(os.path.join(workdir, "done.json")) as f:
    assert json.load(f)["commit"] == "c3"


def test_a_stopped_sweep_does_not_count_its_pause():
  """The sweep is stopped (SIGSTOP) while the suite runs: the run's clock counts the gaps
  between heartbeats, each capped, so an hour's pause adds at most the cap."""
  now = [100.0]
  clock = runs._Clock(max_gap_s=120.0, now=lambda: now[0])
  for gap in (30.0, 30.5, 29.5):  # Running: every heartbeat's gap counts.
    now[0] += gap
    clock.tick()
  assert clock.seconds == 90.0
  now[0] += 3600.0  # Stopped for an hour between two heartbeats.
  assert clock.tick() == 210.0
  now[0] += 30.0
  assert clock.tick() == 240.0


def test_archived_warm_start_goes_on_on_a_fresh_machine(tmp_path, monkeypatch):
  """A finished warm start kept in the archive is restored into an empty workdir, where
  --reuse keeps it only when its config matches; edited weights and a workdir with its own
  run are not restored over; an unfinished one, archived by hand, resumes from its
  checkpoint; one too large for the repository is not archived."""
  config = runs.config_record(sft_config.get_config("task=multihop,smoke,variant=mgrpo"))
  made, archive = str(tmp_path / "old" / "sft-mgrpo"), str(tmp_path / "archive")

  def train():  # What a warm start leaves: final weights, metrics, a checkpoint.
    for agent in ("main", "sub"):
      os.makedirs(os.path.join(made, "hf", agent))
      with open(os.path.join(made, "hf", agent, "model.safetensors"), "wb") as f:
        f.write(agent.encode() * 100)
    with open(os.path.join(made, "metrics.jsonl"), "w") as f:
      f.write('{"step": 1, "eval/accuracy": 0.25}\n')
    with open(os.path.join(made, "config.json"), "w") as f:
      json.dump(config, f)
    os.makedirs(os.path.join(made, "checkpoints", "1"))

  wall = runs._timed(made, train, config, reuse=True, any_commit=False)
  weights = archive_lib.save(made, archive)
  assert weights == archive_lib.digest(made)
  assert sorted(os.listdir(os.path.join(archive, "sft-mgrpo"))) == [
      "archive.json", "config.json", "done.json", "hf", "metrics.jsonl"]  # No checkpoints.

  fresh = str(tmp_path / "new" / "sft-mgrpo")
  assert archive_lib.restore(archive, fresh)
  assert archive_lib.digest(fresh) == weights
  assert runs._evals(fresh) == [{"step": 1, "accuracy": 0.25}]
  ran = []
  assert runs._timed(fresh, lambda: ran.append(1), config, reuse=True, any_commit=False) == wall
  assert not ran  # Kept, not trained again.
  changed = dict(config, sft=dict(config["sft"], num_steps=config["sft"]["num_steps"] + 1))
  with pytest.raises(ValueError, match=r"sft\.num_steps"):
    runs._timed(fresh, lambda: None, changed, reuse=True, any_commit=False)
  assert not archive_lib.restore(archive, fresh)  # The workdir's own run wins,
  own = str(tmp_path / "own" / "sft-mgrpo")
  os.makedirs(own)
  with open(os.path.join(own, "progress.json"), "w") as f:
    f.write("{}")
  assert not archive_lib.restore(archive, own)  # unfinished too.
  assert os.listdir(own) == ["progress.json"]
  assert archive_lib.save(made, archive) == weights  # The same weights: kept as they are.
  other = str(tmp_path / "other" / "sft-mgrpo")
  shutil.copytree(made, other)
  with open(os.path.join(other, "hf", "main", "model.safetensors"), "ab") as f:
    f.write(b"retrained")
  with pytest.raises(ValueError, match="holds another finished warm start"):
    archive_lib.save(other, archive)  # The sweep's runs began from the archived one.
  assert archive_lib.digest(os.path.join(archive, "sft-mgrpo")) == weights
  # A save cut short between its renames left the old copy as `.old`: restored from there.
  os.replace(os.path.join(archive, "sft-mgrpo"), os.path.join(archive, "sft-mgrpo.old"))
  assert archive_lib.restore(archive, str(tmp_path / "after_crash" / "sft-mgrpo"))
  os.replace(os.path.join(archive, "sft-mgrpo.old"), os.path.join(archive, "sft-mgrpo"))
  # A partly committed archive is refused before the workdir is touched.
  partial = str(tmp_path / "partial")
  shutil.copytree(archive, partial)
  os.remove(os.path.join(partial, "sft-mgrpo", "metrics.jsonl"))
  with pytest.raises(ValueError, match="lacks metrics.jsonl"):
    archive_lib.restore(partial, str(tmp_path / "fourth" / "sft-mgrpo"))
  assert not os.path.exists(tmp_path / "fourth")
  # An RL run's config holds its warm start's digest: kept only from the same weights.
  run = str(tmp_path / "rl")
  runs._timed(run, lambda: None, dict(config, init_digest="d1"), reuse=True, any_commit=False)
  with pytest.raises(ValueError, match="init_digest: 'd1' -> 'd2'"):
    runs._timed(run, lambda: None, dict(config, init_digest="d2"), reuse=True,
                any_commit=False)

  with open(os.path.join(archive, "sft-mgrpo", "hf", "sub", "model.safetensors"), "ab") as f:
    f.write(b"edited")
  with pytest.raises(ValueError, match="do not match archive.json"):
    archive_lib.restore(archive, str(tmp_path / "third" / "sft-mgrpo"))
  assert not os.path.exists(tmp_path / "third" / "sft-mgrpo" / "done.json")
  assert not archive_lib.restore(archive, str(tmp_path / "third" / "sft-shared"))  # None kept.
  # A warm start still training when the session ends: saved by hand (the CLI), resumed.
  unfinished = str(tmp_path / "old" / "sft-single")

  class Stopped(Exception):
    pass

  def stopped():
    with open(os.path.join(unfinished, "config.json"), "w") as f:
      json.dump(config, f)
    with open(os.path.join(unfinished, "metrics.jsonl"), "w") as f:
      f.write('{"step": 100, "sft/main/nll": 1.0}\n')
    os.makedirs(os.path.join(unfinished, "checkpoints", "100"))
    with open(os.path.join(unfinished, "checkpoints", "100", "state"), "w") as f:
      f.write("step 100")
    raise Stopped

  with pytest.raises(Stopped):
    runs._timed(unfinished, stopped, config, reuse=True, any_commit=False)
  save_warm_start.main(["save_warm_start.py", f"--workdir={unfinished}", f"--archive={archive}"])
  resumed_in = str(tmp_path / "new" / "sft-single")
  assert archive_lib.restore(archive, resumed_in)
  assert not os.path.exists(os.path.join(resumed_in, "done.json"))
  seen = []
  runs._timed(resumed_in, lambda: seen.append(os.listdir(os.path.join(resumed_in,
                                                                      "checkpoints"))),
              config, reuse=True, any_commit=False)
  assert seen == [["100"]]  # Resumed from the archived checkpoint, not from scratch.
  for argv in ([f"--workdir={unfinished}"], [f"--workdir={unfinished}", "--archive"]):
    with pytest.raises(SystemExit, match="usage"):
      save_warm_start.main(["save_warm_start.py", *argv])
  monkeypatch.setattr(archive_lib, "MAX_BYTES", 100)
  assert archive_lib.save(made, str(tmp_path / "small")) is None
  assert not os.path.exists(tmp_path / "small")


# The options of a CPU invocation on the test split (the table's), and its power analysis.
TEST_SPLIT = runs.Options(size="cpu", eval_split="test")
POWER = hi.power_analysis(286)


def _rl(variant, seed, final, init=None):
  """An RL run's record: evaluated at steps 0 and 90, `final` at 90."""
  return dict(kind="rl", variant=variant, seed=seed, wall_s=1.0, train_means={},
              evals=[{"step": 0, "accuracy": 0.0}, {"step": 90, "accuracy": final}],
              **({"init_digest": init} if init else {}))


def test_a_remade_warm_start_sets_the_old_runs_aside(tmp_path):
  """When the JSON's warm start is made again (a new machine lost it), the runs from the old
  one (by init_digest; none before digests) leave the summary for other_warm_start_runs, once
  each, with the old warm start itself; the new one's runs make the summary."""
  power = POWER
  path = str(tmp_path / "sweep.json")

  no_tool = dict(kind="no_tool", variant="no_tool", evals=[{"step": 0, "accuracy": 0.0}])
  old = [no_tool, dict(kind="warm_start", variant="mgrpo", wall_s=7197.0, evals=[]),
         dict(kind="closed_book", variant="closed_book", evals=[{"step": 0, "accuracy": 0}]),
         _rl("mgrpo", 0, 0.05), _rl("frozen_sub", 0, 0.03)]
  summary.write(old, path, 1.0, power, opts=TEST_SPLIT)
  with open(path) as f:
    assert json.load(f)["summary"]["mgrpo"]["seeds"] == [0]  # No digest yet: one warm start.
  new = [dict(kind="warm_start", variant="mgrpo", digest="d1", wall_s=5000.0, evals=[]),
         dict(kind="closed_book", variant="closed_book", init_digest="d1",
              evals=[{"step": 0, "accuracy": 0}]),
         _rl("mgrpo", 1, 0.2, "d1"), _rl("frozen_sub", 1, 0.1, "d1")]
  summary.write(new, path, 1.0, power, opts=TEST_SPLIT)
  summary.write([_rl("mgrpo", 2, 0.3, "d1")], path, 1.0, power, opts=TEST_SPLIT)
  with open(path) as f:
    out = json.load(f)
  assert out["summary"]["mgrpo"]["seeds"] == [1, 2]
  assert out["summary"]["frozen_sub"]["seeds"] == [1]
  assert out["summary"]["frozen_sub"]["mgrpo_minus"]["accuracy"]["seeds"] == [0.1]
  aside = sorted((r["kind"], r["variant"], r.get("seed"), r.get("wall_s"))
                 for r in out["other_warm_start_runs"])
  assert aside == [("closed_book", "closed_book", None, None), ("rl", "frozen_sub", 0, 1.0),
                   ("rl", "mgrpo", 0, 1.0), ("warm_start", "mgrpo", None, 7197.0)]
  assert {(r["kind"], r.get("digest")) for r in out["runs"]} >= {("warm_start", "d1")}
  # Seed 0 again from the new warm start joins the summary; the old seed 0 stays aside.
  summary.write([_rl("mgrpo", 0, 0.1, "d1"), _rl("frozen_sub", 0, 0.05, "d1")], path, 1.0, power,
                opts=TEST_SPLIT)
  with open(path) as f:
    out = json.load(f)
  assert out["summary"]["mgrpo"]["seeds"] == [0, 1, 2]  # In seed order, whichever ran first.
  assert len(out["other_warm_start_runs"]) == 4
  # Made a third time: the second one's warm start, closed book and runs go aside too.
  summary.write([dict(kind="warm_start", variant="mgrpo", digest="d2", wall_s=4000.0, evals=[]),
                _rl("mgrpo", 3, 0.2, "d2")], path, 1.0, power, opts=TEST_SPLIT)
  with open(path) as f:
    out = json.load(f)
  assert out["summary"]["mgrpo"]["seeds"] == [3] and "frozen_sub" not in out["summary"]
  aside = [(r["kind"], r["variant"], r.get("seed"), r.get("digest") or r.get("init_digest"))
           for r in out["other_warm_start_runs"]]
  assert len(aside) == len(set(aside)) == 4 + 1 + 1 + 5  # d1: warm start, closed book, 5 runs.


def test_closed_book_is_kept_only_for_the_same_warm_start_config_and_commit(monkeypatch):
  """--reuse keeps an earlier invocation's closed-book record of the same warm start, config
  and commit (any commit with --reuse_any_commit); otherwise it evaluates again."""
  evaluated = []
  monkeypatch.setattr(runs, "question_log",
                      lambda c, closed_book: evaluated.append(c.init) or {"accuracy": 0.01})
  monkeypatch.setattr(runs, "git_commit", lambda: "c2")
  init = dict(workdir="/w/sft-mgrpo", digest="d1")
  made = lambda reuse, any_commit, earlier: runs.closed_book_run(
      dataclasses.replace(TEST_SPLIT, reuse=reuse, reuse_any_commit=any_commit), init, earlier)

  fresh = made(False, False, [])
  assert evaluated == ["/w/sft-mgrpo"] and fresh["commit"] == "c2"
  assert made(True, False, [fresh]) is fresh and len(evaluated) == 1
  at_c1 = dict(fresh, commit="c1", evals=[{"step": 0, "accuracy": 0.5}])
  assert made(True, True, [at_c1]) is at_c1 and len(evaluated) == 1
  others = [dict(fresh, init_digest="d0"), dict(fresh, config=fresh["config"] + " x"), at_c1]
  for earlier, reuse in ((others, True), ([fresh], False)):
    assert made(reuse, False, earlier)["evals"] == fresh["evals"]
  assert len(evaluated) == 3


def test_invocations_merge_on_one_split_only(tmp_path):
  """Runs evaluated on the validation split (tuning) never merge into the test table's JSON,
  nor the reverse; a merge returns every invocation's runs (what the plot draws)."""
  power = POWER
  path = str(tmp_path / "sweep.json")
  rl = lambda seed, final: _rl("mgrpo", seed, final)
  summary.check_split(path, "valid")  # No JSON yet: any split.
  summary.write([rl(0, 0.1)], path, 1.0, power, opts=TEST_SPLIT)
  merged = summary.write([rl(1, 0.2)], path, 1.0, power, opts=TEST_SPLIT)
  assert sorted(r["seed"] for r in merged) == [0, 1]
  summary.check_split(path, "test")
  with pytest.raises(ValueError, match=r"sweep\.json holds runs evaluated on the test split, "
                     r"this invocation evaluates on valid"):
    summary.check_split(path, "valid")
  with pytest.raises(ValueError, match="test split"):
    summary.write([rl(2, 0.3)], path, 1.0, power,
                  opts=dataclasses.replace(TEST_SPLIT, eval_split="valid"))
  with open(path) as f:
    assert [r["seed"] for r in json.load(f)["runs"]] == [0, 1]  # Untouched.


def test_each_invocation_is_listed_once(tmp_path, monkeypatch):
  """An invocation that writes after each run is listed once, with its last wall time; two
  started in the same second beside each other (or by one command) are both listed."""
  power = POWER
  path, t = str(tmp_path / "sweep.json"), 1.8e9 + 0.2
  write = lambda only, seeds, wall_s, started: (
      monkeypatch.setattr(sys, "argv", ["sweep.py", f"--only={only}"]),
      summary.write([_rl(only, s, 0.1) for s in seeds], path, wall_s, power, opts=TEST_SPLIT,
                    started=started))
  write("mgrpo", [0], 1.0, t)
  write("mgrpo", [0, 1], 2.0, t)  # The same invocation, after its second run.
  write("single", [0], 1.5, t + 0.5)  # Another, started in the same second.
  monkeypatch.setattr(summary.os, "getpid", lambda: 1)  # Another process, the same command.
  write("single", [1], 3.0, t)
  with open(path) as f:
    got = [(i["command"].split()[-1], i["wall_s"]) for i in json.load(f)["invocations"]]
  assert got == [("--only=mgrpo", 2.0), ("--only=single", 1.5), ("--only=single", 3.0)]


def test_power_analysis_and_verdict():
  """Seeds for 80% power at 5 points with paired sd 5.4 (normal approximation 9.15, the t-test
  needs more), and a table that refuses to rank when M-GRPO is within 5 points of guessing."""
  p = hi.power_analysis(286)
  n = p["seeds"]
  assert p["power_at_seeds"] >= 0.8 > p["power_at_seeds_minus_1"]
  assert abs(p["normal_approximation_seeds"] - (2.8 * 5.4 / 5) ** 2) < 0.1 and n > 9.15
  # Power rises with n and with the effect.
  assert hi.paired_t_power(n, 0.05, 0.054) > hi.paired_t_power(n, 0.03, 0.054)
  final = {"mgrpo": {"final": {"accuracy": {"mean": 0.30}}}}
  base = lambda acc: [dict(kind="no_tool", variant="no_tool", evals=[{"accuracy": 0.02}]),
                      dict(kind="closed_book", variant="closed_book", evals=[{"accuracy": acc}])]
  v = summary.verdict(final, base(0.27))
  assert v["informative"] is False and v["best_baseline"] == "closed_book"
  assert "uninformative" in v["reason"]
  assert summary.verdict(final, base(0.20))["informative"] is True
  assert summary.verdict({}, base(0.2))["informative"] is None
  # Until every compared variant has the analysis's seeds, the verdict says it is provisional.
  seeds = lambda n: {"seeds": list(range(n))}
  partial = {"mgrpo": dict(final["mgrpo"], **seeds(n)), "frozen_sub": seeds(n),
             "single": seeds(n - 1)}
  v = summary.verdict(partial, base(0.27), seeds_needed=n)
  assert v["provisional"] is True and v["informative"] is False
  assert v["seeds"] == {"mgrpo": n, "frozen_sub": n, "single": n - 1}
  assert f"single {n - 1} of {n}" in v["reason"]
  partial["single"] = seeds(n)
  v = summary.verdict(partial, base(0.27), seeds_needed=n)
  assert v["provisional"] is False and "provisional" not in v["reason"]
  assert summary.verdict(dict(partial, single=seeds(n + 1)), base(0.2),
                       seeds_needed=n)["provisional"] is False


def test_session_budget_by_hand():
  """RL runs per 100-minute invocation from a timed sweep: (6000 - 900) // 300 with the warm
  start in the session, 6000 // 300 without; none beside a warm start that fills a session."""
  rl = lambda seed, wall: dict(kind="rl", variant="mgrpo", seed=seed, wall_s=wall,
                               rollout_s=1.0, update_s=1.0)
  timed = dict(invocations=[dict(command="x", machine=dict(loadavg_at_end=[1.0]))],
               runs=[dict(kind="warm_start", wall_s=800.0), dict(kind="closed_book", wall_s=100.0),
                     rl(0, 250.0), rl(1, 350.0), dict(kind="expert", wall_s=5.0)])
  b = hi.session_budget(timed)
  assert b["source"] == "x" and b["loadavg_at_end"] == [[1.0]]
  timed["invocations"].append(dict(command="y", machine=dict(loadavg_at_end=[2.0])))
  timed["command"] = "the sweep, as 2 invocations"
  b = hi.session_budget(timed)
  assert b["source"] == timed["command"] and b["loadavg_at_end"] == [[1.0], [2.0]]
  assert b["warm_start_and_closed_book_s"] == 900.0 and b["rl_run_s"] == 300.0
  assert b["runs_per_session_with_warm_start"] == 17
  assert b["runs_per_session_warm_start_reused"] == 20 and b["warm_start_fits_session"]
  timed["runs"][0]["wall_s"] = 7000.0  # A warm start longer than a session: none beside it.
  b = hi.session_budget(timed)
  assert b["runs_per_session_with_warm_start"] == 0 and not b["warm_start_fits_session"]


def test_question_level_tests_by_hand():
  """Per seed, the questions only one of two variants answers right, and McNemar's exact p:
  a_only 3, b_only 0 -> 2 * 0.5^3 = 0.25; no discordant question -> p = 1."""
  log = lambda correct: dict(question_ids=["q1", "q2", "q3", "q4"], correct=correct)
  rl = lambda variant, seed, correct: dict(kind="rl", variant=variant, seed=seed,
                                           questions=log(correct))
  records = [rl("mgrpo", 0, [True, True, True, False]), rl("frozen_sub", 0, [False] * 4),
             rl("mgrpo", 1, [True, False, True, False]),
             rl("frozen_sub", 1, [True, False, True, False]), rl("frozen_sub", 2, [True] * 4)]
  tests = summary.question_tests(records, "mgrpo", "frozen_sub")
  assert tests == [dict(seed=0, a_only=3, b_only=0, mcnemar_p=0.25),
                   dict(seed=1, a_only=0, b_only=0, mcnemar_p=1.0)]
  # By page: q1-q3 open on page A, q4 on B. Seed 0: A favours mgrpo (3 - 0), B is even.
  pages = {"q1": "A", "q2": "A", "q3": "A", "q4": "B"}
  by_page = summary.question_tests(records, "mgrpo", "frozen_sub", pages)
  assert by_page[0] == dict(seed=0, a_only=3, b_only=0, mcnemar_p=0.25, pages=2, a_pages=1,
                            b_pages=0, page_sign_p=1.0)
  with pytest.raises(ValueError, match="q4.*not this task's evaluation questions"):
    summary.question_tests(records, "mgrpo", "frozen_sub", {"q1": "A", "q2": "A", "q3": "A"})
  records.append(dict(kind="rl", variant="mgrpo", seed=2,
                      questions=dict(question_ids=["x"], correct=[True])))
  with pytest.raises(ValueError, match="different questions"):
    summary.question_tests(records, "mgrpo", "frozen_sub")


def test_page_sign_test_by_hand():
  """Questions that open on one page count once: 6 pages each with a's answers above b's and
  none the other way -> p = 2 * 0.5^6 = 0.03125, where McNemar over the 14 discordant
  questions (13 to 1) says 2 * 15 / 2^14; a page where they are even counts for neither; an
  evaluation of another length is refused."""
  a = [True, True, False] * 6 + [True, False]
  b = [False, False, False] * 6 + [False, True]
  pages = [f"p{i // 3}" for i in range(18)] + ["even", "even"]
  assert hi.sign_test_by_page(a, b, pages) == dict(pages=7, a_pages=6, b_pages=0,
                                                   page_sign_p=0.0312)
  assert hi.mcnemar(a, b)["mcnemar_p"] == float(f"{2 * 15 / 2 ** 14:.3g}")
  with pytest.raises(ValueError):
    hi.sign_test_by_page(a, b, pages[:-1])


def _fake_run(workdir, evals: dict[int, list[bool]], ids=("q1", "q2", "q3", "q4")):
  """A workdir with a config, one metrics line per evaluation and its question records."""
  os.makedirs(os.path.join(workdir, "eval_questions"))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dict(variant="mgrpo", num_steps=max(evals)), f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step, correct in evals.items():
      f.write(json.dumps({"step": step, "eval/accuracy": float(np.mean(correct))}) + "\n")
      with open(play.questions_path(workdir, step), "w") as q:
        json.dump(dict(step=step, question_ids=list(ids), correct=correct), q)


def test_rl_run_record_pairs_by_question(tmp_path):
  """Each evaluation against step 0 (gained 3, lost 0 -> p = 2 * 0.5^3 = 0.25; gained 1,
  lost 1 -> p = 1), and against another run at the steps both evaluated."""
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  _fake_run(a, {0: [False, False, False, True], 30: [True, True, True, True],
                60: [True, False, False, False]})
  _fake_run(b, {0: [False] * 4, 60: [True, True, False, False]})
  rec = rl_run_record.record(a, against={"b": b})
  assert [e.get("vs_step_0") for e in rec["evaluations"]] == [
      None, dict(gained=3, lost=0, mcnemar_p=0.25), dict(gained=1, lost=1, mcnemar_p=1.0)]
  assert rec["paired"] == [
      dict(run="b", step=0, this_only=1, other_only=0, mcnemar_p=1.0),
      dict(run="b", step=60, this_only=0, other_only=1, mcnemar_p=1.0)]
  c = str(tmp_path / "c")
  _fake_run(c, {0: [False] * 4}, ids=("q1", "q2", "q3", "x"))
  with pytest.raises(ValueError, match="different questions"):
    rl_run_record.record(a, against={"c": c})


def test_evaluation_records_each_question_in_order(tmp_path):
  """play.evaluate's per-question record (what the sweep's question-level tests read) agrees
  with its metrics question by question: overall, by pages needed, and one sub-agent call
  per delegation. Slipping experts make the correctness vary."""
  c = mgrpo_config.get_config("task=multihop,smoke,policy=expert")
  c.update(expert_noise=0.3, num_eval_questions=24)
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  path = play.questions_path(str(tmp_path), 7)
  m = play.evaluate(c, w, env, {}, step=7, questions_file=path)
  with open(path) as f:
    rec = json.load(f)
  questions = tasks.eval_questions(c, env)
  assert rec["step"] == 7 and rec["question_ids"] == [q.id for q in questions]
  assert 0 < sum(rec["correct"]) < len(questions)
  assert rec["accuracy"] == pytest.approx(m["eval/accuracy"], abs=1e-4)
  for hops in {len(q.hops) for q in questions}:
    right = [ok for ok, q in zip(rec["correct"], questions) if len(q.hops) == hops]
    assert sum(right) / len(right) == pytest.approx(m[f"eval/accuracy_hops{hops}"])
  assert len(rec["sub_calls"]) == round(m["eval/delegations"] * len(questions))
  assert 0 < rec["sub_call_accuracy"] < 1
  assert {x["q"] for x in rec["sub_calls"]} <= set(range(len(questions)))


def test_warm_start_probe_reads_visits_and_scores_ids():
  """warm_start_probe.py: the first visit's hits and id are parsed from the text,
  the report's answer span is found, and an untrained sub-agent's probabilities of the right
  doc id and of the answer are near chance."""
  text = ("<search>Al Bo</search><|im_end|>\n<|im_start|>user\n<tool_response>\n[doc012] Al Bo: "
          "x.\n[doc003] Cy: y.\n</tool_response>\n<visit>doc003</visit> <visit>doc012</visit>")
  assert warm_start_probe._first_visit(text) == (["doc012", "doc003"], "doc003")
  assert warm_start_probe._first_visit("<search>Al</search>") is None
  loaded = warm_start_probe.load("smoke")
  tok = loaded[2].tokenizer
  tokens = tok.encode("<result>no</result> <result>Kraevein Institute</result><|im_end|>")
  start, end = warm_start_probe.result_span(tokens, tok)
  assert tok.decode(tokens[start:end]) == "Kraevein Institute"
  assert warm_start_probe.result_span(tok.encode("<result></result>"), tok) is None
  out = warm_start_probe.probe(*loaded, num_questions=6)
  assert out["step"] == 0 and out["questions"] == 6 and out["expert_sub_visits"] >= 6
  assert 0 < out["p_right_id"] <= out["p_hit_ids"] < 0.1  # 565 token ids, 200 of them doc ids
  assert out["expert_sub_results"] >= 6 and out["value_first"] == 0
  assert 0 <= out["p_value"] <= out["p_value_token"] < 0.05


@pytest.mark.parametrize("skill", ["visit", "report"])
def test_sub_skill_drill_cuts_after_its_target(skill):
  """sub_skill_drill.py: a visit row ends at the id of the first visit, a report
  row at `</result>` after the hop's answer; the target alone is in the `target` loss (with
  the report's `</result>`), and an untrained model is at chance on it."""
  out = sub_skill_drill.run("smoke", "tiny", steps=2, loss="target", worlds=1, skill=skill,
                            eval_every=2, valid_questions=16)
  assert out["train_rows"] > 0 and out["valid_rows"] > 0
  assert [e["step"] for e in out["evaluations"]] == [0, 2]
  first = out["evaluations"][0]
  assert (first["p_right_id"] if skill == "visit" else first["p_value_token"]) < 0.05
  c = sft_config.get_config("task=multihop,smoke,variant=mgrpo")
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  tok = env.tokenizer
  questions = env.valid[:4]
  for only_target in (True, False):
    got = sub_skill_drill.rows(c, w, env, questions, skill, only_target)
    assert len(got) >= len(questions)
    for tokens, mask, target in got:
      (at,) = np.flatnonzero(np.diff(np.concatenate([[0], target])) == 1)
      end = at + int(target.sum())
      if skill == "visit":
        assert end == len(tokens) and tok.decode(tokens[at - 1:at]) == "<visit>"
        assert re.fullmatch(r"doc\d+", tok.decode(tokens[at:]))
      else:
        assert end == len(tokens) - 1 and tok.decode(tokens[end:]) == "</result>"
        assert tok.decode(tokens[at - 1:at]) == "<result>"
        answers = {h.answer for q in questions for h in q.hops}
        assert tok.decode(tokens[at:end]) in answers
      assert (mask[target == 1] == 1).all()
      assert (mask.sum() == len(tokens) - at) == only_target


def test_question_log_reads_any_task_and_closes_the_book():
  """question_log: the noise-free experts answer every question of the task they are given
  (here an RL world's, with its tools) and none with every tool disabled, which leaves the
  caller's task as it was."""
  c = mgrpo_config.get_config("task=multihop,smoke,variant=mgrpo,policy=expert")
  c.limits.update(max_turns=12, max_new_tokens=256, max_len=8192)  # Room for 4 pages.
  world = tasks.rl_world_env(c, 0, tasks.build_env(c))
  questions = world.train[:3]
  tools = dict(world.tools)
  log = runs.question_log(c, env=world, questions=questions)
  assert log["accuracy"] == 1.0 and log["question_ids"] == [q.id for q in questions]
  closed = runs.question_log(c, env=world, questions=questions, closed_book=True)
  assert closed["accuracy"] == 0.0 and world.tools == tools


def test_split_view_counts_by_length_call_and_page():
  """split_pages.py: a split's record by chain length, by call index, and by the
  page a chain opens on (a page counts as read when any of its first calls is right)."""
  from mgrpo_jax.envs.world import Hop, Question
  hop = lambda doc, attr: Hop(entity=doc, attribute=attr, answer="x", doc_id=doc, question="?")
  qs = [Question(id="a", text="", answer="", hops=(hop("d1", "founder"),)),
        Question(id="b", text="", answer="", hops=(hop("d1", "founder"), hop("d2", "year"))),
        Question(id="c", text="", answer="", hops=(hop("d3", "founder"), hop("d2", "year")))]
  record = dict(question_ids=["a", "b", "c"], correct=[True, False, False], accuracy=1 / 3,
                sub_calls=[dict(q=0, call=0, correct=True), dict(q=1, call=0, correct=False),
                           dict(q=1, call=1, correct=False), dict(q=2, call=0, correct=False)])
  v = split_pages.split_view(qs, record)
  assert v["first_pages"] == 2 and v["first_pages_all_or_none"] == 1  # d1: one of two right.
  assert v["by_hops"] == {1: dict(n=1, right=1, rate=1.0), 2: dict(n=2, right=0, rate=0.0)}
  assert v["sub_calls_by_index"] == {0: dict(n=3, right=1, rate=0.3333),
                                     1: dict(n=1, right=0, rate=0.0)}
  assert v["first_call_by_attribute"] == {"founder": dict(
      calls=dict(n=3, right=1, rate=0.3333), pages=dict(n=2, right=1, rate=0.5))}
  with pytest.raises(ValueError, match="other questions"):
    split_pages.split_view(qs[:2], record)
