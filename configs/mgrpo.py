"""M-GRPO and its ablations (algorithm.md 1): colocated training of a main agent and a sub-agent.

  python launch/train.py --config=configs/mgrpo.py:runlocal --workdir=/tmp/mgrpo
  python launch/train.py --config=configs/mgrpo.py:smoke,variant=single --workdir=/tmp/s
  python launch/evaluate.py --config=configs/mgrpo.py:runlocal,policy=expert --workdir=/tmp/e
  python launch/demo.py --workdir=/tmp/demo # the CPU demo: warm start, then M-GRPO
  python benchmarks/mgrpo_demo.py --sweep   # its ablation: warm starts, then sweep() below
  python launch/train.py --config=configs/mgrpo.py:gpu,hf_path=/ckpt/Qwen3-0.6B --workdir=/w
  python -m experiments.hierarchy_ablation.sweep --size=cpu   # the hierarchy ablation

Arguments (comma-separated): variant=mgrpo|frozen_sub|single|shared|unaligned,
model=<preset> (default tiny; tiny_wide with runlocal), hf_path=<dir>, init=<sft workdir>,
policy=model|expert, protocol=tags|native (how the agents call their tools, as
--config.protocol does; a byte tokenizer gives native's tool declarations and call JSON one id
each, so a native prompt costs about what a tag prompt does), seed=<int>, lora=<rank> (LoRA
agents: both models' lora.rank; 0 = full fine-tuning), runlocal, smoke, gpu (one 80 GB GPU at
the paper's limits: Qwen3-0.6B preset unless model= or hf_path=, bf16 compute over f32 master
weights, remat, packed token-budget updates, cuDNN attention where it applies, memory proved
by benchmarks/memory.py),
task=world|multihop|qa (multihop: long pages, 1-4 hop bridge questions over held-out chains,
`_multihop`; its size is gpu, smoke, or cpu for runlocal or no flag; qa: your questions,
`_qa`, e.g.
  python launch/evaluate.py --config=configs/mgrpo.py:task=qa,policy=expert \
      --config.data.format=musique --config.data.eval=musique_dev.jsonl --workdir=/tmp/qa
  python launch/train.py --config=configs/mgrpo.py:task=qa,gpu,hf_path=/ckpt/Qwen3-0.6B,\
init=/tmp/sft --config.data.train=train.jsonl --config.data.eval=dev.jsonl \
      --config.data.corpus=http://127.0.0.1:8000/retrieve --workdir=/tmp/qa_rl
see docs/own-data.md), full_context (task=multihop: a max_len that holds every page a
question needs, the single agent's control).
"""

import ml_collections

from configs import common
from mgrpo_jax import models

VARIANTS = ("mgrpo", "frozen_sub", "single", "shared", "unaligned")
TASKS = ("world", "multihop", "qa")


def arguments(arg: str | None) -> dict:
  """The typed arguments of `arg` (configs/sft.py takes the same)."""
  args = common.parse_args(arg, dict(variant="mgrpo", model="", hf_path="", init="",
                                     policy="model", seed=0, runlocal=False, smoke=False,
                                     gpu=False, lora=0, task="world", full_context=False,
                                     protocol="tags"))
  if args["variant"] not in VARIANTS:
    raise ValueError(f"variant={args['variant']!r}; expected one of {VARIANTS}.")
  if args["task"] not in TASKS:
    raise ValueError(f"task={args['task']!r}; expected one of {TASKS}.")
  return args


def multihop_size(args: dict) -> str:
  """The multi-hop task's size: "gpu", "smoke" or "cpu" (runlocal, or no size flag)."""
  return "gpu" if args["gpu"] else "smoke" if args["smoke"] else "cpu"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = arguments(arg)
  c = ml_collections.ConfigDict()
  c.program = "mgrpo"  # Which library entry point launch/train.py runs.
  c.seed = args["seed"]
  # mgrpo: both trained; frozen_sub: only main trained; single: one agent with every tool;
  # shared: one set of weights plays both roles.
  # unaligned: mgrpo with the sub-agent trained on each rollout's own calls, none duplicated or
  # dropped (algorithm.md 1.4 off: rollouts weigh by their number of calls).
  c.variant = args["variant"]
  c.policy = args["policy"]  # "model", or "expert": evaluate the scripted experts.
  c.expert_think = True  # Scripted experts write a short <think> before each action.
  # policy=expert: the probability of a slip per decision (0: the noise-free experts; the
  # warm start's teacher slips at configs/sft.py's sft.expert_noise).
  c.expert_noise = 0.0
  # "" = the checkpoint's own (main_model.hf_path's tokenizer and chat template; "byte"
  # without a checkpoint), "byte", "byte+names" (+ the world's names as words), "byte+world"
  # (+ its phrases too), "byte+phrases" (the phrases, names in bytes), "byte+phrases+ids"
  # (+ doc ids; see tasks.tokenizer_words) or a local HF tokenizer directory.
  c.tokenizer = ""
  preset = args["model"] or ("tiny_wide" if args["runlocal"] and not args["smoke"] else "tiny")
  c.main_model = common.model(preset)
  c.sub_model = common.model(preset)
  c.main_model.hf_path = c.sub_model.hf_path = args["hf_path"]
  c.main_model.lora.rank = c.sub_model.lora.rank = args["lora"]
  c.init = args["init"]  # SFT workdir whose final weights start RL ("" = from the model).
  c.world = common.world(seed=0)
  c.retrieval = common.retrieval()
  c.tools = common.tools()
  c.limits = common.limits()
  c.sampling = common.sampling()
  c.eval_sampling = common.sampling()
  c.eval_sampling.temperature = 0.0  # Greedy evaluation.
  c.num_queries = 2  # Q per step (the quick start of the reference: 2 x 8).
  # Where RL's questions come from: 0 = the training split; N > 0 = N generated worlds that
  # no warm start read, step s on world s mod N (mgrpo/tasks.py:TrainingQuestions).
  c.rl_worlds = 0
  # With rl_worlds: the RL worlds' questions by pages needed, as world.hop_weights
  # (() = world.hop_weights): RL on the shorter chains, the evaluation on every length.
  c.rl_hop_weights = ()
  c.num_rollouts = 8  # K
  c.align_d = 4  # D: aligned sub-agent episodes per main rollout.
  c.align_on_empty = "mask"  # "mask" or "borrow" for rollouts that never delegated.
  c.alpha = (0.1, 0.9)  # Main reward: format, correct.
  c.beta = (0.1, 0.9, 0.0)  # Sub reward: format, main's correctness, expert judge.
  # The r_expert judge of beta[2] (called only when beta[2] > 0): "grounded" (rule: the
  # share of the result's words found in the tool replies the sub-agent read) or
  # "module:callable", an LLM judge (subtask, result, tool replies) -> score in [0, 1].
  c.sub_judge = "grounded"
  c.adv_scale = "std"  # "std" (M-GRPO) or "none" (Dr. GRPO).
  c.adv_eps = 1e-6
  c.main_loss = common.loss()
  c.sub_loss = common.loss()
  c.main_optim = common.optimizer(1e-6)
  c.sub_optim = common.optimizer(1e-6)
  c.num_micro = 1  # Gradient accumulation micro-batches per update.
  c.mesh = common.mesh()
  c.num_steps = 100
  c.eval_every = 20  # Steps; step 0 is always evaluated.
  c.num_eval_questions = 64
  # Which held-out questions evaluations answer: "test" (the table's) or "valid" (every tuning
  # choice; needs world.holdout).
  c.eval_split = "test"
  c.checkpoint_every = 10
  c.max_to_keep = 2
  c.log_every = 1  # Steps between plain log lines when no terminal shows the progress bar.
  # How every agent calls its tools: "tags" (<search>...</search>: agents/protocol.py) or
  # "native" (the checkpoint's own <tool_call> JSON, tools rendered by its chat template:
  # agents/native.py).
  c.protocol = args["protocol"]
  c.update(common.log_sinks())  # log_to, wandb.
  # Versions a row's behaviour policy may lag the policy being updated, per agent (a
  # decoupled main program also refuses older sub-agent results). >= 1 trains with the
  # truncated importance weight min(pi_old / pi_behaviour, C), C = staleness_tis_cap (a loss
  # section's own tis_cap wins when set), and the colocated program plays the next k steps'
  # rollouts while a step updates (docs/pipeline.md); 0 is the on-policy sequential step.
  c.max_staleness = 0
  c.staleness_tis_cap = 2.0
  # > 0 (with max_staleness >= 1, colocated): the first N devices sample, on a mesh of their
  # own (config.mesh's axes), the rest train; each policy version reaches them as one copy of
  # its compute-dtype weights. 0: every device does both.
  c.rollout_devices = 0
  if args["gpu"]:
    _gpu(c, preset=args["model"] or "qwen3_0p6b")
  if args["runlocal"] or args["smoke"] or (args["task"] != "world" and not args["gpu"]):
    _cpu(c)
  if args["task"] == "multihop":
    _multihop(c, multihop_size(args), full_context=args["full_context"])
    return c
  if args["full_context"]:
    raise ValueError("full_context is a control of task=multihop.")
  if args["task"] == "qa":
    _qa(c, multihop_size(args))
    return c
  if args["runlocal"]:
    _demo(c)
    if args["lora"]:
      # Adapters take a larger step than full weights (docs/results/cpu-demo.md: LoRA rank 8).
      c.main_optim.learning_rate = c.sub_optim.learning_rate = 1e-3
  if args["smoke"]:
    c.num_steps, c.eval_every, c.num_eval_questions, c.checkpoint_every = 2, 1, 4, 1
    c.num_rollouts, c.align_d = 2, 2
    c.limits.max_turns, c.limits.max_new_tokens = 3, 24
  return c


def _gpu(c, preset: str):
  """One H100/H200 at the paper's limits (20 turns, 1024 new tokens per turn, 32k context).

  Update memory (benchmarks/results/memory-cpu.json): a 16 x 32768-token main batch of
  Qwen3-0.6B takes about 22 GB per update step, a 64 x 8192 sub batch about the same.
  """
  for mc in (c.main_model, c.sub_model):
    mc.preset = preset
    if not mc.hf_path:
      # A random-weight preset keeps Qwen3's vocabulary (the tokenizer's ids fit inside it),
      # so its memory is the real model's.
      mc.vocab_size = models.get_preset(preset).vocab_size
    # attention="auto" keeps packed updates on the blockwise kernel; cuDNN's for them is
    # --config.main_model.attention=cudnn_packed (default once its gpu test has passed).
    mc.update(param_dtype="float32", compute_dtype="bfloat16", remat=True, attention="auto",
              max_tokens_per_micro=32_768, logits_chunk_mb=2048)


def _cpu(c):
  """A laptop-sized run: tiny models, short contexts, fast learning rates."""
  c.world.system_prompt = False
  c.expert_think = False  # Shorter demonstrations: every byte costs CPU time.
  c.world.search_k, c.world.visit_chars = 2, 400
  c.limits.update(max_turns=6, max_new_tokens=96, max_len=1024, max_delegations=4)
  c.num_queries, c.num_rollouts, c.align_d = 4, 4, 3
  c.main_optim.learning_rate = c.sub_optim.learning_rate = 3e-4
  c.main_optim.weight_decay = c.sub_optim.weight_decay = 0.0
  c.num_steps, c.eval_every, c.num_eval_questions = 40, 10, 32


def _demo(c):
  """The CPU demo (benchmarks/mgrpo_demo.py): a task a tiny model learns in minutes.

  One-hop questions only, documents without distractor sentences, one search hit: the main
  agent still delegates and answers, the sub-agent still searches, visits and reads the fact.
  """
  # A world of places asked one-hop questions: each answer is a country, a river or a
  # settlement size, read from the place's page. Copying names out of the context is what a
  # tiny model learns slowest: with one id per name and per question stem it is one
  # attention lookup. Many places, so that copying, not memorising questions, is what the
  # warm start learns (with 150 places it memorised the training questions: 0/112 held-out
  # delegations named the right place). The pages' phrases are words too: traces are a third
  # as long as in bytes, and the warm start is ~3x cheaper per step.
  c.tokenizer = "byte+world"
  c.world.update(num_people=2, num_orgs=2, num_places=500, num_works=0,
                 hop_weights=(1.0, 0.0, 0.0), num_questions=1500, distractors_per_doc=0,
                 search_k=1, visit_chars=400)
  c.limits.update(max_turns=4, max_new_tokens=64, max_len=576, max_delegations=2)
  c.num_queries, c.num_rollouts, c.align_d = 4, 8, 1  # One-hop: one delegation per rollout.
  c.main_optim.learning_rate = c.sub_optim.learning_rate = 2e-4
  # Evaluation on all 376 held-out questions (about places no training question names).
  c.num_steps, c.eval_every, c.num_eval_questions, c.checkpoint_every = 40, 20, 376, 20


# task=multihop,full_context: a context that holds every page a question needs (the single
# agent's control in the hierarchy ablation): the smallest max_len (cpu: of 1536, 1792, 2048,
# 2304; gpu: of 16384, 20480, 24576) at which the noise-free single expert finishes every
# question without an overflow (cpu: all 2000, where 2048 leaves 1.9% overflowing; gpu: the
# first 2000 of 8000, where 16384 leaves 6.7%; experiments/hierarchy_ablation/).
FULL_CONTEXT_LEN = {"cpu": 2304, "smoke": 2304, "gpu": 20_480}


def _multihop(c, size: str, full_context: bool = False):
  """Multi-hop research over long pages (envs.multihop), where the hierarchy can matter.

  Bridge chains of 1-4 links over long pages (no comparisons: a guesser's coin flip):
  `limits.max_len` holds a search and one page (the sub-agent's episode, or a single agent's
  on a one-page question) but not two pages, while the main agent's plan and short results
  take a fraction of it; so a single agent that visits pages overflows at its second one.
  Every variant has the same limits (algorithm.md 1.1: one context size for every agent
  episode); tests/envs/test_multihop.py checks both sides of the budget with the experts.
  Sizes: "gpu" (pages of 2.7-4.1k tokens of the byte+phrases+ids tokenizer, max_len 5120; one
  H100/H200, Qwen3-0.6B preset), "cpu" (the same shape at about 1/12: pages of 148-367
  tokens, max_len 672, tiny_wide; experiments/hierarchy_ablation), "smoke" (cpu's task, 2
  steps). Each max_len is the smallest tried (cpu: 576, 640, 672; gpu: 4096, 5120) at
  which the noise-free experts answer every question (all 2000 cpu, 8000 gpu) with no
  overflow while the single agent overflows on every question of two pages or more (cpu 640:
  1.6% of the sub-agent's episodes overflow).
  """
  # Held-out chains name entities that no training question or warm-start row shows. A
  # tokenizer with one id per name (byte+world) gives those names ids that training never
  # touched, which the model cannot write: the main + sub warm start scored 0 of 265
  # validation questions with it. byte+phrases+ids spells names and values in
  # bytes, as a tokenizer that never saw them splits them into pieces, so copying a held-out
  # name is the skill that training names teach. Doc ids, the tools' opaque handles, keep
  # one id each: every world of a size has the same ids, and the warm start's other worlds
  # (configs/sft.py) train them all, and pages are a little shorter. (Neither spelled in
  # bytes nor with one id each has the tiny CPU sub-agent learnt to copy the right hit's id
  # yet: experiments/hierarchy_ablation/README.md.) A real checkpoint reads its
  # own tokenizer's ids (pages then count its tokens: check the budget with policy=expert,
  # as tests/envs/test_multihop.py does).
  c.tokenizer = c.main_model.hf_path or "byte+phrases+ids"
  # Reading must be required. Binary comparisons (a coin flip for a guesser) are
  # removed; answers have at least 20 possible values (24 countries and rivers; no settlement
  # sizes, media or occupations); held-out questions are whole chains of held-out entities
  # (validation and test parts, 15% each); look-alike names among search hits shown in an order
  # drawn from the query (search_k >= 2), so choosing the hit is the sub-agent's job. The
  # guesser (envs.multihop.no_tool_guesser) scores at most 10% on the test split
  # (experiments/hierarchy_ablation/results/hierarchy-instrument-cpu.json).
  c.world.update(kind="multihop", compare_fraction=0.0, hop_weights=(1.0, 2.0, 2.0, 2.0),
                 distractors_per_doc=2, visit_chars=100_000,  # Pages are shown whole.
                 num_countries=24, num_rivers=24, min_answer_space=20, holdout=(0.15, 0.15),
                 name_similarity=0.5, shuffle_hits=True)
  if size == "gpu":
    c.world.update(num_people=400, num_orgs=200, num_places=200, num_works=200,
                   filler_sentences=(40, 56), num_questions=8000, search_k=3)
    c.limits.update(max_turns=12, max_new_tokens=256, max_len=5120, max_delegations=6)
    c.num_queries, c.num_rollouts, c.align_d = 8, 8, 4
    c.num_steps, c.eval_every, c.num_eval_questions, c.checkpoint_every = 200, 20, 512, 20
    if full_context:
      c.limits.max_len = FULL_CONTEXT_LEN[size]
    return
  c.world.update(num_people=80, num_orgs=40, num_places=40, num_works=40,
                 filler_sentences=(1, 2), num_questions=2000, search_k=2,
                 system_prompt=False)
  c.limits.update(max_turns=10, max_new_tokens=32, max_len=672, max_delegations=6)
  # Packed updates in micro-batches of 1024 tokens: on 2 CPU cores a warm-start step took
  # 0.59 s instead of 1.47 s as one padded batch (2048: 0.72 s, 8192: 1.28 s; the same losses;
  # experiments/hierarchy_ablation/results/hierarchy-probe-cpu.json, measured with max_len
  # 320). A micro-batch holds at least one row of max_len (the full-context control's).
  for mc in (c.main_model, c.sub_model):
    mc.max_tokens_per_micro = max(1024, FULL_CONTEXT_LEN[size] if full_context else 0)
  # D = 3: the experts delegate 2.75 times per question on average (1-4 pages).
  c.num_queries, c.num_rollouts, c.align_d = 8, 8, 3
  c.main_optim.learning_rate = c.sub_optim.learning_rate = 2e-4
  # RL on generated worlds no warm start read, asking one- and two-page questions; the
  # evaluation asks every chain length of the task's held-out split. Chosen on the
  # validation split (experiments/hierarchy_ablation/README.md): RL on the training split
  # learnt its own questions and nothing else; on unread worlds of every chain length the
  # rollouts found too few right answers (1-3%); on their short chains (8-11% right) M-GRPO
  # went from 9.1% to 18.5%, 14.3% and 15.1% of the validation questions in three seeds
  # (frozen_sub: to 9.1%, 7.5% and 9.1%).
  c.rl_worlds, c.rl_hop_weights = 1000, (1.0, 1.0, 0.0, 0.0)
  # Evaluations answer every test question (286 at this size; the sweep's power analysis).
  c.num_steps, c.eval_every, c.num_eval_questions, c.checkpoint_every = 90, 30, 1000, 10
  if size == "smoke":
    c.num_queries, c.num_rollouts = 2, 4
    c.num_steps, c.eval_every, c.num_eval_questions, c.checkpoint_every = 2, 1, 16, 1
  if full_context:
    c.limits.max_len = FULL_CONTEXT_LEN[size]


def _qa(c, size: str):
  """Real multi-hop QA (mgrpo_jax/envs/qa.py): the user's questions, corpus and checkpoint.

  `config.data` names the data; `retrieval` keeps only how to search (BM25's k1 and b, the
  index directory, the server's timeout): the corpus is `data.corpus`. Hits per search and
  characters per visit stay `world.search_k` and `world.visit_chars`. The limits fit the
  experts' traces: a main episode delegates each hop (MuSiQue has 2-4) and answers; a
  sub-agent searches, visits up to search_k hits and reports. Sizes: "gpu" and "cpu" share
  the task (5 hits, pages cut at 1500 characters: 99% of MuSiQue's supporting paragraphs are
  shorter); "cpu" holds a sub-agent's five pages in bytes (max_len 8192); "smoke" (tiny
  model, byte tokenizer) reads 2 hits of 400 characters, for the CPU suite.
  """
  c.data = ml_collections.ConfigDict(dict(
      format="musique",  # "musique" | "hotpotqa" | "jsonl" (questions and answers only).
      # jsonl: the file's keys for each record's id, question and answer (a string or a list
      # of accepted answers; an absent id is "<file>-<index>").
      fields=ml_collections.ConfigDict(dict(id="id", question="question", answer="answer")),
      train="",  # Questions to train on (.json list or .jsonl); needed to train.
      eval="",  # Held-out questions evaluated (.json list or .jsonl).
      # "" = the data files' paragraphs, deduplicated by title and text; a path: an
      # {"id", "contents"} JSONL corpus (indexed with bm25s); http(s)://...: a Search-R1
      # /retrieve server. A "jsonl" dataset has no paragraphs: name a corpus.
      corpus="",
      # False: a bad record of the data or corpus (not UTF-8 or JSON, a missing field, an
      # empty answer, a duplicate id, a hop whose supporting paragraph the corpus lacks)
      # stops the program before the first step, listing them; True: they are left out.
      skip_invalid=False,
  ))
  c.world.update(search_k=5, visit_chars=1500, system_prompt=True)
  c.limits.update(max_turns=8, max_new_tokens=512, max_len=8192, max_delegations=6)
  c.align_d = 4  # MuSiQue asks 2-4 hops: the experts delegate 2.4 times per question.
  c.num_eval_questions = 500
  if size == "cpu":
    c.limits.update(max_new_tokens=96)
    c.num_queries, c.num_rollouts, c.align_d = 2, 4, 3
  if size == "smoke":
    c.world.update(search_k=2, visit_chars=400, system_prompt=False)
    c.limits.update(max_turns=5, max_new_tokens=24, max_len=2048, max_delegations=4)
    # 4 x 2 rollouts (8 rows: the suite's 8 CPU devices split them), as the world's smoke.
    c.num_queries, c.num_rollouts, c.align_d = 4, 2, 2
    c.num_steps, c.eval_every, c.num_eval_questions, c.checkpoint_every = 2, 2, 4, 2


def sweep():
  """The paper's comparison on CPU: 3 variants x 3 seeds, from the same warm start."""
  for variant in ("mgrpo", "frozen_sub", "single"):
    for seed in range(3):
      yield f"runlocal,variant={variant},seed={seed}"
