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
      context_weight=0.0,  # Loss weight of prompt / tool-reply tokens (generated ones: 1).
      other_roles_weight=0.0,  # > 0: add batch_size/2 rows of other roles' traces, as text.
      corpus_weight=0.0,  # > 0: add batch_size/2 rows of the world's pages, as text.
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
    _multihop(c, mgrpo.multihop_size(args))
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


def _multihop(c, size: str):
  """The warm start of the hierarchy ablation: one recipe for every variant.

  Each variant's agents learn from the same number of expert episodes on the same training
  questions, with the same steps, batch and learning rate; an episode that ends in a context
  overflow is not format-valid and, as for any variant, is not trained on (so the single
  agent learns from the one-page questions it can finish). The experts slip 10% of the time
  per decision: slips compound over a question's pages, and the noisy main + sub experts are
  right on 62.8% of 500 held-out CPU questions at 10% (37.6% at 20%, 18.6% at 30%; launch/
  evaluate.py --config=configs/mgrpo.py:task=multihop,runlocal,policy=expert
  --config.expert_noise=0.1). A warm start imitates its teacher: from 30% it reached 14% after
  600 steps (64 held-out questions); from 10%, 27.3% / 32.8% / 35.9% after 600 / 900 / 1200
  (128 held-out questions; padded updates), 26.6% / 21.9% / 35.2% with the packed updates the
  CPU size now uses. M-GRPO (seed 0, 30 steps) lowered the 600-step warm start to 16.4% and
  raised the 1200-step one to 42.2%: 1200 steps.
  """
  c.sft.update(num_questions=3000, expert_noise=0.1, num_steps=1200, batch_size=32,
               learning_rate=2e-3, corpus_weight=1.0, eval_every=300, checkpoint_every=100)
  if size == "gpu":
    c.sft.update(num_questions=8000, num_steps=1000, batch_size=16, learning_rate=1e-5,
                 corpus_weight=0.0, eval_every=250, checkpoint_every=250)
  if size == "smoke":
    c.sft.update(num_questions=32, num_steps=2, batch_size=4, eval_every=2, checkpoint_every=1)


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
