"""MAGRPO (algorithm.md 2): cooperative agents trained on one joint reward.

  python launch/train.py --config=configs/magrpo.py:runlocal --workdir=/tmp/magrpo
  python launch/train.py --config=configs/magrpo.py:task=code,hf_path=/ckpt/qwen3 --workdir=/tmp/c
  python launch/train.py --config=configs/magrpo.py:smoke,turns=2,mode=cross --workdir=/tmp/s

Arguments (comma-separated): task=pick|code|tldr|article, model=<preset>, hf_path=<dir>,
init=<workdir with hf/<agent>>, path=<task jsonl>, turns=<int>, mode=align|cross, group=<G>,
variant=magrpo|single, pipeline=parallel|sequential|discussion, agents=<N> (pick only),
seed=<int>, lora=<rank> (LoRA agents; 0 = full fine-tuning), runlocal (the CPU demo: pick
task, warm start + MAGRPO), smoke (2 steps).
"""

import ml_collections

from configs import common

TASKS = ("pick", "code", "tldr", "article")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = common.parse_args(arg, dict(task="", model="tiny", hf_path="", init="", path="",
                                     turns=1, mode="align", group=4, seed=0, runlocal=False,
                                     variant="magrpo", pipeline="parallel", agents=2,
                                     smoke=False, lora=0))
  # Default task: the CPU demo's for runlocal/smoke, else HumanEval code collaboration.
  args["task"] = args["task"] or ("pick" if args["runlocal"] or args["smoke"] else "code")
  if args["task"] not in TASKS:
    raise ValueError(f"task={args['task']!r}; expected one of {TASKS}.")
  c = ml_collections.ConfigDict()
  c.program = "magrpo"  # Which library entry point launch/train.py runs.
  c.seed = args["seed"]
  c.tokenizer = args["hf_path"] or "byte"  # "byte" or a local HF tokenizer directory.
  c.task = ml_collections.ConfigDict(dict(
      name=args["task"],
      path=args["path"],  # jsonl (HumanEval format, TLDR or abstracts); "" = built in/generated.
      test_fraction=0.25,
      seed=0,  # Train/test split.
      num_agents=2,  # pick: agents, and words listed per prompt.
      num_generated=64,  # tldr/article: size of the generated offline corpus.
      workers=4,  # code: sandboxes run in parallel.
      timeout_per_test_s=10.0,  # code: per assert (algorithm.md 2.3).
  ))
  # "magrpo": one model per agent; "single": the single-model baseline (one model writes
  # every part, trained with the same group-relative objective).
  c.variant = args["variant"]
  # "parallel" (MAGRPO), or the untrained baselines' "sequential" / "discussion" (run them
  # with num_steps=0 to evaluate only).
  c.pipeline = args["pipeline"]
  c.model = common.model(args["model"])  # Every agent: the same architecture, its own weights.
  c.model.hf_path = args["hf_path"]
  c.model.lora.rank = args["lora"]
  c.init = args["init"]  # Workdir whose hf/<agent> weights start the run ("" = c.model).
  c.num_prompts = 4  # P: prompts per step.
  c.group = args["group"]  # G: samples per agent per node (algorithm.md 2.1: 4).
  c.joint_mode = args["mode"]  # "align" (G joint actions) or "cross" (G^N).
  c.num_turns = args["turns"]
  c.gamma = 0.9  # Return = r_t + gamma * mean(children's returns).
  c.turn_weights = tuple([1.0] * args["turns"])  # Loss weight per turn (paper era: 1.2, 0.8).
  c.adv_scale = "none"  # A = R - mean (paper era); "std" divides by the group's std.
  c.adv_eps = 1e-6
  c.loss = common.loss()
  c.loss.kind = "reinforce"  # -A * sum_t log pi(a_t), averaged over the group; or "clipped".
  c.loss.agg = "seq-mean-token-sum"
  c.optim = common.optimizer(2e-5)  # 2e-5 for code, 1e-5 for writing; no weight decay.
  c.optim.weight_decay = 0.0
  c.optim.b2 = 0.999
  c.sampling = common.sampling()
  c.sampling.update(temperature=0.7, top_p=0.9, top_k=50)
  c.eval_sampling = common.sampling()
  c.eval_sampling.temperature = 0.0  # Greedy evaluation.
  c.max_new_tokens = 256
  c.max_len = 4096  # Prompt + completion, every turn's history included.
  c.warm_start = ml_collections.ConfigDict(dict(
      num_steps=0,  # Supervised steps on the task's demonstrations before RL (pick only).
      batch_size=32,  # Examples per agent per step.
      learning_rate=1e-3,
  ))
  c.num_micro = 1
  c.mesh = common.mesh()
  c.num_steps = 200
  c.eval_every = 20
  c.num_eval = 64  # Held-out examples (fewer when the split has fewer).
  c.checkpoint_every = 20
  c.max_to_keep = 2
  c.log_every = 1  # Steps between plain log lines when no terminal shows the progress bar.
  c.update(common.log_sinks())  # log_to, wandb.
  c.task.num_agents = args["agents"]
  if args["task"] in ("tldr", "article"):
    c.optim.learning_rate = 1e-5
  if args["runlocal"] or args["smoke"]:
    _cpu(c)
  if args["smoke"]:
    c.num_steps, c.eval_every, c.num_eval, c.checkpoint_every = 2, 1, 4, 1
    c.num_prompts, c.warm_start.num_steps = 2, 2
  if args["task"] != "pick" and (args["runlocal"] or args["smoke"]):
    # No demonstrations to copy, and real prompts are long.
    c.task.name, c.warm_start.num_steps = args["task"], 0
    c.max_new_tokens, c.max_len = 32, 4096
  return c


def _cpu(c):
  """The CPU demo: two tiny agents learn to pick different words."""
  c.max_new_tokens, c.max_len = 8, 128
  c.sampling.update(temperature=1.0, top_p=1.0, top_k=0)
  c.num_prompts, c.group = 8, 4
  c.optim.learning_rate = 3e-4  # 1e-3 learns faster, then loses the format (measured).
  c.warm_start.num_steps = 400
  c.num_steps, c.eval_every, c.checkpoint_every = 150, 25, 50


def sweep():
  """The CPU demo over 3 seeds (each: warm start, then MAGRPO)."""
  for seed in range(3):
    yield f"runlocal,seed={seed}"
