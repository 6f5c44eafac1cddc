"""One policy-gradient update as a pure, jitted function: `train_step(state, batch)`.

The same step trains every agent; what differs between the M-GRPO main agent, the
sub-agent, single-agent GRPO and MAGRPO is the batch and the `LossConfig`, both fixed
at setup: `make_train_step` picks the objective's terms function (`LOSS_TERMS`) once and
binds it, so the variants never become `if`s inside the compiled step.

The batch is an `rl.batch.Batch`: padded [B, T], or packed [M, R, L] micro-batches
(`rl.packing`, with segment ids, positions, per-token sequence lengths and the batch's loss
denominator).
"""

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mgrpo_jax import sharding as shard_lib
from mgrpo_jax.models import lora
from mgrpo_jax.models import moe
from mgrpo_jax.models import qwen3
from mgrpo_jax.models.config import Qwen3Config
from mgrpo_jax.rl import losses
from mgrpo_jax.rl import packing
from mgrpo_jax.rl.batch import Batch


@flax.struct.dataclass
class TrainState:
  """Everything an update changes. A pytree: checkpointable and donatable."""

  step: jax.Array
  params: nnx.State
  opt_state: Any
  key: jax.Array


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static choice of objective (algorithm.md 1.5, 2.1)."""

  kind: str = "clipped"  # "clipped" (M-GRPO, PPO-style) or "reinforce" (MAGRPO paper era)
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float | None = None
  agg: str = "seq-mean-token-mean"
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  # The sampler's temperature: behaviour log-probs are log-softmax(logits / T), so the
  # trainer must score tokens the same way or the ratio is off even on-policy.
  temperature: float = 1.0
  # Truncated importance sampling (clipped kind): C > 0 weights each token by
  # min(π_train_old / π_sampler, C); 0 = off (the sampler's log-probs are the ratio's).
  tis_cap: float = 0.0

  def __post_init__(self):
    if self.kind not in ("clipped", "reinforce"):
      raise ValueError(f"LossConfig.kind must be 'clipped' or 'reinforce', got {self.kind!r}.")
    if self.agg not in losses.AGGREGATIONS:
      raise ValueError(f"LossConfig.agg={self.agg!r}; expected one of {losses.AGGREGATIONS}.")
    if self.kl_estimator not in losses.KL_ESTIMATORS:
      raise ValueError(f"LossConfig.kl_estimator={self.kl_estimator!r}; expected one of "
                       f"{losses.KL_ESTIMATORS}.")
    if not self.temperature > 0:
      raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}.")
    if not self.tis_cap >= 0:
      raise ValueError(f"LossConfig.tis_cap must be >= 0 (0 = off), got {self.tis_cap}.")
    if self.tis_cap and self.kind != "clipped":
      raise ValueError(f"LossConfig.tis_cap={self.tis_cap} weights the clipped surrogate; "
                       f"kind={self.kind!r} has no behaviour log-probs to correct.")

  @property
  def terms(self) -> str:
    """The `LOSS_TERMS` entry of this objective."""
    return f"{self.kind}_tis" if self.tis_cap else self.kind


def make_optimizer(*, learning_rate: float = 1e-6, b1: float = 0.9, b2: float = 0.98,
                   eps: float = 1e-8, weight_decay: float = 0.1, grad_clip: float = 1.0,
                   max_consecutive_nonfinite: int = 1_000_000,
                   mu_dtype: str = "float32") -> optax.GradientTransformation:
  """AdamW with global-norm clipping (M-GRPO reference settings by default).

  `mu_dtype="bfloat16"` stores the first moment in bfloat16 (half its memory); the
  second moment, whose small values bfloat16's 8-bit mantissa would round, stays float32.

  Weight decay skips vectors (norm scales). Updates whose gradients are not finite
  are skipped (and counted in the optimizer state) so parameters never turn NaN;
  whether such a step is an error is the caller's policy (`check_finite`).
  """
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity(),
      optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                  mask=decay_mask, mu_dtype=jnp.dtype(mu_dtype)),
  )
  return optax.apply_if_finite(tx, max_consecutive_errors=max_consecutive_nonfinite)


def init_state(params: nnx.State, tx: optax.GradientTransformation, key) -> TrainState:
  """A fresh state at step 0."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    key=key)


def clipped_terms(loss_config: LossConfig, logp, mb: Batch, adv, mask, seq_tokens):
  """The clipped surrogate's (numerator, denominator, sums), with the optional KL term."""
  ref = mb.ref_logp
  return losses.loss_terms(
      logp, mb.old_logp[:, 1:], adv, mask, eps_low=loss_config.eps_low,
      eps_high=loss_config.eps_high, agg=loss_config.agg,
      ref_logp=None if ref is None else ref[:, 1:], kl_coef=loss_config.kl_coef,
      kl_estimator=loss_config.kl_estimator, dual_clip=loss_config.dual_clip,
      seq_tokens=seq_tokens)


def clipped_tis_terms(loss_config: LossConfig, logp, mb: Batch, adv, mask, seq_tokens):
  """The clipped surrogate with truncated importance sampling (`losses.tis_weights`).

  A step makes one optimizer update per batch, with the weights that sampled it, so
  stop_gradient(logp) is the trainer's own log-prob of each sampled token under the old
  policy, without a second forward pass. It replaces the sampler's as the ratio's
  denominator, and min(exp(old_logp_train − sampler_logp), C) weights each token's loss.
  """
  ref = mb.ref_logp
  return losses.loss_terms(
      logp, jax.lax.stop_gradient(logp), adv, mask, eps_low=loss_config.eps_low,
      eps_high=loss_config.eps_high, agg=loss_config.agg,
      ref_logp=None if ref is None else ref[:, 1:], kl_coef=loss_config.kl_coef,
      kl_estimator=loss_config.kl_estimator, dual_clip=loss_config.dual_clip,
      seq_tokens=seq_tokens, sampler_logp=mb.sampler_logp[:, 1:], tis_cap=loss_config.tis_cap)


def reinforce_terms(loss_config: LossConfig, logp, mb: Batch, adv, mask, seq_tokens):
  """REINFORCE's (numerator, denominator, sums): no ratio, no behaviour log-probs."""
  del mb
  return losses.reinforce_terms(logp, adv, mask, agg=loss_config.agg, seq_tokens=seq_tokens)


LOSS_TERMS = {"clipped": clipped_terms, "clipped_tis": clipped_tis_terms,
              "reinforce": reinforce_terms}  # By LossConfig.terms.


def _micro_terms(model_config: Qwen3Config, loss_config: LossConfig, terms, logits_chunk: int,
                 params, frozen, mb: Batch, aux_weight):
  """(numerator, metric sums) of one micro-batch; the denominator is batch-global.

  `params` are what is trained; with a frozen base (`frozen`, LoRA) they are its adapters.

  Position t of the batch describes token t, so the model reads tokens[:, :-1] and scores
  tokens[:, 1:]. A packed micro-batch (`segment_ids` present, see rl.packing) also brings
  its RoPE positions and each token's sequence length for per-sequence means.
  A MoE model with `router_aux_loss_coef > 0` adds its router's load-balancing loss,
  weighted by `aux_weight` (denominator / micro-batches: the step's loss gets the mean).
  With `routing_replay`, the inputs take the experts the sampler chose (`mb.experts`).
  """
  if frozen is not None:
    params = lora.join(frozen, params)
  tokens = mb.tokens
  inputs = tokens[:, :-1]
  packed = mb.segment_ids is not None  # Batch structure (static), not a config value.
  positions = (mb.positions[:, :-1] if packed
               else jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape))
  hidden, head, routing = qwen3.hidden_and_head(
      model_config, params, inputs, positions,
      segment_ids_BxT=mb.segment_ids[:, :-1] if packed else None, return_routing=True,
      experts_LxBxTxK=_replayed_routes(model_config, mb))
  # Scored in chunks: the [B, T, V] float32 logits never exist (PAPERS-scale vocabularies).
  logp, ent = losses.chunked_logprobs(hidden, head, tokens[:, 1:],
                                      temperature=loss_config.temperature, chunk=logits_chunk)
  mask = mb.loss_mask[:, 1:]
  adv = mb.adv if mb.adv.ndim == 1 else mb.adv[:, 1:]
  seq_tokens = mb.seq_tokens[:, 1:] if packed else None
  num, _, sums = terms(loss_config, logp, mb, adv, mask, seq_tokens)
  # Entropy of the (temperature-scaled) policy on generated tokens: cheap next to the
  # forward pass, and the first thing to look at when a run collapses.
  sums = dict(sums, entropy=jnp.sum(jnp.where(mask > 0, ent * mask, 0.0)))
  if mb.sampler_logp is not None:  # Batch structure (static): rows from the sampler.
    # Sampler vs trainer log-probs of the same tokens under the same weights: 0 but for
    # numerics (kernels, batch shapes, precision; MoE routing), every step.
    sums.update(losses.mismatch_sums(logp, mb.sampler_logp[:, 1:], mask))
  if model_config.router_aux_loss_coef > 0:  # A static (frozen config) choice.
    num = num + model_config.router_aux_loss_coef * routing.aux_loss * aux_weight
    sums["router_aux_loss_numerator"] = routing.aux_loss * aux_weight
  return num, sums


def _replayed_routes(model_config: Qwen3Config, mb: Batch):
  """The inputs' recorded routes [L, B, T-1, k] under `routing_replay` (static), else None."""
  if not model_config.routing_replay:
    return None
  if mb.experts is None:
    raise ValueError("Qwen3Config.routing_replay is on but the batch has no `experts`: its "
                     "rows must come from a MoE sampler that recorded routes (rl.batch).")
  # Batch position t is token t; the model reads tokens[:, :-1], so routes[:, :-1] too.
  return jnp.transpose(mb.experts[:, :-1], (2, 0, 1, 3)).astype(jnp.int32)


def _routes_for_replay(model_config: Qwen3Config, batch: Batch) -> Batch:
  """Host side, under `routing_replay`: a batch with no loss token and no routes (every row
  padding: e.g. a sub-agent that was never called) gets zero routes, so that it compiles
  like the others; one with loss tokens but no routes is refused."""
  if not model_config.routing_replay or batch.experts is not None:
    return batch
  if np.any(np.asarray(batch.loss_mask) > 0):
    _replayed_routes(model_config, batch)  # Raises, naming the missing field.
  shape = (*np.shape(batch.tokens), sum(model_config.sparse_layers()),
           model_config.num_experts_per_tok)
  return batch.replace(experts=np.zeros(shape, moe.route_dtype(model_config.num_experts)))


def _micro_batches(batch: Batch, num_micro: int, agg: str):
  """(micro-batches with a leading [M] axis, batch-global loss denominator, how many of
  the M to run: a traced scalar for a packed batch, whose M is padded, else M)."""
  if batch.segment_ids is not None:
    # Packed (rl.packing): already [M, R, L]; the packer counted the denominator and the
    # real micro-batches (a batch built without it runs all M).
    count = batch.tokens.shape[0] if batch.num_micro is None else batch.num_micro
    return batch.replace(denominator=None, num_micro=None), batch.denominator, count
  b = batch.tokens.shape[0]
  if b % num_micro:
    raise ValueError(f"Batch of {b} rows does not split into {num_micro} micro-batches.")
  mask = batch.loss_mask[:, 1:]
  _, denominator = losses.aggregate_terms(jnp.zeros(mask.shape), mask, agg=agg)
  micro = jax.tree.map(lambda x: x.reshape(num_micro, b // num_micro, *x.shape[1:]), batch)
  return micro, denominator, num_micro


def _identity_sums(sums_shape: dict) -> dict:
  """The metric sums of no micro-batch: what `accumulate_metric_sums` starts from."""
  def first(key, x):
    fill = -jnp.inf if key.endswith("_max") else jnp.inf if key.endswith("_min") else 0
    return jnp.full(x.shape, fill, x.dtype)
  return {k: first(k, v) for k, v in sums_shape.items()}


def train_step(state: TrainState, batch: Batch, frozen=None, *,
               model_config: Qwen3Config, loss_config: LossConfig,
               tx: optax.GradientTransformation, num_micro: int = 1,
               logits_chunk: int = 4096, param_sharding=None, terms):
  """One optimizer step over `batch`, accumulating gradients over micro-batches.

  A padded batch [B, T] is split into `num_micro` slices of rows; a packed batch
  (rl.packing.pack) comes as [M, R, L] micro-batches already, of which the first
  `batch.num_micro` are run (a loop with a traced trip count: M is a bucket, so batches of
  different sizes share one compiled step). Accumulation is exact:
  per-micro-batch loss numerators are differentiated and summed, then divided once by
  the batch-global denominator (token or sequence count), so the update equals the
  full-batch update for every aggregation mode, packed or not.

  `param_sharding` (with a mesh) pins each micro-batch's gradients and their running sum
  to the parameters' shards: reduce-scattered, never a full replicated copy per device.
  `terms` is the objective, chosen at setup (`make_train_step` binds
  `LOSS_TERMS[loss_config.terms]`). `frozen`: the base parameters of a LoRA agent, whose
  `state.params` are then only its adapters (gradients and moments exist only for those).
  """
  micro, denominator, count = _micro_batches(batch, num_micro, loss_config.agg)
  grad_fn = jax.grad(functools.partial(_micro_terms, model_config, loss_config, terms,
                                       logits_chunk), has_aux=True)
  pin = ((lambda tree: jax.lax.with_sharding_constraint(tree, param_sharding))
         if param_sharding is not None else (lambda tree: tree))

  aux_weight = denominator / count
  at = lambda i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False),
                              micro)

  def body(i, carry):
    grad_acc, sums_acc = carry
    grads, sums = grad_fn(state.params, frozen, at(i), aux_weight)
    # Per-micro-batch sums combined by the one metric reducer.
    return (pin(jax.tree.map(jnp.add, grad_acc, pin(grads))),
            losses.accumulate_metric_sums(sums_acc, sums))

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  _, sums_shape = jax.eval_shape(grad_fn, state.params, frozen, at(0), aux_weight)
  grad_sum, sums = jax.lax.fori_loop(0, count, body, (zeros, _identity_sums(sums_shape)))
  scale = jnp.where(denominator > 0, 1.0 / jnp.maximum(denominator, 1e-30), 0.0)
  grads = jax.tree.map(lambda g: g * scale, grad_sum)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = losses.finalize_metrics(sums, denominator)
  metrics["loss"] = metrics.pop("pg_loss") + (
      loss_config.kl_coef * metrics["kl_ref"] if "kl_ref" in metrics else 0.0) + (
      model_config.router_aux_loss_coef * metrics["router_aux_loss"]
      if "router_aux_loss" in metrics else 0.0)
  metrics["grad_norm"] = optax.tree.norm(grads)
  metrics["finite"] = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def state_shardings(state: TrainState, mesh):
  """Shardings of a TrainState: params and their optimizer moments by the param rules."""
  param_sh = shard_lib.param_shardings(state.params, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def opt_leaf(path, leaf):
    # Adam moments mirror the params' paths (…/mu/layers/attn/q); scalars replicate.
    keys = shard_lib.path_str(path)
    if getattr(leaf, "ndim", 0) == 0:
      return replicated
    for name in ("mu/", "nu/"):
      if name in keys:
        return jax.sharding.NamedSharding(
            mesh, shard_lib.param_spec(keys.split(name, 1)[1], leaf.shape, mesh))
    return replicated

  opt_sh = jax.tree_util.tree_map_with_path(opt_leaf, state.opt_state)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, key=replicated)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """`make_train_step`'s update: `step(state, batch) -> (state, metrics)`.

  `jitted(state, batch, frozen)` is the compiled step (state donated); `prepare` turns the
  caller's host batch into what it takes (packed, placed on the mesh); `frozen` is a LoRA
  agent's base, passed on every call, never donated nor copied.
  """

  jitted: Any
  prepare: Callable[[Batch], Batch]
  frozen: Any = None

  def __call__(self, state: TrainState, batch: Batch):
    if not isinstance(batch, Batch):
      raise TypeError(f"A train step takes an rl.batch.Batch, got {type(batch).__name__}.")
    # Row versions are host bookkeeping (staleness metrics): the compiled step never sees them.
    return self.jitted(state, self.prepare(batch.replace(version=None)), self.frozen)

  def lower(self, state, batch):
    """The compiled step lowered for (abstract) `state` and a prepared `batch`."""
    return self.jitted.lower(state, batch, self.frozen)


def make_train_step(model_config: Qwen3Config, loss_config: LossConfig,
                    tx: optax.GradientTransformation, *, num_micro: int = 1, mesh=None,
                    state_sharding=None, max_tokens_per_micro: int | None = None,
                    logits_chunk: int = 4096, frozen=None, dedupe_rows: bool = True
                    ) -> TrainStep:
  """`train_step` with its static pieces bound, jitted once, state donated.

  With a mesh, the state keeps `state_sharding` (default: `state_shardings` of the
  state's structure is needed, so pass it) and every batch array is split over
  (data, fsdp) on its row axis.

  With `max_tokens_per_micro`, the step takes the same padded numpy batch, packs it on
  the host (`rl.packing.pack`: [M, R, L] with R * L <= the budget) and runs the packed
  step; `num_micro` is then ignored. Identical rows (M-GRPO's aligned sub-agent rows repeat
  calls) are then packed once with their count as a weight (`dedupe_rows`; not with a router
  aux loss, which is a function of the tokens each micro-batch routes): same loss, less work.

  With `frozen` (a LoRA agent's base parameters; the state then holds its adapters) the
  jitted step takes the base as a third argument: callers still call `step(state, batch)`.
  """
  if mesh is not None and state_sharding is None:
    raise ValueError("make_train_step(mesh=...) needs state_sharding=state_shardings(...).")
  step = functools.partial(train_step, model_config=model_config, loss_config=loss_config,
                           tx=tx, num_micro=num_micro, logits_chunk=logits_chunk,
                           param_sharding=None if mesh is None else state_sharding.params,
                           terms=LOSS_TERMS[loss_config.terms])
  if mesh is not None:
    unmeshed = step

    def step(state, batch, frozen=None):
      # The model pins activations to the batch axes of the mesh in scope (FSDP layout).
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return unmeshed(state, batch, frozen)
  if max_tokens_per_micro is not None and max_tokens_per_micro < 8:
    raise ValueError(f"max_tokens_per_micro must be >= 8, got {max_tokens_per_micro}.")
  if mesh is None:
    jitted = jax.jit(step, donate_argnames=("state",))
    place, rows_multiple = (lambda b: b), 1
  else:
    P = jax.sharding.PartitionSpec
    replicated = jax.sharding.NamedSharding(mesh, P())
    frozen_sh = None if frozen is None else shard_lib.param_shardings(frozen, mesh)
    rows_multiple = int(np.prod([mesh.shape[a] for a in shard_lib.BATCH]))
    # Padded leaves are [B, T], packed ones [M, R, L]: rows split over the batch axes, the
    # packed scalar denominator replicated.
    rows_sh = jax.sharding.NamedSharding(
        mesh, P(shard_lib.BATCH) if max_tokens_per_micro is None else P(None, shard_lib.BATCH))
    jitted = jax.jit(step, donate_argnames=("state",),
                     in_shardings=(state_sharding, None, frozen_sh),
                     out_shardings=(state_sharding, replicated))

    def place(batch):
      # Host batches are placed first: jit refuses numpy inputs with a sharding that spans
      # other processes' devices; device_put takes the (identical) batch on every process
      # and keeps each one's own rows.
      return jax.tree.map(lambda v: jax.device_put(v, replicated if np.ndim(v) == 0
                                                   else rows_sh), batch)

  if max_tokens_per_micro is None:
    prepare = lambda batch: place(_routes_for_replay(model_config, batch))
  else:
    # cuDNN's packed attention describes at most this many sequences per row.
    max_segments = (model_config.attention_max_segments
                    if model_config.attention == "cudnn_packed" else 0)
    dedupe = dedupe_rows and not model_config.router_aux_loss_coef

    def prepare(batch):
      batch = _routes_for_replay(model_config, batch)
      return place(Batch(**packing.pack(batch.as_dict(),
                                        max_tokens_per_micro=max_tokens_per_micro,
                                        agg=loss_config.agg, rows_multiple=rows_multiple,
                                        max_segments=max_segments, dedupe=dedupe)))
  return TrainStep(jitted, prepare, frozen)


class NonFiniteError(FloatingPointError):
  """A loss or gradient was NaN/inf."""


def check_finite(metrics: dict, step: int, *, agent: str = "", policy: str = "raise") -> bool:
  """Host-side check of fetched metrics; raises (policy 'raise') naming the step.

  With policy 'skip', returns False for a skipped step (the optimizer already left
  the parameters untouched) so the caller can count it.
  """
  if bool(metrics["finite"]):
    return True
  if policy == "raise":
    who = f" for agent {agent!r}" if agent else ""
    raise NonFiniteError(f"Non-finite loss ({float(metrics['loss'])}) or gradient norm "
                         f"({float(metrics['grad_norm'])}) at step {step}{who}; the update "
                         "was not applied.")
  return False
