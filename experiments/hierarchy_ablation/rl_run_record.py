"""An RL run's record for a results JSON, read from its workdir alone.

The ablation's RL runs (`results/hierarchy-rl-valid-cpu.json`, `runs`) are judged by
their evaluations (accuracy overall and by pages needed, delegations per question, the
sub-agent's per-call accuracy) and by what their own training batches held, in blocks of
steps (the main agent's accuracy, batches with no right answer or an exactly-zero main
gradient, delegations, format, entropies, the sub-agent's per-call accuracy where the run
logged it, time). Everything comes from the workdir: `config.json` (the settings that
matter for RL), `metrics.jsonl`, `eval_questions/step_<n>.json` and `config_changes.jsonl`
(a resume that moved `num_steps`).

  python -m experiments.hierarchy_ablation.rl_run_record --workdir=/work/hier5/rl-short \
      --command="python launch/train.py ..." --commit=843e746 --note="..." \
      --add_to=experiments/hierarchy_ablation/results/hierarchy-rl-valid-cpu.json

Without `--add_to` the record is printed. With it, the record replaces the run of the same
`name` (default: the workdir's last part) in the JSON's `runs`, or is appended.

Paired views, question by question (McNemar's exact test, `instrument.mcnemar`):
each evaluation against the run's step-0 evaluation (`vs_step_0`: questions gained, lost),
and with `--against=NAME=WORKDIR,...` against other runs at every step both evaluated
(`paired`: questions only this run answers right, only the other).
"""

import json
import os

from absl import app, flags

from mgrpo_jax import metrics
from mgrpo_jax.mgrpo import play

from experiments.hierarchy_ablation import instrument as hi

# The settings of config.json an RL record states (dotted paths; absent ones are skipped).
SETTINGS = ("init", "variant", "num_queries", "num_rollouts", "main_optim.learning_rate",
            "rl_worlds", "rl_hop_weights", "alpha", "beta", "adv_scale", "num_steps")


def _get(config: dict, path: str):
  for part in path.split("."):
    if not isinstance(config, dict) or part not in config:
      return None
    config = config[part]
  return config


def _mean(rows, key):
  values = [r[key] for r in rows if key in r]
  return round(sum(values) / len(values), 4) if values else None


def evaluations(workdir: str, rows: list[dict], records: dict[int, dict]) -> list[dict]:
  """Each evaluation's accuracy, by pages needed, delegations and sub-agent call accuracy;
  `records`: the run's `question_records`."""
  out = []
  for r in rows:
    if "eval/accuracy" not in r:
      continue
    e = dict(step=r["step"], accuracy=round(r["eval/accuracy"], 4))
    pages = sorted(int(k.removeprefix("eval/accuracy_hops")) for k in r
                   if k.startswith("eval/accuracy_hops"))
    if pages:
      e["accuracy_by_pages"] = [round(r[f"eval/accuracy_hops{p}"], 4) for p in pages]
    if "eval/delegations" in r:
      e["delegations"] = round(r["eval/delegations"], 3)
    questions = records.get(r["step"])
    if questions is not None:
      e["sub_call_accuracy"] = questions.get("sub_call_accuracy")
      if r["step"] != 0 and 0 in records:
        t = hi.mcnemar_records(questions, records[0],
                               f"step {r['step']} and step 0 of {workdir}")
        e["vs_step_0"] = dict(gained=t["a_only"], lost=t["b_only"], mcnemar_p=t["mcnemar_p"])
    out.append(e)
  return out


def question_records(workdir: str) -> dict[int, dict]:
  """The per-question records of the run's evaluations (`play.question_record`), by step."""
  folder = os.path.dirname(play.questions_path(workdir, 0))
  out = {}
  for name in os.listdir(folder) if os.path.isdir(folder) else []:
    if name.startswith("step_") and name.endswith(".json"):
      with open(os.path.join(folder, name)) as f:
        out[int(name.removeprefix("step_").removesuffix(".json"))] = json.load(f)
  return out


def paired(workdir: str, mine: dict[int, dict], against: dict[str, str]) -> list[dict]:
  """This run (its `question_records`, `mine`) against each named run, at every step both
  evaluated."""
  out = []
  for name, other_dir in against.items():
    theirs = question_records(other_dir)
    for step in sorted(set(mine) & set(theirs)):
      t = hi.mcnemar_records(mine[step], theirs[step],
                             f"{workdir} and {other_dir} at step {step}")
      out.append(dict(run=name, step=step, this_only=t["a_only"], other_only=t["b_only"],
                      mcnemar_p=t["mcnemar_p"]))
  return out


def training_blocks(rows: list[dict], block: int) -> list[dict]:
  """What the training batches held, per `block` steps."""
  train = [r for r in rows if "main/accuracy" in r]
  out = []
  for a in range(0, len(train), block):
    seg = train[a:a + block]
    b = {"steps": f"{seg[0]['step']}-{seg[-1]['step']}",
         "main_batch_accuracy": _mean(seg, "main/accuracy"),
         "batches_without_a_right_answer": sum(r["main/accuracy"] == 0 for r in seg),
         "main_zero_gradient": sum(r.get("main/grad_norm") == 0 for r in seg),
         "main_delegations": _mean(seg, "main/delegations"),
         "main_format": _mean(seg, "main/format"),
         "main_entropy": _mean(seg, "main/entropy"),
         "sub_entropy": _mean(seg, "sub/entropy"),
         "sub_call_accuracy": _mean(seg, "sub/call_accuracy"),
         "rollout_s": round(sum(r.get("time/rollout_s", 0.0) for r in seg), 1),
         "step_s": round(sum(r.get("time/step_s", 0.0) for r in seg), 1)}
    out.append({k: v for k, v in b.items() if v is not None})
  return out


def record(workdir: str, *, name: str = "", command: str = "", commit: str = "",
           note: str = "", block: int = 30, against: dict[str, str] | None = None) -> dict:
  """The run's record (see the module docstring)."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  rows = metrics.read_metrics(workdir)
  rec = dict(name=name or os.path.basename(os.path.normpath(workdir)))
  if command:
    rec["command"] = command
  if commit:
    rec["commit"] = commit
  rec["workdir"] = workdir
  settings = {k: _get(config, k) for k in SETTINGS}
  rec["settings"] = {k: v for k, v in settings.items() if v is not None}
  changes = os.path.join(workdir, "config_changes.jsonl")
  if os.path.exists(changes):
    with open(changes) as f:
      rec["config_changes"] = [json.loads(line)["fields"] for line in f if line.strip()]
  if note:
    rec["note"] = note
  records = question_records(workdir)
  rec["evaluations"] = evaluations(workdir, rows, records)
  if against:
    rec["paired"] = paired(workdir, records, against)
  rec["training_blocks"] = training_blocks(rows, block)
  return rec


def add_to(path: str, rec: dict) -> None:
  """Replaces the run of `rec`'s name in `path`'s `runs`, or appends it."""
  with open(path) as f:
    data = json.load(f)
  runs = [r for r in data.get("runs", []) if r.get("name") != rec["name"]]
  data["runs"] = runs + [rec]
  with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  os.replace(path + ".tmp", path)


def _against(items: list[str]) -> dict[str, str]:
  out = {}
  for item in items:
    name, sep, workdir = item.partition("=")
    if not sep or not name or not workdir:
      raise app.UsageError(f"--against={item!r}: expected NAME=WORKDIR")
    if name in out:
      raise app.UsageError(f"--against names {name!r} twice")
    if not os.path.isdir(os.path.dirname(play.questions_path(workdir, 0))):
      raise app.UsageError(f"--against={item!r}: {workdir} holds no eval_questions/")
    out[name] = workdir
  return out


def main(argv):
  del argv
  rec = record(_WORKDIR.value, name=_NAME.value, command=_COMMAND.value,
               commit=_COMMIT.value, note=_NOTE.value,
               block=_BLOCK.value, against=_against(_AGAINST.value))
  if _ADD_TO.value:
    add_to(_ADD_TO.value, rec)
  print(json.dumps(rec, indent=1))


if __name__ == "__main__":
  # Flags only when run: tests and other modules import this one's functions.
  _WORKDIR = flags.DEFINE_string("workdir", None, "The RL run's workdir.", required=True)
  _NAME = flags.DEFINE_string("name", "", "The run's name in `runs` (default: the workdir's "
                              "last part).")
  _COMMAND = flags.DEFINE_string("command", "", "The command(s) that made the run.")
  _COMMIT = flags.DEFINE_string("commit", "", "The commit of the code the run ran (the workdir "
                                "keeps none).")
  _NOTE = flags.DEFINE_string("note", "", "What the run changes, and anything its numbers need.")
  _BLOCK = flags.DEFINE_integer("block", 30, "Training steps per training block.")
  _ADD_TO = flags.DEFINE_string("add_to", "", "A results JSON whose `runs` gets the record.")
  _AGAINST = flags.DEFINE_list("against", [], "NAME=WORKDIR of runs to pair with, question by "
                               "question, at every step both evaluated.")
  app.run(main)
