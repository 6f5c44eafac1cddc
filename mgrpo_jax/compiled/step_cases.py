"""The real update, decode and prefill steps compiled from abstract inputs, and their memory.

Used by `benchmarks/memory.py` (compiled for CPU) and `benchmarks/gpu_compile.py` (compiled
for a GPU topology, `compiled.gpu`): each case builds the jitted step that training or sampling
runs, lowers it with `jax.ShapeDtypeStruct` inputs (nothing is allocated) and reads
`compiled.memory_analysis()` per device.
"""

import contextlib
import functools
import time

import jax
import jax.numpy as jnp

from mgrpo_jax import kv_cache_plan, models, sampling, sharding
from mgrpo_jax.engine import slots as slots_lib
from mgrpo_jax.models import decode, lora, qwen3
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.rl.batch import Batch

GB = 1e9
# The paper's 64 GPUs for the MoE: eight nodes of eight, experts split within a node.
MOE_MESH = dict(data=1, fsdp=8, tensor=1, expert=8)
# Tokens per packed micro-batch per device: one 32k trace (main) or four 8k traces (sub).
TOKEN_BUDGET = 32768
LOGITS_CHUNK = 4096
ENGINE_NEW_TOKENS = 1024  # A turn's token buffer (the paper's max new tokens).


def model_config(preset: str, remat_policy: str = "nothing", **kw) -> models.Qwen3Config:
  """The real-scale policy: bf16 compute, f32 master weights, remat, blockwise attention."""
  kw = dict(param_dtype="float32", compute_dtype="bfloat16", remat=True,
            remat_policy=remat_policy, attention="blockwise") | kw
  return models.get_preset(preset, **kw)


def abstract(tree, shardings=None):
  """ShapeDtypeStructs of `tree`'s arrays (placed by `shardings`, a matching tree)."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def abstract_state(cfg, tx, mesh=None):
  """ShapeDtypeStructs of a TrainState (and its shardings with a mesh)."""
  state = jax.eval_shape(lambda k: ts.init_state(models.init_params(cfg, k), tx, k),
                         jax.random.key(0))
  if mesh is None:
    return abstract(state), None
  st_sh = ts.state_shardings(state, mesh)
  return abstract(state, st_sh), st_sh


def abstract_lora_state(cfg, tx):
  """ShapeDtypeStructs of a LoRA agent's TrainState (adapters only) and of its frozen base."""
  state = jax.eval_shape(lambda k: ts.init_state(lora.init_adapters(cfg, k), tx, k),
                         jax.random.key(0))
  return abstract(state), abstract(qwen3.abstract_params(lora.base_config(cfg)))


def memory_stats(compiled, seconds: float) -> dict:
  """A compiled step's memory per device in GB, and its compile time."""
  m = compiled.memory_analysis()
  args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
  alias = m.alias_size_in_bytes
  return {"arguments_gb": args / GB, "outputs_gb": out / GB, "temporaries_gb": temp / GB,
          "aliased_gb": alias / GB, "total_gb": (args + out - alias + temp) / GB,
          "compile_s": round(seconds, 1)}


def case_mesh(axes: dict, device_list=None):
  """A mesh of `axes` over the first devices of `device_list` (default: `jax.devices()`),
  and its number of devices."""
  devices = 1
  for size in axes.values():
    devices *= size
  device_list = jax.devices() if device_list is None else device_list
  return sharding.make_mesh(axes, devices=device_list[:devices]), devices


def _decode_inputs(cfg, rows: int, capacity: int, mesh=None):
  """The sampler's abstract weights (per layer, compute dtype, as `sampling.decode_params`
  makes them) and KV cache of `capacity` slots, sharded over `mesh` when given."""
  stacked = qwen3.abstract_params(cfg)
  params = jax.eval_shape(functools.partial(sampling.decode_params, cfg), stacked)
  cache = jax.eval_shape(lambda: sampling.init_cache(cfg, rows, capacity))
  if mesh is not None:
    params = abstract(params, decode.shardings(cfg, sharding.param_shardings(stacked, mesh)))
    cache = abstract(cache, decode.cache_shardings(
        cfg, sharding.cache_sharding(mesh, cfg.num_kv_heads)))
  return params, cache


def update_case(preset: str, rows: int, length: int, *, devices: int = 1,
                mesh_axes: dict | None = None, moe_chunk: int = 0, lora_rank: int = 0,
                base_dtype: str = "float32", device_list=None, return_compiled: bool = False,
                logits_chunk: int = LOGITS_CHUNK, model_overrides: dict | None = None,
                remat_policy: str = "nothing", mu_dtype: str = "float32"):
  """The packed update of `rows` traces of `length` tokens (one trace per row).

  With `lora_rank`, a LoRA agent's update (single device): rank-`lora_rank` adapters on every
  projection, the frozen base in `base_dtype` passed beside the state.
  `device_list`: the devices to compile for (e.g. a GPU topology's, benchmarks/gpu_compile.py;
  default `jax.devices()`); given, even one device gets a mesh, as training on it does.
  `return_compiled`: returns (stats, the compiled step). `model_overrides`: Qwen3Config
  fields over `model_config`'s (e.g. another attention kernel). `remat_policy`, `mu_dtype`:
  what a remat'd layer keeps, and Adam's first-moment dtype.
  """
  cfg = model_config(preset, remat_policy, moe_chunk=moe_chunk, param_dtype=base_dtype,
                     **(model_overrides or {}))
  tx = ts.make_optimizer(learning_rate=1e-6, mu_dtype=mu_dtype)
  mesh, frozen = None, None
  if mesh_axes is None and (devices > 1 or device_list is not None):
    mesh_axes = dict(data=1, fsdp=devices, tensor=1)
  if mesh_axes is not None:
    mesh, devices = case_mesh(mesh_axes, device_list)
  if lora_rank:
    cfg = cfg.replace(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank,
                      lora_targets=models.config.LORA_TARGETS)
    (state, frozen), st_sh = abstract_lora_state(cfg, tx), None
  else:
    state, st_sh = abstract_state(cfg, tx, mesh)
  # Rows per micro-batch: the token budget per device, at least one row per device, and no
  # more rows than the batch has (rounded up to whole rows per device; the packer pads).
  per_micro = min(max(devices, TOKEN_BUDGET * devices // length), -(-rows // devices) * devices)
  shape = (max(1, rows // per_micro), per_micro, length)
  step = ts.make_train_step(cfg, ts.LossConfig(), tx, mesh=mesh, state_sharding=st_sh,
                            max_tokens_per_micro=TOKEN_BUDGET * devices,
                            logits_chunk=logits_chunk, frozen=frozen)
  rows_sh = None if mesh is None else jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, sharding.BATCH))
  tok = lambda dt: jax.ShapeDtypeStruct(shape, dt, sharding=rows_sh)
  # No `num_micro`: all M micro-batches run, a loop of known trip count that hlo_stats
  # multiplies out (kernels, collectives). Training's packed batches bring the count, the
  # same program with a traced bound; at M full both take the same memory (update/
  # qwen3_0p6b on XLA:GPU: 19.17 GB per GPU either way).
  batch = Batch(tokens=tok(jnp.int32), positions=tok(jnp.int32), segment_ids=tok(jnp.int32),
                adv=tok(jnp.float32), seq_tokens=tok(jnp.float32), loss_mask=tok(jnp.float32),
                old_logp=tok(jnp.float32), denominator=jax.ShapeDtypeStruct((), jnp.float32))
  t0 = time.perf_counter()
  compiled = step.jitted.lower(state, batch, frozen).compile()
  out = memory_stats(compiled, time.perf_counter() - t0)
  out.update(preset=preset, rows=rows, length=length, devices=devices,
             micro_batches=shape[0], rows_per_micro=shape[1], params=cfg.num_params())
  if mesh_axes is not None:
    out.update(mesh={k: v for k, v in mesh_axes.items() if v > 1})
  if cfg.is_moe:
    out.update(active_params=cfg.num_active_params(), moe_chunk=moe_chunk)
  gb = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / GB
  out["state_gb"] = gb(state)  # What the agent keeps between updates (its own part).
  if lora_rank:
    out.update(lora_rank=lora_rank, base_dtype=base_dtype, base_gb=gb(frozen),
               adapter_params=lora.num_adapter_params(cfg))
  return (out, compiled) if return_compiled else out


def scaling_case(preset: str, length: int, rows: int = 4, *, remat_policy: str = "nothing",
                 mu_dtype: str = "float32") -> dict:
  """The plain make_train_step (no packing) on one padded [rows, length] batch."""
  cfg = model_config(preset, remat_policy)
  tx = ts.make_optimizer(learning_rate=1e-6, mu_dtype=mu_dtype)
  state, _ = abstract_state(cfg, tx)
  step = ts.make_train_step(cfg, ts.LossConfig(), tx, logits_chunk=LOGITS_CHUNK)
  tok = lambda dt: jax.ShapeDtypeStruct((rows, length), dt)
  batch = Batch(tokens=tok(jnp.int32), loss_mask=tok(jnp.float32), old_logp=tok(jnp.float32),
                adv=jax.ShapeDtypeStruct((rows,), jnp.float32))
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  out = memory_stats(compiled, time.perf_counter() - t0)
  out.update(preset=preset, rows=rows, length=length)
  return out


def decode_case(preset: str, rows: int = 64, reached: int = 1024,
                max_len: int = 32768, mesh_axes: dict | None = None, *,
                param_dtype: str = "bfloat16", device_list=None, return_compiled: bool = False,
                model_overrides: dict | None = None):
  """The sampler's real decode loop (`sampling._decode_chunk`) for `rows` rows whose traces
  reached `reached` tokens, with `max_len` configured: the cache is what the sampler holds
  (`kv_cache_plan.cache_len`), not `max_len` slots per row. With `mesh_axes`, params, cache and
  rows are sharded by the rules of `mgrpo_jax.sharding` and the loop runs under the mesh.
  `param_dtype`: the weights the sampler decodes from (bf16 compute either way).
  `device_list`: the devices to compile for (default `jax.devices()`; given, even one device
  gets a mesh), with the compiler options the sampler sets on their platform.
  `return_compiled`: returns (stats, the compiled loop). `model_overrides`: Qwen3Config
  fields changed from the preset's (e.g. fewer layers)."""
  cfg = models.get_preset(preset, param_dtype=param_dtype, compute_dtype="bfloat16",
                          **(model_overrides or {}))
  capacity = kv_cache_plan.cache_len(reached, max_len)
  s = jax.ShapeDtypeStruct
  mesh = None
  if mesh_axes is None and device_list is not None:
    mesh_axes = dict(data=1, fsdp=1, tensor=1)
  if mesh_axes is not None:
    mesh, _ = case_mesh(mesh_axes, device_list)
  params, cache = _decode_inputs(cfg, rows, capacity, mesh)
  row = lambda shape, dt: s(shape, dt, sharding=None if mesh is None else
                            sharding.batch_sharding(mesh, len(shape)))
  routes = jax.eval_shape(lambda: sampling.init_routes(cfg, rows, capacity))
  seqs = sampling.Sequences(cache, row((rows,), jnp.int32),
                            row((rows, cfg.vocab_size), jnp.float32), max_len,
                            None if routes is None else row(routes.shape, routes.dtype))
  ints, floats = row((rows, 64), jnp.int32), row((rows, 64), jnp.float32)
  state = sampling.LoopState(seqs, ints, floats, floats, *[row((rows,), jnp.int32)] * 4)
  sp = sampling.SamplingParams(s((), jnp.float32), s((), jnp.float32), s((), jnp.int32),
                                s((8,), jnp.int32))
  key = jax.eval_shape(lambda: jax.random.key(0))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    backend = jax.default_backend() if device_list is None else device_list[0].platform
    compiled = sampling.decode_jit(backend).lower(
        cfg, params, state, sp, s((), jnp.int32), key, capacity).compile()
  out = memory_stats(compiled, time.perf_counter() - t0)
  if mesh_axes is not None:
    out.update(mesh={k: v for k, v in mesh_axes.items() if v > 1},
               params_gb_all_devices=cfg.num_params() * 2 / GB)
  out.update(preset=preset, rows=rows, reached=reached, max_len=max_len, cache_len=capacity,
             kv_cache_gb=kv_cache_plan.kv_cache_bytes(cfg, rows, capacity) / GB,
             kv_cache_at_max_len_gb=kv_cache_plan.kv_cache_bytes(cfg, rows, max_len) / GB)
  return (out, compiled) if return_compiled else out


def prefill_case(preset: str, rows: int, length: int, *, device_list=None,
                 return_compiled: bool = False, model_overrides: dict | None = None):
  """The sampler's prefill (`sampling.prefill_rows`) of `rows` prompts of `length` tokens, from
  bf16 weights, on a one-device mesh over `device_list[0]` (default `jax.devices()`).
  `return_compiled`: returns (stats, the compiled prefill). `model_overrides`: Qwen3Config
  fields changed from the preset's (e.g. fewer layers)."""
  cfg = models.get_preset(preset, param_dtype="bfloat16", compute_dtype="bfloat16",
                          **(model_overrides or {}))
  mesh, _ = case_mesh(dict(data=1, fsdp=1, tensor=1), device_list)
  capacity = kv_cache_plan.cache_len(length + 1, 32768)
  params, cache = _decode_inputs(cfg, rows, capacity, mesh)
  row = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32,
                                           sharding=sharding.batch_sharding(mesh, len(shape)))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = sampling.prefill_rows.lower(
        cfg, params, row((rows, length)), row((rows,)), row((rows,)), cache,
        sampling.attention_window(length, capacity), None).compile()
  out = memory_stats(compiled, time.perf_counter() - t0)
  out.update(preset=preset, rows=rows, length=length, cache_len=capacity)
  return (out, compiled) if return_compiled else out


def _engine_inputs(cfg, num_slots: int, capacity: int, max_len: int, device=None, pool=None):
  """A lane's abstract weights (`sampling.decode_params`' per-layer bf16 copies) and its
  `num_slots` Slots of `capacity` positions (`engine.slots.init`), on `device` if given;
  `pool` = (rows, positions[, members]): with a pool of shared prompts (`engine.slots.Pool`)."""
  params = jax.eval_shape(functools.partial(sampling.decode_params, cfg),
                          qwen3.abstract_params(cfg))

  def init():
    p = None if pool is None else slots_lib.init_pool(cfg, num_slots, *pool)
    return slots_lib.init(cfg, num_slots, capacity, max_new_tokens=ENGINE_NEW_TOKENS,
                          max_len=max_len, pool=p)

  slots = jax.eval_shape(init)
  if device is None:
    return abstract(params), abstract(slots)
  on = lambda tree: abstract(tree, jax.tree.map(
      lambda _: jax.sharding.SingleDeviceSharding(device), tree))
  return on(params), on(slots)


def _scalar(dtype, device=None):
  return jax.ShapeDtypeStruct((), dtype, sharding=None if device is None else
                              jax.sharding.SingleDeviceSharding(device))


def engine_decode_case(presets=("qwen3_8b",), slots: int = 64, reached: int = 8192,
                       capacity: int = 8192, max_len: int = 32768, *, attention: str = "auto",
                       device_list=None, return_compiled: bool = False,
                       model_overrides: dict | None = None, pool: tuple | None = None):
  """The engine's decode call (`engine.slots.decode_jit`): one model per preset of
  `presets` (e.g. a main and a sub-agent) stepping together, each with `slots` slots of
  `capacity` cached positions from bf16 weights, every slot's row at `reached` tokens (the
  attention window: `sampling.attention_window(reached)`, what the lane asks for). On
  `device_list[0]` (default `jax.devices()[0]`) with the compiler options the engine sets
  on its platform. `return_compiled`: returns (stats, the compiled call, its models as
  `hlo_stats.step_stats` takes them). `model_overrides`: Qwen3Config fields over the
  presets' (e.g. fewer layers). `pool` = (rows, positions[, members per row]): each model's
  slots also read a pool of shared prompts that long (`engine.slots.Pool`), every row read
  whole."""
  device = None if device_list is None else device_list[0]
  window = sampling.attention_window(reached, capacity)
  cfgs, params, lanes, models_ = [], [], [], []
  for preset in presets:
    cfg = models.get_preset(preset, param_dtype="bfloat16", compute_dtype="bfloat16",
                            attention=attention, **(model_overrides or {}))
    p, st = _engine_inputs(cfg, slots, capacity, max_len, device, pool)
    cfgs.append(cfg), params.append(p), lanes.append(st)
    # What a step attends over: every slot's window (the ragged kernel: each row's own
    # length, here `reached` for every row), and the pool's rows.
    kv = kv_cache_plan.kv_cache_bytes(cfg, slots, window)
    if pool is not None:
      kv += kv_cache_plan.kv_cache_bytes(cfg, *pool[:2])
    models_.append((cfg, p, st.cache, kv))
  f32, i32 = _scalar(jnp.float32, device), _scalar(jnp.int32, device)
  sp = sampling.SamplingParams(f32, f32, i32, jax.ShapeDtypeStruct(
      (sampling.MAX_STOP_IDS,), jnp.int32, sharding=i32.sharding))
  backend = jax.default_backend() if device is None else device.platform
  t0 = time.perf_counter()
  compiled = slots_lib.decode_jit(backend).lower(
      tuple(cfgs), tuple(params), tuple(lanes), (sp,) * len(cfgs), i32,
      (window,) * len(cfgs)).compile()
  out = memory_stats(compiled, time.perf_counter() - t0)
  out.update(presets=list(presets), slots=slots, reached=reached, window=window,
             capacity=capacity, attention=attention,
             params_gb=sum(c.num_params() * 2 for c in cfgs) / GB,
             kv_cache_gb=sum(kv_cache_plan.kv_cache_bytes(c, slots, capacity)
                             for c in cfgs) / GB)
  return (out, compiled, models_) if return_compiled else out


def engine_prefill_case(preset: str = "qwen3_8b", units: int = 8, width: int = 512,
                        slots: int = 64, capacity: int = 8192, window: int = 8192, *,
                        attention: str = "auto", device_list=None,
                        return_compiled: bool = False, model_overrides: dict | None = None):
  """The engine's prefill (`engine.slots.prefill`) of `units` chunks of `width` tokens into
  as many of `slots` slots of `capacity` positions, attending over their first `window`
  positions; on `device_list[0]` (default `jax.devices()[0]`). `return_compiled`: returns
  (stats, the compiled prefill)."""
  device = None if device_list is None else device_list[0]
  cfg = models.get_preset(preset, param_dtype="bfloat16", compute_dtype="bfloat16",
                          attention=attention, **(model_overrides or {}))
  params, st = _engine_inputs(cfg, slots, capacity, capacity, device)
  sh = None if device is None else jax.sharding.SingleDeviceSharding(device)
  ints = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)
  t0 = time.perf_counter()
  compiled = slots_lib.prefill.lower(cfg, params, st, ints((units, width)), ints((units,)),
                                     ints((units,)), window).compile()
  out = memory_stats(compiled, time.perf_counter() - t0)
  out.update(preset=preset, units=units, width=width, slots=slots, capacity=capacity,
             window=window, attention=attention,
             # The units' rows the prefill reads into a batch of its own, once (attention
             # then reads that copy): the bytes of that copy, one way.
             rows_copy_gb=kv_cache_plan.kv_cache_bytes(cfg, units, window) / GB,
             kv_cache_gb=kv_cache_plan.kv_cache_bytes(cfg, slots, capacity) / GB)
  return (out, compiled) if return_compiled else out
