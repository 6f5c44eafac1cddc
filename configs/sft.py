"""Supervised warm start on the scripted experts' traces, for any variant of configs/mgrpo.py.

  python launch/train.py --config=configs/sft.py:runlocal --workdir=/tmp/sft
  python launch/train.py --config=configs/mgrpo.py:runlocal,init=/tmp/sft --workdir=/tmp/rl
  python benchmarks/mgrpo_demo.py   # both, through the library, with accuracies in a JSON

Takes the same arguments as configs/mgrpo.py (the variant decides which agents are trained).
  python launch/train.py --config=configs/sft.py:task=qa,smoke \
      --config.data.train=tests/data/qa/musique.jsonl \
      --config.data.eval=tests/data/qa/musique.jsonl --workdir=/tmp/qa_sft
"""

import ml_collections

from configs import mgrpo


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = mgrpo.get_config(arg)
  c.program = "sft"
  c.sft = ml_collections.ConfigDict(dict(
      num_questions=300,  # Training questions the experts solve (one trace each).
      expert_noise=0.1,  # Imperfect demonstrations leave room for RL to improve.
      only_correct=False,  # Keep wrong-but-well-formed traces too.
      # > 0: the traces are shared evenly between the training split and this many other
      # generated worlds (tasks.other_world_env): more names than a tiny model memorises.
      other_worlds=0,
      # -1: other_worlds. More: the experts' questions come from this many other worlds
      # (the same share of num_questions from each, and from the training split), of which
      # only the first other_worlds give their pages as corpus rows (the single agent's:
      # more questions, the same share per world and the same pages as the pair's).
      trace_worlds=-1,
      context_weight=0.0,  # Loss weight of prompt / tool-reply tokens (generated ones: 1).
      other_roles_weight=0.0,  # > 0: add batch_size/2 rows of other roles' traces, as text.
      corpus_weight=0.0,  # > 0: add batch_size/2 rows of the world's pages, as text.
      # > 0: add batch_size rows per agent of its visiting traces cut after their first
      # visit, the visit turn alone in the loss at this weight (sft.visit_drills).
      visit_drill_weight=0.0,
      # Loss weight of the agents' <result> and <answer> turns in their own traces
      # (sft.weigh_reports; other generated tokens: 1).
      report_weight=1.0,
      num_steps=300,
      batch_size=16,  # Episodes per agent per step.
      learning_rate=1e-3,
      weight_decay=0.0,
      eval_every=100,
      checkpoint_every=50,
  ))
  args = mgrpo.arguments(arg)
  smoke = args["smoke"]
  if args["task"] == "multihop":
    _multihop(c, mgrpo.multihop_size(args), args["variant"])
    return c
  if args["task"] == "qa":
    _qa(c, mgrpo.multihop_size(args))
    return c
  if args["runlocal"] and not smoke:
    # The CPU demo (launch/demo.py): a tiny model, enough distinct questions that it learns
    # to copy names rather than memorise, the world's pages as text so that held-out names
    # (never in a training question) have trained embeddings too. The experts slip 40% of the
    # time (on these one-hop questions with one search hit: a vague delegation, or reporting
    # another fact of the page): the warm start learns the protocol and copying and keeps some
    # of their hesitation, which RL then removes (with 15% slips the warm start is at 90%
    # held-out and RL gains 1-5 points).
    c.sft.update(num_questions=4000, expert_noise=0.4, num_steps=600, batch_size=32,
                 learning_rate=2e-3, corpus_weight=1.0, eval_every=300, checkpoint_every=100)
    # Packed updates in micro-batches of 1024 tokens: a step took 0.16 s on 2 cores against
    # 0.47 s as one padded batch (512: 0.14 s but more recompiles; 2048: 0.26 s; 4096: 0.29 s;
    # the same losses; benchmarks/results/mgrpo-demo-cpu-world-runs.json, packing_step_time).
    for mc in (c.main_model, c.sub_model):
      mc.max_tokens_per_micro = 1024
  if smoke:
    c.sft.update(num_questions=8, num_steps=2, batch_size=4, eval_every=2, checkpoint_every=1)
  return c


# The single agent's warm start keeps only correct demonstrations, and its teacher sees this
# many times more questions, so it keeps about as many episodes as the pair's main agent:
# at expert_noise 0.1 the single expert is right on 148 of the 1449 CPU
# training questions (10.2%; the pair's main expert ends format-valid on all of them). The
# extra questions come from this many times the worlds (sft.trace_worlds): a CPU world holds
# 1800-2900 questions at the task's chain lengths, not 4000 (120000 over 30 worlds).
SINGLE_QUESTIONS_FACTOR = 10


def _multihop(c, size: str, variant: str = "mgrpo"):
  """The warm start of the hierarchy ablation: one recipe, two declared differences.

  Each variant's agents learn with the same steps, batch and learning rate on the training
  split's questions; an episode that ends in a context overflow is not format-valid and is
  not trained on. The single agent keeps only correct demonstrations, from
  SINGLE_QUESTIONS_FACTOR times as many questions, so that it learns from about as many
  episodes as the pair's main agent (keeping every format-valid one gave it ~900, mostly
  wrong), from as many times the worlds: each world, the training split too, asks it as many
  questions as it asks the pair, and its corpus rows are the pair's (the same pages);
  `shared` gets batch_size rows of each role per step (mgrpo_jax/sft.py), as the pair.
  The experts slip 10% of the time per decision (the teacher): slips compound over a
  question's pages. The recipe (1200 steps, 10% slips, lr 2e-3) was chosen on an
  earlier version of the task (with comparison questions), on its test questions; on this
  task, any change to it is to be chosen on the validation split (config eval_split="valid").
  """
  # other_worlds: a model trained from random weights on the 140 CPU training entities
  # alone recalled a training name instead of copying a held-out one (0% on validation);
  # 29 other worlds make ~5,800 names, each in a few traces, and train every doc
  # id's token (the tokenizer byte+phrases+ids, configs/mgrpo.py).
  # visit_drill_weight: the sub-agent's choice of hit is one token of a ~500-token trace;
  # with the traces alone it stayed at chance for 1100 steps (experiments/hierarchy_ablation).
  # report_weight: so is copying the value from the page it then visits.
  # num_questions: from 3000 traces M-GRPO's RL gained 4.5 points on validation (7.2 ->
  # 11.7%), from 12000 5.2-9.4 (9.1 -> 14.3-18.5%, three seeds; experiments/hierarchy_ablation).
  c.sft.update(num_questions=12000, expert_noise=0.1, num_steps=1200, batch_size=32,
               learning_rate=2e-3, corpus_weight=1.0, eval_every=300, checkpoint_every=100,
               other_worlds=29, visit_drill_weight=50.0, report_weight=10.0)
  if size == "gpu":
    c.sft.update(num_questions=8000, num_steps=1000, batch_size=16, learning_rate=1e-5,
                 corpus_weight=0.0, eval_every=250, checkpoint_every=250,
                 visit_drill_weight=0.0, report_weight=1.0)
  if size == "smoke":
    c.sft.update(num_questions=32, num_steps=2, batch_size=4, eval_every=2, checkpoint_every=1,
                 other_worlds=1)
  if variant == "single":
    c.sft.update(only_correct=True, num_questions=SINGLE_QUESTIONS_FACTOR * c.sft.num_questions,
                 trace_worlds=SINGLE_QUESTIONS_FACTOR * (c.sft.other_worlds + 1) - 1)


def _qa(c, size: str):
  """The warm start on real QA data: the gold-structure experts' traces (agents/qa_experts.py).

  One trace per training question (cycled to `num_questions`); the experts make no slips
  (a slip would be a guess about real text), so noise is 0 and only format-valid traces are
  kept, right or wrong (a hop the search misses ends in "unknown", as it should).
  """
  c.sft.update(num_questions=2000, expert_noise=0.0, num_steps=500, batch_size=16,
               learning_rate=1e-5, eval_every=100, checkpoint_every=100)
  if size != "gpu":
    c.sft.update(learning_rate=1e-3, batch_size=8)
  if size == "smoke":
    c.sft.update(num_questions=8, num_steps=2, batch_size=8, eval_every=2, checkpoint_every=2)


def sweep():
  for variant in ("mgrpo", "single"):
    yield f"runlocal,variant={variant}"
