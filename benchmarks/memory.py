"""Memory of the real update and decode steps at the paper's shapes, proved on CPU.

Each case lowers and compiles the jitted step that training runs, with abstract inputs
(`jax.ShapeDtypeStruct`: nothing is allocated) and reads `compiled.memory_analysis()`:
arguments, outputs, temporaries and their total per device. No GPU or weights needed.

  python benchmarks/memory.py               # every case -> benchmarks/results/memory-cpu.json
  python benchmarks/memory.py --cases=scaling --out=/tmp/m.json
  python benchmarks/memory.py --list

Cases (bf16 compute, f32 master weights and Adam moments, cuDNN-free blockwise attention,
chunked log-probs, remat, packed token-budget micro-batches):
  update/<preset>/main   16 x 32768 tokens (the main agent's Q x K traces)
  update/<preset>/sub    64 x 8192 tokens (Q x K x D sub-agent traces)
  update/qwen3_8b/*      the same with the state sharded over 8 devices (fsdp=8)
  update/qwen3_30b_a3b/* the MoE on 64 devices (fsdp=8 x expert=8; the paper's 64 GPUs), one
                         trace per device per micro-batch, experts dispatched moe_chunk
                         tokens per device at a time
  decode/qwen3_30b_a3b/reached=1024  its decode loop on the same mesh, 64 rows (1 per device)
  update/qwen3_1p7b/{main,sub}+lora16[+bf16base]  a LoRA agent (rank 16 on every projection,
                         float32 adapters and moments) over a frozen float32 (or bf16) base
  pair/qwen3_1p7b/{full,lora16,lora16+bf16base}  a colocated main + sub pair on one device:
                         both states (LoRA: one shared base, two adapter states) plus the
                         larger update's temporaries, from the update cases above
  decode/<preset>/reached=1024  the sampler's decode loop for 64 rows whose traces reached
                         1024 tokens with max_len=32768 (the cache is sized by need)
  scaling/T=<n>          the plain (unpacked) make_train_step on 4 x n padded rows, remat,
                         n = 2048 ... 32768: temporaries must grow linearly
"""

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # 64 fake CPU devices for the sharded cases; must precede the first JAX import.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=64").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from mgrpo_jax import kv_cache_plan, models, sampling, sharding  # noqa: E402
from mgrpo_jax.models import decode, lora, qwen3  # noqa: E402
from mgrpo_jax.rl import train_step as ts  # noqa: E402
from mgrpo_jax.rl.batch import Batch  # noqa: E402

_CASES = flags.DEFINE_list("cases", ["update", "decode", "scaling"],
                           "Case name prefixes to run (update, decode, scaling, or full names).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/memory-cpu.json", "Where to write JSON.")
_LIST = flags.DEFINE_bool("list", False, "List the cases and exit.")
_PRESETS = flags.DEFINE_list("presets", ["qwen3_0p6b", "qwen3_1p7b", "qwen3_8b"],
                             "Model presets of the update/decode cases.")
_SCALING_T = flags.DEFINE_list("scaling_t", ["2048", "4096", "8192", "16384", "32768"],
                               "Sequence lengths of the scaling cases.")
_SCALING_PRESET = flags.DEFINE_string("scaling_preset", "qwen3_0p6b", "Preset of scaling cases.")
_MOE_PRESETS = flags.DEFINE_list("moe_presets", ["qwen3_30b_a3b"],
                                 "MoE presets of the 64-device update/decode cases.")
_MOE_CHUNK = flags.DEFINE_integer("moe_chunk", 512, "Tokens per device per expert dispatch.")
_REMAT_POLICY = flags.DEFINE_enum("remat_policy", "nothing", models.config.REMAT_POLICIES,
                                  "What a remat'd layer keeps (Qwen3Config.remat_policy).")
_MU_DTYPE = flags.DEFINE_enum("mu_dtype", "float32", ["float32", "bfloat16"],
                              "Adam's first-moment dtype (configs/common.optimizer).")

GB = 1e9
# What every case compiles with; `main` sets them from --remat_policy and --mu_dtype.
POLICY = dict(remat_policy="nothing", mu_dtype="float32")
_MOE_MESH = dict(data=1, fsdp=8, tensor=1, expert=8)
# Tokens per packed micro-batch per device: one 32k trace (main) or four 8k traces (sub).
_BUDGET = 32768
_LOGITS_CHUNK = 4096
_LORA_RANK = 16


def model_config(preset: str, **kw) -> models.Qwen3Config:
  """The real-scale policy: bf16 compute, f32 master weights, remat, blockwise attention."""
  kw = dict(param_dtype="float32", compute_dtype="bfloat16", remat=True,
            remat_policy=POLICY["remat_policy"], attention="blockwise") | kw
  return models.get_preset(preset, **kw)


def _abstract(tree, shardings=None):
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def abstract_state(cfg, tx, mesh=None):
  """ShapeDtypeStructs of a TrainState (and its shardings with a mesh)."""
  state = jax.eval_shape(lambda k: ts.init_state(models.init_params(cfg, k), tx, k),
                         jax.random.key(0))
  if mesh is None:
    return _abstract(state), None
  st_sh = ts.state_shardings(state, mesh)
  return _abstract(state, st_sh), st_sh


def _stats(compiled, seconds: float) -> dict:
  m = compiled.memory_analysis()
  args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
  alias = m.alias_size_in_bytes
  return {"arguments_gb": args / GB, "outputs_gb": out / GB, "temporaries_gb": temp / GB,
          "aliased_gb": alias / GB, "total_gb": (args + out - alias + temp) / GB,
          "compile_s": round(seconds, 1)}


def _mesh(axes: dict, device_list=None):
  """A mesh of `axes` over the first devices of `device_list` (default: `jax.devices()`)."""
  devices = 1
  for size in axes.values():
    devices *= size
  device_list = jax.devices() if device_list is None else device_list
  return sharding.make_mesh(axes, devices=device_list[:devices]), devices


def abstract_lora_state(cfg, tx):
  """ShapeDtypeStructs of a LoRA agent's TrainState (adapters only) and of its frozen base."""
  state = jax.eval_shape(lambda k: ts.init_state(lora.init_adapters(cfg, k), tx, k),
                         jax.random.key(0))
  return _abstract(state), _abstract(qwen3.abstract_params(lora.base_config(cfg)))


def update_case(preset: str, rows: int, length: int, *, devices: int = 1,
                mesh_axes: dict | None = None, moe_chunk: int = 0, lora_rank: int = 0,
                base_dtype: str = "float32", device_list=None, return_compiled: bool = False,
                logits_chunk: int = _LOGITS_CHUNK, model_overrides: dict | None = None):
  """The packed update of `rows` traces of `length` tokens (one trace per row).

  With `lora_rank`, a LoRA agent's update (single device): rank-`lora_rank` adapters on every
  projection, the frozen base in `base_dtype` passed beside the state.
  `device_list`: the devices to compile for (e.g. a GPU topology's, benchmarks/gpu_compile.py;
  default `jax.devices()`); given, even one device gets a mesh, as training on it does.
  `return_compiled`: returns (stats, the compiled step). `model_overrides`: Qwen3Config
  fields over `model_config`'s (e.g. another attention kernel).
  """
  cfg = model_config(preset, moe_chunk=moe_chunk, param_dtype=base_dtype,
                     **(model_overrides or {}))
  tx = ts.make_optimizer(learning_rate=1e-6, mu_dtype=POLICY["mu_dtype"])
  mesh, frozen = None, None
  if mesh_axes is None and (devices > 1 or device_list is not None):
    mesh_axes = dict(data=1, fsdp=devices, tensor=1)
  if mesh_axes is not None:
    mesh, devices = _mesh(mesh_axes, device_list)
  if lora_rank:
    cfg = cfg.replace(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank,
                      lora_targets=models.config.LORA_TARGETS)
    (state, frozen), st_sh = abstract_lora_state(cfg, tx), None
  else:
    state, st_sh = abstract_state(cfg, tx, mesh)
  # Rows per micro-batch: the token budget per device, at least one row per device, and no
  # more rows than the batch has (rounded up to whole rows per device; the packer pads).
  per_micro = min(max(devices, _BUDGET * devices // length), -(-rows // devices) * devices)
  shape = (max(1, rows // per_micro), per_micro, length)
  step = ts.make_train_step(cfg, ts.LossConfig(), tx, mesh=mesh, state_sharding=st_sh,
                            max_tokens_per_micro=_BUDGET * devices, logits_chunk=logits_chunk,
                            frozen=frozen)
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
  out = _stats(compiled, time.perf_counter() - t0)
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


def pair_case(results: dict, preset: str, suffix: str = "") -> dict:
  """A colocated main + sub pair on one device, from the two agents' update cases.

  Both agents' states stay resident; one update runs at a time, so the larger update's
  temporaries (and gradients: outputs beyond the donated state) come on top. LoRA agents
  on one checkpoint share its base (trainable.build_agent's `bases`): it counts once.
  """
  main, sub = (results[f"update/{preset}/{r}{suffix}"] for r in ("main", "sub"))
  resident = main["state_gb"] + sub["state_gb"] + main.get("base_gb", 0.0)
  peak = max(r["temporaries_gb"] + r["outputs_gb"] - r["aliased_gb"] for r in (main, sub))
  return {"preset": preset, "resident_gb": resident, "update_extra_gb": peak,
          "total_gb": resident + peak, "from": [f"update/{preset}/main{suffix}",
                                                f"update/{preset}/sub{suffix}"]}


def scaling_case(preset: str, length: int, rows: int = 4) -> dict:
  """The plain make_train_step (no packing) on one padded [rows, length] batch."""
  cfg = model_config(preset)
  tx = ts.make_optimizer(learning_rate=1e-6, mu_dtype=POLICY["mu_dtype"])
  state, _ = abstract_state(cfg, tx)
  step = ts.make_train_step(cfg, ts.LossConfig(), tx, logits_chunk=_LOGITS_CHUNK)
  tok = lambda dt: jax.ShapeDtypeStruct((rows, length), dt)
  batch = Batch(tokens=tok(jnp.int32), loss_mask=tok(jnp.float32), old_logp=tok(jnp.float32),
                adv=jax.ShapeDtypeStruct((rows,), jnp.float32))
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  out = _stats(compiled, time.perf_counter() - t0)
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
  cache = jax.eval_shape(lambda: sampling.init_cache(cfg, rows, capacity))
  stacked = qwen3.abstract_params(cfg)
  # The sampler's own weights (per layer, compute dtype), as `sampling.decode_params` makes them.
  params = jax.eval_shape(functools.partial(sampling.decode_params, cfg), stacked)
  mesh = None
  if mesh_axes is None and device_list is not None:
    mesh_axes = dict(data=1, fsdp=1, tensor=1)
  if mesh_axes is not None:
    mesh, _ = _mesh(mesh_axes, device_list)
    params = _abstract(params, decode.shardings(cfg, sharding.param_shardings(stacked, mesh)))
    cache = _abstract(cache, decode.cache_shardings(
        cfg, sharding.cache_sharding(mesh, cfg.num_kv_heads)))
  row = lambda shape, dt: s(shape, dt, sharding=None if mesh is None else
                            sharding.batch_sharding(mesh, len(shape)))
  routes = jax.eval_shape(lambda: sampling.init_routes(cfg, rows, capacity))
  seqs = sampling.Sequences(cache, row((rows,), jnp.int32),
                            row((rows, cfg.vocab_size), jnp.float32), max_len,
                            None if routes is None else row(routes.shape, routes.dtype))
  ints, floats = row((rows, 64), jnp.int32), row((rows, 64), jnp.float32)
  state = sampling._LoopState(seqs, ints, floats, floats, *[row((rows,), jnp.int32)] * 4)
  sp = sampling._SamplingParams(s((), jnp.float32), s((), jnp.float32), s((), jnp.int32),
                                s((8,), jnp.int32))
  key = jax.eval_shape(lambda: jax.random.key(0))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    backend = jax.default_backend() if device_list is None else device_list[0].platform
    compiled = sampling.decode_jit(backend).lower(
        cfg, params, state, sp, s((), jnp.int32), key, capacity).compile()
  out = _stats(compiled, time.perf_counter() - t0)
  if mesh_axes is not None:
    out.update(mesh={k: v for k, v in mesh_axes.items() if v > 1},
               params_gb_all_devices=cfg.num_params() * 2 / GB)
  out.update(preset=preset, rows=rows, reached=reached, max_len=max_len, cache_len=capacity,
             kv_cache_gb=kv_cache_plan.kv_cache_bytes(cfg, rows, capacity) / GB,
             kv_cache_at_max_len_gb=kv_cache_plan.kv_cache_bytes(cfg, rows, max_len) / GB)
  return (out, compiled) if return_compiled else out


def all_cases() -> dict:
  cases = {}
  for p in _PRESETS.value:
    devices = 8 if p == "qwen3_8b" else 1
    cases[f"update/{p}/main"] = lambda p=p, d=devices: update_case(p, 16, 32768, devices=d)
    cases[f"update/{p}/sub"] = lambda p=p, d=devices: update_case(p, 64, 8192, devices=d)
    cases[f"decode/{p}/reached=1024"] = lambda p=p: decode_case(p)
  for p in _MOE_PRESETS.value:
    cases[f"update/{p}/main"] = lambda p=p: update_case(
        p, 16, 32768, mesh_axes=_MOE_MESH, moe_chunk=_MOE_CHUNK.value)
    cases[f"update/{p}/sub"] = lambda p=p: update_case(
        p, 64, 8192, mesh_axes=_MOE_MESH, moe_chunk=_MOE_CHUNK.value)
    cases[f"decode/{p}/reached=1024"] = lambda p=p: decode_case(p, mesh_axes=_MOE_MESH)
  lora_preset = "qwen3_1p7b"
  for suffix, dtype in ((f"+lora{_LORA_RANK}", "float32"),
                        (f"+lora{_LORA_RANK}+bf16base", "bfloat16")):
    for role, rows, length in (("main", 16, 32768), ("sub", 64, 8192)):
      cases[f"update/{lora_preset}/{role}{suffix}"] = (
          lambda r=rows, n=length, d=dtype: update_case(lora_preset, r, n,
                                                        lora_rank=_LORA_RANK, base_dtype=d))
  for t in map(int, _SCALING_T.value):
    cases[f"scaling/T={t}"] = lambda t=t: scaling_case(_SCALING_PRESET.value, t)
  return cases


def _add_pairs(results: dict) -> None:
  """The pair entries whose two update cases (with their state sizes) are in `results`."""
  for suffix, name in (("", "full"), (f"+lora{_LORA_RANK}", f"lora{_LORA_RANK}"),
                       (f"+lora{_LORA_RANK}+bf16base", f"lora{_LORA_RANK}+bf16base")):
    try:
      results[f"pair/qwen3_1p7b/{name}"] = pair_case(results, "qwen3_1p7b", suffix)
    except KeyError:  # Not run yet (or run before the cases recorded state_gb).
      pass


def main(argv):
  del argv
  cases = all_cases()
  if _LIST.value:
    print("\n".join(cases))
    return
  chosen = [n for n in cases if any(n == c or n.startswith(c + "/") or n.startswith(c)
                                    for c in _CASES.value)]
  if not chosen:
    sys.exit(f"--cases={','.join(_CASES.value)} matches none of: {', '.join(cases)}")
  results = {}
  if os.path.exists(_OUT.value):
    with open(_OUT.value) as f:
      results = json.load(f).get("cases", {})
  POLICY.update(remat_policy=_REMAT_POLICY.value, mu_dtype=_MU_DTYPE.value)
  # Cases under a non-default policy are recorded beside the default ones.
  suffix = "".join(f"+{v}" for v, default in ((_REMAT_POLICY.value, "nothing"),
                                              (f"mu_{_MU_DTYPE.value}", "mu_float32"))
                   if v != default)
  for name in chosen:
    print(f"{name}{suffix} ...", flush=True)
    r = results[name + suffix] = cases[name]()
    r["command"] = "python benchmarks/memory.py " + " ".join(sys.argv[1:])
    print(f"  total {r['total_gb']:.2f} GB (arguments {r['arguments_gb']:.2f}, temporaries "
          f"{r['temporaries_gb']:.2f}), compiled in {r['compile_s']} s", flush=True)
    _add_pairs(results)
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"device": "cpu (compiled memory analysis; per device)",
                 "note": "XLA:CPU keeps float32 copies of bf16 weights (no bf16 matmul), so "
                         "bf16 cases overstate what a GPU needs",
                 "jax": jax.__version__, "cases": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
