"""Shared config pieces (ml-collections). Every field the code reads is declared here."""

import ml_collections


def model(preset: str = "tiny") -> ml_collections.ConfigDict:
  """One agent's model: a named preset or a local HF checkpoint directory."""
  return ml_collections.ConfigDict(dict(
      preset=preset,  # mgrpo_jax.models.PRESETS name; ignored when hf_path is set.
      hf_path="",  # Local HF Qwen3 directory (config.json + safetensors) to start from.
      vocab_size=-1,  # -1: the tokenizer's vocabulary size (presets only).
      param_dtype="float32",  # Master weights.
      compute_dtype="float32",  # Activations / matmuls ("bfloat16" on GPU).
      remat=False,  # Recompute layers in the backward pass,
      remat_policy="nothing",  # keeping nothing, or "save_dots": the weight matmuls' outputs.
      # Attention kernel: "auto" (cuDNN on GPU for padded batches, else the einsum reference
      # for small [T, T], else blockwise), "cudnn", "cudnn_packed" (cuDNN for packed updates
      # too; GPU, not yet checked on one), "blockwise" or "reference".
      attention="auto",
      attention_block=512,  # Tokens per tile of the blockwise kernel.
      decode_splits=0,  # > 1: decode attention reads the cache in this many chunks at once.
      # Update memory: > 0 packs the batch's episodes into rows under this many tokens per
      # micro-batch (rl/packing.py; num_micro is then unused); 0 keeps one padded batch.
      max_tokens_per_micro=0,
      # MB of float32 logits scored at a time (tokens per chunk = this / (4 * vocab)): 2048 is
      # ~3500 tokens of Qwen3's 151,936-word vocabulary; a tiny vocabulary is one chunk.
      logits_chunk_mb=2048,
      # Mixture of experts (qwen3_30b_a3b, qwen3_235b_a22b, tiny_moe, or a Qwen3-MoE hf_path):
      # weight of the router's load-balancing loss in the RL loss (0: off; transformers
      # trains with 0.001), and tokens per device routed through the experts at a time (0: all;
      # bounds the dispatch buffers, which hold tokens x top-k x mesh.expert rows).
      router_aux_loss_coef=0.0,
      moe_chunk=0,
      # Routing replay: the update routes each token to the experts the sampler chose for
      # it (recorded per token by the sampler) instead of re-routing (MoE only).
      routing_replay=False,
      # LoRA (mgrpo_jax/models/lora.py): rank > 0 freezes the weights and trains rank-`rank`
      # adapters, scaled by alpha / rank, on `targets` (HF/PEFT names); 0 trains every weight.
      lora=ml_collections.ConfigDict(dict(
          rank=0, alpha=16.0,
          targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"))),
  ))


def limits() -> ml_collections.ConfigDict:
  """Episode limits (algorithm.md 1.1: 20 turns, 1024 new tokens per turn, 32k context)."""
  return ml_collections.ConfigDict(dict(
      max_turns=20, max_new_tokens=1024, max_len=32_768, max_delegations=20))


def sampling() -> ml_collections.ConfigDict:
  """Rollout sampling (the trainer scores tokens at the same temperature)."""
  return ml_collections.ConfigDict(dict(
      temperature=1.0, top_p=1.0, top_k=0, chunk=64,
      # Decode slots per model in the agent engine (engine/lanes.py); 0: one per episode that
      # can run at once up to 64, at most what kv_cache_budget_bytes holds at full context.
      slots=0,
      # A prompt several episodes start from (the rollouts of a question) is prefilled once
      # and its KV held once, in a row its episodes' slots attend to (engine/lanes.py).
      share_prompts=False,
      # Bytes of KV cache the sampler may hold at once (0: no limit).
      kv_cache_budget_bytes=0))


def optimizer(lr: float = 1e-6) -> ml_collections.ConfigDict:
  """Adam(W) as in the M-GRPO reference: constant lr, wd 0.1, betas (0.9, 0.98), clip 1.0."""
  return ml_collections.ConfigDict(dict(
      learning_rate=lr, b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.1, grad_clip=1.0,
      # Adam's first moment in "bfloat16" halves its memory (optax's mu_dtype); the second
      # moment stays float32.
      mu_dtype="float32"))


def loss() -> ml_collections.ConfigDict:
  """Clipped surrogate (algorithm.md 1.5)."""
  return ml_collections.ConfigDict(dict(
      kind="clipped",  # "clipped" or "reinforce".
      eps_low=0.2, eps_high=0.28,
      dual_clip=0.0,  # 0: off; else c > 1.
      agg="seq-mean-token-mean",  # "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum".
      kl_coef=0.0,  # KL to the initial policy (the reference: off).
      kl_estimator="k3",  # "k1" | "k2" | "k3".
      nonfinite="raise",  # "raise" or "skip" a step whose loss/gradient is not finite.
      # Truncated importance sampling: > 0 weights each token by min(pi_train / pi_sampler, C)
      # with C = tis_cap (clipped kind; corrects sampler/trainer numerics); 0 = off.
      tis_cap=0.0,
  ))


def world(seed: int = 0) -> ml_collections.ConfigDict:
  """The offline research world and its question sets (mgrpo_jax.envs.world)."""
  return ml_collections.ConfigDict(dict(
      seed=seed, num_people=24, num_orgs=12, num_places=12, num_works=12, num_countries=4,
      num_rivers=5, distractors_per_doc=2, name_similarity=0.0,
      # (low, high) filler sentences per document (envs.world.FILLER): long pages.
      filler_sentences=(0, 0),
      # "chains": envs.world.make_questions (link chains); "multihop": envs.multihop (chains
      # and comparisons of two entities; hop_weights then weigh questions by pages needed).
      kind="chains",
      compare_fraction=0.0,  # multihop: share of comparisons among 2- and 4-page questions.
      num_questions=400,  # Generated, then split.
      hop_weights=(1.0, 1.0, 1.0),  # Relative frequency of 1-, 2-, 3-hop questions.
      test_fraction=0.25,
      # (validation, test) fractions of each kind's entities held out as parts of the world
      # whose links stay inside them (envs.world.split_by_part): questions are split by whole
      # chains and the warm start's corpus holds only training pages. (0, 0): the split by
      # first entity at test_fraction (envs.world.split_questions), and no validation split.
      holdout=(0.0, 0.0),
      min_answer_space=0,  # multihop: skip chains whose answer has fewer possible values.
      search_k=3,  # Hits per search.
      shuffle_hits=False,  # Hits in an order drawn from the query, not by score (envs.search).
      visit_chars=800,  # Characters of a visited document.
      system_prompt=True,  # Tiny models trained on short traces may drop it.
  ))


def retrieval() -> ml_collections.ConfigDict:
  """What the search and visit tools search (mgrpo_jax.envs.retrieval.make_retriever)."""
  return ml_collections.ConfigDict(dict(
      backend="bm25s",  # "bm25s" (local index) | "http" (a Search-R1 retriever server).
      # bm25s: a JSONL corpus of {"id", "contents"} lines (title on the first line of
      # contents); "" = the generated world, indexed in memory.
      corpus="",
      index_dir="",  # Where the corpus's index is saved; "" = beside it, <corpus>.bm25s.
      k1=1.2, b=0.75,  # BM25 parameters.
      url="",  # http: the server's endpoint, e.g. http://127.0.0.1:8000/retrieve.
      # http: seconds per request; a failed one is retried within config.tools.outage_s.
      timeout_s=30.0,
  ))


def tools() -> ml_collections.ConfigDict:
  """Tool health (mgrpo_jax/envs/tool_health.py): when a failing service stops the run."""
  return ml_collections.ConfigDict(dict(
      # Seconds a tool call retries a service's transient failures (5xx, resets, timeouts,
      # malformed answers) before the service counts as down and the run stops.
      outage_s=300.0,
      # Fraction (0-1) of a service's requests in one step that may fail (retried or not)
      # before the run stops; judged once a step has made 20 requests.
      max_error_rate=0.5,
  ))


def log_sinks() -> dict:
  """Where a run's metrics go (mgrpo_jax.metrics.open_writer): top-level fields."""
  return dict(
      # Comma-separated sinks: "jsonl" (workdir/metrics.jsonl, always), "tensorboard"
      # (workdir/tb/), "wandb" (Weights & Biases: pip install -e ".[wandb]").
      log_to="jsonl,tensorboard",
      # The W&B project, run name ("": W&B picks one) and entity ("": the user's default).
      wandb=ml_collections.ConfigDict(dict(project="mgrpo_jax", name="", entity="")),
  )


def mesh() -> ml_collections.ConfigDict:
  """Device mesh (mgrpo_jax.sharding); one size may be -1 (= the rest)."""
  # expert: mixture-of-experts models split their experts over it (elsewhere it is data).
  return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1))


def parse_args(arg: str | None, defaults: dict) -> dict:
  """Parses 'a=1,b=x,flag' (a bare name means True) into typed values by `defaults`."""
  out = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    name, _, value = item.partition("=")
    if name not in defaults:
      raise ValueError(f"Unknown config argument {name!r}; known: {', '.join(sorted(defaults))}.")
    kind = type(defaults[name])
    if kind is bool:
      value = value.lower() in ("", "1", "true", "yes")
    out[name] = kind(value) if value != "" or kind is bool else value
  return out
