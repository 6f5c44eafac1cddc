"""Why the test split is harder than validation, page by page.

The same agents' greedy evaluation on both held-out splits (each a per-question record,
`play.question_record`): accuracy by chain length, the accuracy test would have at
validation's per-length rates, the sub-agent's calls right by call index, and by the page a
question's chain opens on (its first hop's page) and that hop's attribute. The questions that
open on one page largely share its outcome, so a split's unit is the page, not the question.

  python -m experiments.hierarchy_ablation.split_pages --warm_start=/work/sweep/sft-mgrpo \
      --test_record=/work/sweep/mgrpo_seed0/eval_questions/step_0.json \
      --pages_out=experiments/hierarchy_ablation/results/split-pages-cpu.json

`--test_record`/`--valid_record`: records the runs already wrote (an RL run's step 0 is its
warm start's); a split without one is evaluated here (`hierarchy_runs.question_log`, about
3 minutes on 2 cores).
"""

import collections
import json

import numpy as np
from absl import app, flags

from configs import mgrpo as mgrpo_config
from mgrpo_jax.mgrpo import tasks

from experiments.hierarchy_ablation import runs

ARG = "task=multihop,runlocal,variant=mgrpo"


def _rate(xs) -> dict:
  return dict(n=len(xs), right=int(sum(xs)), rate=round(float(np.mean(xs)), 4) if xs else None)


def split_view(questions, record: dict) -> dict:
  """One split's record, by chain length, by call index and by first page."""
  if record["question_ids"] != [q.id for q in questions]:
    raise ValueError("the record holds other questions than this split's evaluation")
  by_hops, calls, pages = (collections.defaultdict(list) for _ in range(3))
  for q, right in zip(questions, record["correct"]):
    by_hops[len(q.hops)].append(right)
  for call in record["sub_calls"]:
    calls[call["call"]].append(call["correct"])
    if call["call"] == 0:
      hop = questions[call["q"]].hops[0]
      pages[(hop.doc_id, hop.attribute)].append(call["correct"])
  by_attribute, by_page = collections.defaultdict(list), collections.defaultdict(list)
  for (page, attribute), rights in pages.items():
    by_attribute[attribute].append(any(rights))
    by_page[page] += rights
  return dict(
      questions=len(questions), accuracy=record["accuracy"],
      first_pages=len({q.hops[0].doc_id for q in questions}),
      # First pages whose first calls are all right or all wrong: they share one outcome.
      first_pages_all_or_none=sum(all(v) or not any(v) for v in by_page.values()),
      by_hops={h: _rate(v) for h, v in sorted(by_hops.items())},
      sub_calls_by_index={i: _rate(v) for i, v in sorted(calls.items())},
      # Per first hop's attribute: its first calls, and its pages with any first call right.
      first_call_by_attribute={a: dict(calls=_rate([x for (_, b), v in pages.items() if b == a
                                                    for x in v]), pages=_rate(by_attribute[a]))
                               for a in sorted(by_attribute)})


def main(argv):
  del argv
  c = mgrpo_config.get_config(f"{ARG},init={_WARM_START.value}")
  env = tasks.build_env(c)
  out = {}
  for split in ("valid", "test"):
    c.eval_split = split
    path = _RECORDS[split].value
    if path:
      with open(path) as f:
        record = json.load(f)
    else:
      record = runs.question_log(c)
    out[split] = dict(record=path or "evaluated here", **split_view(
        tasks.eval_questions(c, env), record))
  rates = {h: v["rate"] for h, v in out["valid"]["by_hops"].items()}
  test = out["test"]["by_hops"]
  out["test_at_valid_rates_by_hops"] = round(
      sum(rates[h] * v["n"] for h, v in test.items()) / out["test"]["questions"], 4)
  print(json.dumps(out, indent=1))
  if _PAGES_OUT.value:
    with open(_PAGES_OUT.value, "w") as f:
      json.dump(dict(command="python -m experiments.hierarchy_ablation.split_pages --warm_start="
                     f"{_WARM_START.value} " + " ".join(f"--{s}_record={f.value}" for s, f in
                                                      _RECORDS.items() if f.value),
                     **out), f, indent=1)


if __name__ == "__main__":
  # Flags only when run: tests and other modules import this one's functions.
  _WARM_START = flags.DEFINE_string("warm_start", None, "The main + sub agents' workdir (hf/).",
                                    required=True)
  _RECORDS = {split: flags.DEFINE_string(f"{split}_record", "", f"A per-question record of the "
                                         f"agents on the {split} split (default: evaluate here).")
              for split in ("valid", "test")}
  _PAGES_OUT = flags.DEFINE_string("pages_out", "", "Results JSON (default: print only).")
  app.run(main)
