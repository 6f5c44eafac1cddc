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

import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from mgrpo_jax.compiled import step_cases  # noqa: E402
from mgrpo_jax import models  # noqa: E402

_LORA_RANK = 16


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


def all_cases() -> dict:
  # What every update compiles with (--remat_policy, --mu_dtype).
  policy = dict(remat_policy=_REMAT_POLICY.value, mu_dtype=_MU_DTYPE.value)
  update = functools.partial(step_cases.update_case, **policy)
  moe_mesh, decode = step_cases.MOE_MESH, step_cases.decode_case
  cases = {}
  for p in _PRESETS.value:
    devices = 8 if p == "qwen3_8b" else 1
    cases[f"update/{p}/main"] = lambda p=p, d=devices: update(p, 16, 32768, devices=d)
    cases[f"update/{p}/sub"] = lambda p=p, d=devices: update(p, 64, 8192, devices=d)
    cases[f"decode/{p}/reached=1024"] = lambda p=p: decode(p)
  for p in _MOE_PRESETS.value:
    cases[f"update/{p}/main"] = lambda p=p: update(
        p, 16, 32768, mesh_axes=moe_mesh, moe_chunk=_MOE_CHUNK.value)
    cases[f"update/{p}/sub"] = lambda p=p: update(
        p, 64, 8192, mesh_axes=moe_mesh, moe_chunk=_MOE_CHUNK.value)
    cases[f"decode/{p}/reached=1024"] = lambda p=p: decode(p, mesh_axes=moe_mesh)
  lora_preset = "qwen3_1p7b"
  for suffix, dtype in ((f"+lora{_LORA_RANK}", "float32"),
                        (f"+lora{_LORA_RANK}+bf16base", "bfloat16")):
    for role, rows, length in (("main", 16, 32768), ("sub", 64, 8192)):
      cases[f"update/{lora_preset}/{role}{suffix}"] = (
          lambda r=rows, n=length, d=dtype: update(lora_preset, r, n,
                                                   lora_rank=_LORA_RANK, base_dtype=d))
  for t in map(int, _SCALING_T.value):
    cases[f"scaling/T={t}"] = lambda t=t: step_cases.scaling_case(_SCALING_PRESET.value, t,
                                                                  **policy)
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
  # Flags only when run: gpu_compile.py has some of the same names, and tests load both.
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
  app.run(main)
