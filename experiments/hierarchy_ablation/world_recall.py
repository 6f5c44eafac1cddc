"""Does what RL learns on its own training questions reach chains it never saw?

Greedy accuracy of warm-started and RL'd agents (main + sub, CPU multihop task) on five
question sets: the training-split questions an RL run drew (open and closed book: the tools
answer with an error), another world the warm start read (`sft.other_worlds`' first), a
world nobody read (an RL world index past every run's; every chain length), that world's
one- and two-page questions (the chains the RL recipe trains on), and the validation
split's first `--num`. A gain on the first set that the others do not share is recall of
the worlds the agents trained on, not reading.

  python -m experiments.hierarchy_ablation.world_recall --runs=warm_start=/work/hier5/sft-mgrpo,\
rl_train_split=/work/hier5/rl-q8,rl_worlds=/work/hier5/rl-fresh \
      --rl_run=/work/hier5/rl-q8 --warm_start=/work/hier5/sft-mgrpo \
      --recall_out=experiments/hierarchy_ablation/results/world-recall-cpu.json
"""

import dataclasses
import json
import random
import time

from absl import app, flags, logging

from configs import mgrpo as mgrpo_config
from mgrpo_jax import keys
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import sft, tasks

from experiments.hierarchy_ablation import runs

ARG = "task=multihop,runlocal,variant=mgrpo"
UNREAD_WORLD = 9_999  # An RL world index no run here reached (rl_worlds <= num_steps <= 90).


def _sample(questions: list, n: int) -> list:
  questions = list(questions)
  random.Random(0).shuffle(questions)
  return questions[:n]


def question_sets(n: int) -> dict:
  """name -> (task, questions)."""
  c = mgrpo_config.get_config(ARG)
  c.rl_hop_weights = ()  # The unread world asks every chain length, as the task does.
  env = tasks.build_env(c)
  rl = workdir_lib.load_config(_RL_RUN.value)
  drawn = {q.id: q for step in range(rl.num_steps)
           for q in keys.examples_for_step(env.train, step, rl.num_queries, rl.seed)}
  s = workdir_lib.load_config(_WARM_START.value)
  if "sft" not in s:
    raise app.UsageError(f"--warm_start={_WARM_START.value}: its config.json is not a warm "
                         "start's (no sft section); pass the SFT workdir.")
  read = tasks.other_world_env(s, 0, sft.other_world_questions(s))  # As the warm start's.
  read = dataclasses.replace(read, tokenizer=env.tokenizer)
  unread = tasks.rl_world_env(c, UNREAD_WORLD, env)
  short = c.copy_and_resolve_references()
  short.rl_hop_weights = (1.0, 1.0, 0.0, 0.0)  # The RL recipe's chains, on a world RL never saw.
  unread_short = tasks.rl_world_env(short, UNREAD_WORLD, env)
  logging.info("RL drew %d distinct training questions in %d steps.", len(drawn), rl.num_steps)
  return {"rl_training_questions": (env, _sample(drawn.values(), n)),
          "warm_start_other_world": (read, _sample(read.train + read.test, n)),
          "unread_world": (unread, _sample(unread.train, n)),
          "unread_world_short_chains": (unread_short, _sample(unread_short.train, n)),
          "validation": (env, env.valid[:n])}


def main(argv):
  del argv
  sets = question_sets(_NUM.value)
  out = dict(what=__doc__.split("\n\n")[1].replace("\n", " "), arg=ARG, num=_NUM.value,
             rl_run=_RL_RUN.value, warm_start=_WARM_START.value, results=[])
  for item in _RUNS.value:
    label, workdir = item.split("=", 1)
    for name, (env, questions) in sets.items():
      for closed in (False, True) if name == "rl_training_questions" else (False,):
        t0 = time.perf_counter()
        c = mgrpo_config.get_config(f"{ARG},init={workdir}")
        log = runs.question_log(c, closed_book=closed, env=env, questions=questions)
        row = dict(agents=label, workdir=workdir, questions=name,
                   book="closed" if closed else "open", accuracy=log["accuracy"],
                   sub_call_accuracy=log["sub_call_accuracy"],
                   wall_s=round(time.perf_counter() - t0, 1))
        logging.info("%s", row)
        out["results"].append(row)
  print(json.dumps(out, indent=1))
  if _RECALL_OUT.value:
    with open(_RECALL_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  # Flags only when run: tests and other modules import this one's functions.
  _RUNS = flags.DEFINE_list("runs", None, "label=workdir of each set of agents (a warm start's "
                            "or an RL run's; its final weights, hf/).", required=True)
  _RL_RUN = flags.DEFINE_string("rl_run", None, "The RL workdir on the training split whose "
                                "drawn questions are the first set.", required=True)
  _WARM_START = flags.DEFINE_string("warm_start", None, "The warm start's workdir: its own "
                                    "config (sft.num_questions, sft.other_worlds) gives the other "
                                    "world it read.", required=True)
  _NUM = flags.DEFINE_integer("num", 96, "Questions per set.")
  _RECALL_OUT = flags.DEFINE_string("recall_out", "", "Results JSON (default: print only).")
  app.run(main)
