"""Trainable agents from config: the model, objective, optimizer and jitted update of each.

Shared by M-GRPO (colocated and decoupled), SFT, MAGRPO and evaluation. Agents come from
`fold_in(key(seed), 0)` (by the caller); a warm start's weights from `<init>/hf/<agent>`.
"""

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from mgrpo_jax import hf_tokenizer, models, tokenizer_io
from mgrpo_jax import tokenizer as tk
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.config_checks import ConfigValueError
from mgrpo_jax.models import lora
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import train_step as ts


@dataclasses.dataclass
class Agent:
  """One trainable policy: its model, objective, optimizer and jitted update.

  A LoRA agent (`model_config.lora_rank > 0`) trains, optimises and checkpoints only its
  adapters (`state.params`); its base parameters are `frozen`.
  """

  name: str
  model_config: models.Qwen3Config
  loss_config: ts.LossConfig
  state: ts.TrainState
  step_fn: Any
  nonfinite: str
  frozen: Any = None
  base_path: str = ""  # The HF checkpoint the base came from ("" for a random preset).
  mesh: Any = None  # The mesh its state lives on (its MoE sampler runs under it too).
  max_staleness: int = 0  # Versions its rows may lag the policy being updated.

  @property
  def params(self):
    """The parameters its model runs with (a LoRA agent's base and adapters, uncopied)."""
    return self.state.params if self.frozen is None else lora.join(self.frozen, self.state.params)


def loss_config(lc, temperature: float, *, max_staleness: int = 0,
                staleness_tis_cap: float = 2.0) -> ts.LossConfig:
  """The train step's objective from a config's loss section.

  With `max_staleness` >= 1 rows may come from an older policy than the one updated: the
  objective is then the decoupled clipped surrogate, each token weighted by
  min(pi_old / pi_behaviour, C) (the truncated-IS terms), with C = the section's own
  `tis_cap` when set, else `staleness_tis_cap`. Chosen here, once, for the whole run.
  """
  tis_cap = lc.tis_cap
  if max_staleness >= 1:
    if lc.kind != "clipped":
      raise ConfigValueError(
          f"config.max_staleness={max_staleness} trains on rows sampled by older policies, "
          f"which needs the clipped surrogate's behaviour log-probs; loss kind={lc.kind!r} "
          "has none: use kind='clipped' or max_staleness=0.")
    if not staleness_tis_cap > 0:
      raise ConfigValueError(f"config.staleness_tis_cap={staleness_tis_cap!r}; expected > 0 "
                             "(the truncated importance weight's cap).")
    tis_cap = tis_cap or staleness_tis_cap
  return ts.LossConfig(kind=lc.kind, eps_low=lc.eps_low, eps_high=lc.eps_high,
                       dual_clip=lc.dual_clip or None, agg=lc.agg, kl_coef=lc.kl_coef,
                       kl_estimator=lc.kl_estimator, temperature=temperature,
                       tis_cap=tis_cap)


def nll_objective(lc, oc, *, learning_rate: float, weight_decay: float):
  """Loss and optimizer sections for supervised training (every warm start uses these).

  The token-mean NLL is the REINFORCE objective with advantage 1, so SFT reuses the RL
  train step; rows then carry advantage 1 and the behaviour log-probs are unused.
  """
  lc = ml_collections.ConfigDict(dict(lc.to_dict(), kind="reinforce", agg="token-mean",
                                      tis_cap=0.0))
  oc = ml_collections.ConfigDict(dict(oc.to_dict(), learning_rate=learning_rate,
                                      weight_decay=weight_decay))
  return lc, oc


def _runtime(mc) -> dict:
  """The model config's runtime fields (how it computes, not what it is)."""
  return dict(remat=mc.remat, remat_policy=mc.remat_policy, attention=mc.attention,
              attention_block=mc.attention_block, decode_splits=mc.decode_splits,
              router_aux_loss_coef=mc.router_aux_loss_coef, moe_chunk=mc.moe_chunk,
              routing_replay=mc.routing_replay)


def lora_fields(mc, where: str) -> dict:
  """The Qwen3Config LoRA fields of a model section's `lora` block (rank 0: full training)."""
  lc = mc.lora
  targets = (lc.targets,) if isinstance(lc.targets, str) else tuple(lc.targets)
  bad = sorted(set(targets) - set(lora.LORA_TARGETS))
  if bad or (lc.rank and not targets):
    raise ConfigValueError(f"config.{where}.lora.targets={targets!r}; expected names from "
                           f"{lora.LORA_TARGETS}.")
  if not isinstance(lc.rank, int) or lc.rank < 0 or (lc.rank and not lc.alpha > 0):
    raise ConfigValueError(f"config.{where}.lora: rank={lc.rank!r} must be an int >= 0 and "
                           f"alpha={lc.alpha!r} > 0.")
  if not lc.rank:
    return {}
  return dict(lora_rank=lc.rank, lora_alpha=float(lc.alpha), lora_targets=targets)


def logits_chunk_tokens(megabytes: int, vocab_size: int) -> int:
  """Tokens per log-prob chunk so that its float32 logits take about `megabytes`."""
  if megabytes < 1:
    raise ConfigValueError(f"config.*_model.logits_chunk_mb={megabytes} must be >= 1.")
  return max(1, megabytes * 2**20 // (4 * vocab_size))


def _model_params(mc, tokenizer, key, mesh, init_dir: str, name: str, bases=None):
  """Parameters from a warm start's final weights, an HF checkpoint, or a random preset.

  `bases` ({(path, dtypes): (config, params)}) lets LoRA agents on the same checkpoint
  share one frozen copy of it.
  """
  path = os.path.join(init_dir, "hf", name) if init_dir else mc.hf_path
  if path:
    cache_key = (os.path.abspath(path), mc.param_dtype, mc.compute_dtype)
    if bases is None or cache_key not in bases:
      cfg, params = models.load_hf(path, mesh=mesh, dtype=jnp.dtype(mc.param_dtype),
                                   compute_dtype=jnp.dtype(mc.compute_dtype))
      _check_vocabulary(path, cfg.vocab_size, tokenizer)
      if bases is not None:
        bases[cache_key] = cfg, params
    cfg, params = bases[cache_key] if bases is not None else (cfg, params)
    return cfg.replace(**_runtime(mc)), params
  vocab = tokenizer.vocab_size if mc.vocab_size == -1 else mc.vocab_size
  models.check_vocab_size(vocab, tokenizer.vocab_size, f"config.{name}_model.vocab_size")
  cfg = models.get_preset(mc.preset, vocab_size=vocab, param_dtype=mc.param_dtype,
                          compute_dtype=mc.compute_dtype, **_runtime(mc))
  return cfg, models.init_params(cfg, key, mesh=mesh)


def _check_vocabulary(path: str, vocab_size: int, tokenizer: tk.Tokenizer) -> None:
  """Refuses a checkpoint made with another tokenizer (its ids would mean other strings)."""
  if vocab_size < tokenizer.vocab_size:
    raise ValueError(f"{path}: the checkpoint has {vocab_size} token ids but "
                     f"{tokenizer_io.describe(tokenizer)} has more; they do not belong together "
                     f"(config.tokenizer names another tokenizer than the checkpoint's, or "
                     f"config.world changed since the warm start).")
  own = (hf_tokenizer.has_tokenizer_files(path)
         and not isinstance(tokenizer, hf_tokenizer.HFTokenizer))
  if own:  # Fits, but the model never saw these ids: the user asked for it, so only a warning.
    logging.warning("%s has its own tokenizer, but this run feeds it %s (config.tokenizer=''"
                    " would use the checkpoint's).", path, tokenizer_io.describe(tokenizer))
  words_file = os.path.join(path, workdir_lib.WORDS_FILE)
  if os.path.exists(words_file):
    with open(words_file) as f:
      saved = tuple(json.load(f)["words"])
    if saved != tuple(getattr(tokenizer, "words", ())):
      raise ValueError(f"{words_file}: the checkpoint was trained with other tokenizer words "
                       f"than this run's tokenizer has (config.tokenizer, config.world or "
                       f"config.protocol changed?): rerun the warm start.")


def build_agent(name, mc, oc, lc, tokenizer, mesh, key, *, init_dir="", num_micro=1,
                temperature=1.0, bases=None, max_staleness=0,
                staleness_tis_cap=2.0) -> Agent:
  """An agent with its state placed on `mesh` and its train step jitted once.

  `mc`, `oc`, `lc`: the config's model, optimizer and loss sections; `init_dir`: a run
  whose final weights (`<init_dir>/hf/<name>`) start this one. With `mc.lora.rank > 0` the
  loaded (or random) weights are the frozen base and fresh adapters are trained; LoRA
  agents given the same `bases` dict share a checkpoint they both start from.
  `max_staleness`, `staleness_tis_cap`: the objective with lag (`loss_config`).
  """
  fields = lora_fields(mc, f"{name} agent's model")
  cfg, params = _model_params(mc, tokenizer, jax.random.fold_in(key, 0), mesh, init_dir, name,
                              bases if fields else None)
  frozen = None
  if fields:
    cfg, frozen = cfg.replace(**fields), params
    params = lora.init_adapters(cfg, jax.random.fold_in(key, 2), mesh=mesh)
  tx = ts.make_optimizer(learning_rate=oc.learning_rate, b1=oc.b1, b2=oc.b2, eps=oc.eps,
                         weight_decay=oc.weight_decay, grad_clip=oc.grad_clip,
                         mu_dtype=oc.mu_dtype)
  init = functools.partial(ts.init_state, tx=tx)
  # Built by a jit with the state's shardings: on many hosts a process-local key or step
  # cannot be device_put onto the global mesh, and the moments are born sharded.
  st_sh = ts.state_shardings(jax.eval_shape(init, params, key=jax.random.key(0)), mesh)
  state = jax.jit(init, out_shardings=st_sh)(params, key=jax.random.fold_in(key, 1))
  lcfg = loss_config(lc, temperature, max_staleness=max_staleness,
                     staleness_tis_cap=staleness_tis_cap)
  step_fn = ts.make_train_step(cfg, lcfg, tx, num_micro=num_micro, mesh=mesh,
                               state_sharding=st_sh,
                               max_tokens_per_micro=mc.max_tokens_per_micro or None,
                               logits_chunk=logits_chunk_tokens(mc.logits_chunk_mb,
                                                                cfg.vocab_size),
                               frozen=frozen)
  base_path = os.path.join(init_dir, "hf", name) if init_dir else mc.hf_path
  return Agent(name, cfg, lcfg, state, step_fn, lc.nonfinite, frozen, base_path, mesh,
               max_staleness)


def update_agents(agents: dict, batches: dict, step: int) -> dict:
  """Runs each named agent's update on its batch; returns `{agent}/{metric}` floats.

  Raises `NonFiniteError` (naming the step) for a non-finite loss unless the agent's
  policy is 'skip'. A batch whose rows record their behaviour versions also gets the
  agent's staleness histogram (`{agent}/staleness/...`): `step` is the updated policy's.
  """
  out = {}
  for name, batch in batches.items():
    agent = agents[name]
    agent.state, metrics = agent.step_fn(agent.state, batch)
    metrics = jax.device_get(metrics)
    ts.check_finite(metrics, step, agent=name, policy=agent.nonfinite)
    out.update({f"{name}/{k}": float(v) for k, v in metrics.items()})
    if batch.version is not None:
      lag = batch_lib.staleness_metrics(batch.version, step, agent.max_staleness)
      out.update({f"{name}/{k}": v for k, v in lag.items()})
  return out
