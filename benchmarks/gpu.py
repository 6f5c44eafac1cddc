"""GPU speed: decode and prefill against the HBM roofline, the update step against peak MFU.

  python benchmarks/gpu.py                  # on a GPU: every case -> results/gpu-<device>.json
  python benchmarks/gpu.py --cases=decode --models=qwen3_0p6b --batches=1,64
  python benchmarks/gpu.py --tiny --out=/tmp/g.json   # the same code at tiny shapes, any backend

Cases (bf16 weights and compute, random weights, greedy decoding with no stop token so every
row runs all its tokens):
  decode/<model>/b<rows>   `sampling.generate` of --new_tokens after a --prompt_len prompt,
                           minus its prefill: ms per step, and the share of the HBM roofline
                           (weights plus the KV cache reached, read once per step, at the
                           device's bandwidth). Variants on --variant_batches: without the
                           project's decode compiler options (`xla_options.decode`), and with
                           flash-decoding (`decode_splits`).
  prefill/<model>/b<rows>  the sampler's prefill of the same prompts: tokens/s and MFU.
  update/<model>/<tokens>  the packed update step (`make_train_step`, remat, blockwise
                           attention, chunked log-probs) on --update_tokens tokens per step in
                           rows of --update_seq: MFU (model FLOPs, attention included, against
                           the device's bf16 peak), per remat policy. f32 master weights and
                           Adam moments; a case whose compiled memory exceeds the device's is
                           recorded as skipped, with the memory it needs.

Each timed case runs once to compile and then --repeats times; the median counts. A case that
fails is recorded with its error and the others go on; cases stop once --budget_s is spent.
Without a GPU (and without --tiny) it says so and exits 0.
"""

import json
import os
import platform
import re
import statistics
import sys
import time
import traceback

import jax
import numpy as np
from absl import app, flags

from mgrpo_jax import metrics, models, sampling, xla_options
from mgrpo_jax.rl import packing
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.rl.batch import Batch

# Per device kind: HBM bytes/s and dense bf16 FLOP/s (vendor datasheets; SXM parts).
SPECS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12), "A100": (2.039e12, 312e12)}


def device_specs(kind: str) -> dict | None:
  """{"hbm_bytes_per_s", "bf16_flops_per_s"} of a device kind, or None when unknown."""
  for name, (bw, peak) in SPECS.items():
    if name in kind:
      return {"hbm_bytes_per_s": bw, "bf16_flops_per_s": peak}
  return None


def matmul_params(cfg: models.Qwen3Config) -> int:
  """Weights that multiply every token (every projection and the head; not the lookup)."""
  d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  per_layer = d * h * dh * 2 + d * k * dh * 2 + 3 * d * cfg.intermediate_size
  return cfg.num_layers * per_layer + d * cfg.vocab_size


def forward_flops_per_token(cfg: models.Qwen3Config, keys_seen: float) -> float:
  """Model FLOPs of one token's forward: 2 per matmul weight, plus attention's q.k and p.v
  over the `keys_seen` keys it attends to (dense models)."""
  return 2 * matmul_params(cfg) + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys_seen


def train_flops(cfg: models.Qwen3Config, tokens: int, seq: int) -> float:
  """Model FLOPs of an update on `tokens` tokens in causal sequences of `seq` (forward and a
  backward of twice its cost; remat's recomputation is not model FLOPs)."""
  return 3 * tokens * forward_flops_per_token(cfg, (seq + 1) / 2)


def decode_bytes_per_step(cfg: models.Qwen3Config, rows: int, mean_len: float,
                          itemsize: int = 2) -> float:
  """Bytes one decode step must read: every weight once, and the keys and values of the
  positions each row has reached."""
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
  return cfg.num_params() * itemsize + rows * mean_len * kv


def _timed(fn, repeats: int) -> tuple[float, float]:
  """(seconds of the first, compiling call; median seconds of `repeats` more)."""
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times)


def _block(tree):
  jax.block_until_ready(tree)
  return tree


def _prompts(cfg, rows: int, length: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return rng.integers(1, cfg.vocab_size, (rows, length)).tolist()


def decode_case(preset: str, rows: int, specs, *, options: bool = True, splits: int = 0) -> dict:
  cfg = _model(preset, decode_splits=splits)
  params = models.init_params(cfg, jax.random.key(0))
  prompts, n, p = _prompts(cfg, rows, _PROMPT.value), _NEW.value, _PROMPT.value
  max_len = p + n + 1
  jitted = sampling.decode_jit(jax.default_backend(), options=options)
  original = sampling.decode_jit
  if not options:  # The sampler looks its loop up by backend: hand it the bare one.
    sampling.decode_jit = lambda *a, **k: jitted
  try:
    gen = lambda: sampling.generate(cfg, params, prompts, max_new_tokens=n, temperature=0.0,
                                    max_len=max_len)
    pre = lambda: _block(sampling.prefill(cfg, params, prompts, max_len=max_len).lengths_B)
    compile_s, total = _timed(gen, _REPEATS.value)
    _, prefill = _timed(pre, _REPEATS.value)
  finally:
    sampling.decode_jit = original
  res = gen()
  if not (res.lengths == n).all():
    raise RuntimeError(f"rows stopped early: lengths {sorted(set(res.lengths.tolist()))}")
  step = (total - prefill) / n
  out = dict(kind="decode", model=preset, rows=rows, prompt_len=p, new_tokens=n,
             decode_options=xla_options.decode() if options else {}, decode_splits=splits,
             ms_per_step=1e3 * step, tokens_per_s=rows / step, generate_s=total,
             prefill_s=prefill, first_run_s=compile_s)
  roof = decode_bytes_per_step(cfg, rows, p + (n + 1) / 2)
  out["bytes_per_step"] = roof
  if specs:
    out["roofline_ms"] = 1e3 * roof / specs["hbm_bytes_per_s"]
    out["roofline_share"] = out["roofline_ms"] / out["ms_per_step"]
  return out


def prefill_case(preset: str, rows: int, specs) -> dict:
  cfg = _model(preset)
  params = models.init_params(cfg, jax.random.key(0))
  prompts, p = _prompts(cfg, rows, _PROMPT.value, seed=1), _PROMPT.value
  pre = lambda: _block(sampling.prefill(cfg, params, prompts, max_len=p + _NEW.value + 1)
                       .lengths_B)
  compile_s, t = _timed(pre, _REPEATS.value)
  flops = rows * p * forward_flops_per_token(cfg, (p + 1) / 2)
  out = dict(kind="prefill", model=preset, rows=rows, prompt_len=p, seconds=t,
             tokens_per_s=rows * p / t, first_run_s=compile_s, model_flops=flops)
  if specs:
    out["mfu"] = flops / t / specs["bf16_flops_per_s"]
  return out


def update_case(preset: str, tokens: int, policy: str, specs) -> dict:
  seq = min(_UPDATE_SEQ.value, tokens)
  rows = tokens // seq
  cfg = _model(preset, param_dtype="float32", remat=True, remat_policy=policy,
               attention="auto")
  tx = ts.make_optimizer(learning_rate=1e-6)
  step = ts.make_train_step(cfg, ts.LossConfig(), tx, max_tokens_per_micro=tokens,
                            logits_chunk=4096)
  rng = np.random.default_rng(0)
  mask = np.ones((rows, seq), np.float32)
  mask[:, :seq // 8] = 0  # A prompt, then the generated tokens the loss covers.
  batch = Batch(tokens=rng.integers(1, cfg.vocab_size, (rows, seq)).astype(np.int32),
                loss_mask=mask, old_logp=np.where(mask > 0, -2.0, 0.0).astype(np.float32),
                adv=rng.normal(size=rows).astype(np.float32))
  out = dict(kind="update", model=preset, tokens=tokens, seq=seq, rows=rows,
             remat_policy=policy, model_flops=train_flops(cfg, tokens, seq))
  key = jax.random.key(0)
  abstract = jax.eval_shape(lambda k: ts.init_state(models.init_params(cfg, k), tx, k), key)
  # The step packs on the host; its jitted part sees these shapes.
  packed = packing.pack(batch.as_dict(), max_tokens_per_micro=tokens, agg=ts.LossConfig().agg)
  packed = Batch(**jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                packed))
  mem = step.jitted.lower(abstract, packed, None).compile().memory_analysis()
  need = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
          + mem.temp_size_in_bytes)
  out["compiled_gb"] = need / 1e9
  have = _device_bytes()
  if have and need > 0.95 * have:
    out["skipped"] = f"needs {need / 1e9:.1f} GB of the device's {have / 1e9:.1f} GB"
    return out
  state = [jax.jit(lambda k: ts.init_state(models.init_params(cfg, k), tx, k))(key)]

  def run():
    state[0], metrics = step(state[0], batch)
    _block(metrics)

  compile_s, t = _timed(run, _REPEATS.value)
  out.update(seconds=t, tokens_per_s=tokens / t, first_run_s=compile_s)
  if specs:
    out["mfu"] = out["model_flops"] / t / specs["bf16_flops_per_s"]
  if "mem/peak_gb" in (mem := metrics.device_memory()):
    out["peak_gb"] = mem["mem/peak_gb"]
  del state
  return out


def _model(preset: str, **kw) -> models.Qwen3Config:
  kw = dict(param_dtype="bfloat16", compute_dtype="bfloat16") | kw
  return models.get_preset(preset, **kw)


def _device_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _headline(name: str) -> bool:
  """The issue's done-when figures: base decode at 1 and 64 rows, the 16k-token updates."""
  parts = name.split("/")
  return ((parts[0] == "decode" and len(parts) == 3 and parts[2] in ("b1", "b64"))
          or (parts[0] == "update" and parts[2] == "16384"))


def cases() -> list[tuple[str, callable]]:
  """(name, run(specs)) of every case the flags select, the headline ones first: a spent
  --budget_s skips the others."""
  out = []
  ints = lambda xs: [int(x) for x in xs]
  if "decode" in _CASES.value:
    for m in _MODELS.value:
      for b in ints(_BATCHES.value):
        out.append((f"decode/{m}/b{b}", lambda s, m=m, b=b: decode_case(m, b, s)))
    for b in ints(_VARIANT_BATCHES.value):
      m = _MODELS.value[0]
      out.append((f"decode/{m}/b{b}/no_options",
                  lambda s, m=m, b=b: decode_case(m, b, s, options=False)))
      out.append((f"decode/{m}/b{b}/splits{_DECODE_SPLITS.value}",
                  lambda s, m=m, b=b: decode_case(m, b, s, splits=_DECODE_SPLITS.value)))
  if "prefill" in _CASES.value:
    for m in _MODELS.value:
      for b in ints(_BATCHES.value):
        out.append((f"prefill/{m}/b{b}", lambda s, m=m, b=b: prefill_case(m, b, s)))
  if "update" in _CASES.value:
    for m in _UPDATE_MODELS.value:
      for n in ints(_UPDATE_TOKENS.value):
        for pol in _POLICIES.value:
          out.append((f"update/{m}/{n}/{pol}",
                      lambda s, m=m, n=n, pol=pol: update_case(m, n, pol, s)))
  # Headline figures, then the decode variants that decide defaults, then the rest.
  return sorted(out, key=lambda case: 0 if _headline(case[0]) else
                1 if case[0].count("/") == 3 else 2)


def _tiny_flags() -> None:
  """Tiny shapes: every code path in seconds (the test; any backend)."""
  for flag, value in dict(models=["tiny"], batches=["1", "3"], variant_batches=["3"],
                          decode_splits=3, prompt_len=16, new_tokens=16,
                          update_models=["tiny"], update_tokens=["256"], update_seq=64,
                          repeats=1, budget_s=1e9).items():
    if not flags.FLAGS[flag].present:
      flags.FLAGS[flag].value = value


def main(argv):
  del argv
  backend = jax.default_backend()
  if backend != "gpu" and not _TINY.value:
    print(f"benchmarks/gpu.py measures GPU speed; this machine's JAX backend is {backend!r}. "
          "Nothing to measure (run with --tiny to exercise the code at tiny shapes).")
    return
  if _TINY.value:
    _tiny_flags()
  kind = jax.devices()[0].device_kind
  specs = device_specs(kind)
  slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
  out_path = _OUT.value or ("" if _TINY.value else f"benchmarks/results/gpu-{slug}.json")
  result = dict(device=kind, backend=backend, jax=jax.__version__, specs=specs,
                platform=platform.platform(), tiny=_TINY.value,
                command="python benchmarks/gpu.py " + " ".join(sys.argv[1:]), cases={})
  t0 = time.perf_counter()
  for name, run in cases():
    if time.perf_counter() - t0 > _BUDGET.value:
      result["cases"][name] = {"skipped": f"--budget_s={_BUDGET.value:g} spent"}
      continue
    print(f"{name} ...", flush=True)
    try:
      r = run(specs)
    except Exception as e:  # pylint: disable=broad-except
      r = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-4000:]}
    result["cases"][name] = r
    print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in r.items() if k != "trace"), flush=True)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if out_path:
      os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
      with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
  print(f"{len(result['cases'])} cases in {time.perf_counter() - t0:.0f} s"
        + (f" -> {out_path}" if out_path else ""))


if __name__ == "__main__":
  # Flags only when run: gpu_check.py (same names) and the tests import this module too.
  _CASES = flags.DEFINE_list("cases", ["decode", "prefill", "update"], "Kinds of case to run.")
  _MODELS = flags.DEFINE_list("models", ["qwen3_0p6b", "qwen3_1p7b"], "Decode/prefill presets.")
  _BATCHES = flags.DEFINE_list("batches", ["1", "16", "64", "256"], "Decode/prefill rows.")
  _VARIANT_BATCHES = flags.DEFINE_list("variant_batches", ["1", "64"],
                                       "Rows of the decode variants (first model only).")
  _DECODE_SPLITS = flags.DEFINE_integer("decode_splits", 8, "Chunks of the flash-decoding variant.")
  _PROMPT = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per row.")
  _NEW = flags.DEFINE_integer("new_tokens", 512, "Generated tokens per row.")
  _UPDATE_MODELS = flags.DEFINE_list("update_models", ["qwen3_0p6b", "qwen3_1p7b", "qwen3_8b"],
                                     "Update-step presets.")
  _UPDATE_TOKENS = flags.DEFINE_list("update_tokens", ["16384", "65536"], "Tokens per update.")
  _UPDATE_SEQ = flags.DEFINE_integer("update_seq", 4096, "Tokens per row of the update batch.")
  _POLICIES = flags.DEFINE_list("remat_policies", ["nothing", "save_dots"],
                                "Remat policies of the update cases (Qwen3Config.remat_policy).")
  _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per case after the compiling one.")
  _BUDGET = flags.DEFINE_float("budget_s", 450.0, "Start no case after this many seconds.")
  _TINY = flags.DEFINE_bool("tiny", False, "Tiny shapes on any backend (tests the code paths).")
  _OUT = flags.DEFINE_string("out", "", "JSON path (default benchmarks/results/gpu-<device>.json; "
                             "--tiny: print only).")
  app.run(main)
