"""Sampler throughput vs transformers `generate`, side by side in one process.

  python benchmarks/sampling.py                       # CPU: small config
  python benchmarks/sampling.py --preset=qwen3_0p6b   # GPU: a real shape, random weights

Writes benchmarks/results/sampling-<device>.json; the last line printed is the ratio.
"""

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def _hf_model(cfg, path, torch_dtype):
  import torch
  import transformers
  hc = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                   if k not in ("architectures", "torch_dtype")})
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(hc).to(torch_dtype).eval()
  model.save_pretrained(path)
  return model


def _time_hf(model, prompts, new_tokens, device):
  import torch
  ids = torch.tensor(np.asarray(prompts), device=device)
  model = model.to(device)
  kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None)
  with torch.no_grad():
    model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # Warm up.
    if device == "cuda":
      torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **kw)
    if device == "cuda":
      torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
  assert out.shape[1] - ids.shape[1] == new_tokens
  return elapsed


def _time_ours(cfg, params, prompts, new_tokens):
  from mgrpo_jax import sampling
  prompts = [list(p) for p in prompts]
  run = lambda: sampling.generate(cfg, params, prompts, max_new_tokens=new_tokens,
                                  temperature=0.0, key=jax.random.key(0))
  run()  # Compile.
  start = time.perf_counter()
  res = run()
  elapsed = time.perf_counter() - start
  assert (res.lengths == new_tokens).all()
  return elapsed


def _roofline(cfg, batch, prompt_len, new_tokens, bytes_per_param):
  """Seconds per decode step if bound by HBM: weights + average KV cache read once."""
  dev = jax.devices()[0]
  bandwidth = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}
  bw = next((v for k, v in bandwidth.items() if k in dev.device_kind), None)
  avg_len = prompt_len + new_tokens / 2
  kv = 2 * cfg.num_layers * batch * avg_len * cfg.num_kv_heads * cfg.head_dim * bytes_per_param
  weights = cfg.num_params() * bytes_per_param
  return None if bw is None else (weights + kv) / bw, weights + kv, bw


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--preset", default=None, help="Model preset; default a small config.")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16.")
  args = parser.parse_args()

  import torch
  from mgrpo_jax import models

  on_gpu = jax.default_backend() == "gpu"
  dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
  if args.preset:
    cfg = models.get_preset(args.preset)
  else:
    cfg = models.Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=384,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                             tie_embeddings=True)
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  rng = np.random.RandomState(0)
  prompts = rng.randint(0, cfg.vocab_size, (args.batch, args.prompt_len))
  with tempfile.TemporaryDirectory() as path:
    hf_model = _hf_model(cfg, path, torch_dtype)
    cfg, params = models.load_hf(path, dtype=jnp.dtype(dtype))
  ours_s = _time_ours(cfg, params, prompts, args.new_tokens)
  del params
  hf_s = _time_hf(hf_model, prompts, args.new_tokens, "cuda" if on_gpu else "cpu")
  tokens = args.batch * args.new_tokens
  result = {
      "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
      "host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__},
      "model": args.preset or "small(4L,h128)", "dtype": dtype, "batch": args.batch,
      "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
      "ours_tokens_per_s": tokens / ours_s, "hf_tokens_per_s": tokens / hf_s,
      "ratio": hf_s / ours_s,
  }
  if on_gpu:
    step_s, step_bytes, bw = _roofline(cfg, args.batch, args.prompt_len, args.new_tokens,
                                       jnp.dtype(dtype).itemsize)
    if step_s is not None:
      result["roofline_step_s"] = step_s
      result["roofline_fraction"] = step_s / (ours_s / args.new_tokens)
      print(f"decode roofline: {step_bytes / 1e9:.2f} GB/step / {bw / 1e12:.2f} TB/s = "
            f"{step_s * 1e3:.3f} ms/step; ours {ours_s / args.new_tokens * 1e3:.3f} ms/step "
            f"({result['roofline_fraction']:.0%} of roofline)")
  name = result["device"].replace(" ", "_").lower()
  suffix = f"-{args.preset}-b{args.batch}" if args.preset else ""
  out = os.path.join(os.path.dirname(__file__), "results", f"sampling-{name}{suffix}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"ours {result['ours_tokens_per_s']:.0f} tok/s, transformers "
        f"{result['hf_tokens_per_s']:.0f} tok/s ({out})")
  print(f"ratio {result['ratio']:.2f}")


if __name__ == "__main__":
  main()
