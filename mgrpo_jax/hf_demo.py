"""A CPU demo of the foundation: write a random HF Qwen3 checkpoint, load it, chat-generate.

Every real format is exercised on files made here: `config.json` + sharded safetensors
written by `save_hf`, a byte-level BPE tokenizer directory with Qwen3's chat template,
`load_hf` with a device mesh, and the batched sampler.
"""

import os
import time

import jax
import numpy as np
from absl import logging

from mgrpo_jax import models, offline_tokenizer, sampling, sharding, tokenizer_io


def write_random_checkpoint(path: str, preset: str = "tiny", seed: int = 0) -> str:
  """Writes a random-weight HF checkpoint + tokenizer directory at `path`."""
  tok_dir = offline_tokenizer.write_test_hf_tokenizer(path)
  tok = tokenizer_io.load_tokenizer(str(tok_dir))
  cfg = models.get_preset(preset, vocab_size=tok.padded_vocab_size())
  params = models.init_params(cfg, jax.random.key(seed))
  # Small shards so the demo also reads a sharded checkpoint with its index.
  models.save_hf(path, cfg, params, max_shard_bytes=max(1, cfg.num_params() * 4 // 3))
  return path


def run(workdir: str, *, preset: str = "tiny", max_new_tokens: int = 48,
        temperature: float = 0.7, seed: int = 0) -> list[str]:
  """Runs the demo; returns the generated texts."""
  path = os.path.join(workdir, "random_qwen3")
  if not os.path.exists(os.path.join(path, "config.json")):
    write_random_checkpoint(path, preset, seed)
  files = sorted(os.listdir(path))
  logging.info("Checkpoint %s: %s", path, ", ".join(files))
  mesh = sharding.make_mesh((-1, 1, 1))
  cfg, params = models.load_hf(path, mesh=mesh)
  tok = tokenizer_io.load_tokenizer(path)
  questions = ["Who founded the Halvard Institute?", "Where was Mira Osk born?",
               "Which river flows through Tarn?", "What did Ilse Varga write?"]
  prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True) for q in questions]
  start = time.perf_counter()
  result = sampling.generate(cfg, params, prompts, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=0.9, top_k=50,
                             stop_token_ids=tok.stop_ids, key=jax.random.key(seed))
  elapsed = time.perf_counter() - start
  texts = [tok.decode(t[:n]) for t, n in zip(result.tokens, result.lengths)]
  for q, text, lp, n in zip(questions, texts, result.logprobs, result.lengths):
    print(f"Q: {q}\nA ({n} tokens, mean logp {np.mean(lp[:n]):.2f}): {text!r}\n")
  print(f"{cfg.num_params() / 1e6:.2f}M params on {len(jax.devices())} device(s); "
        f"{int(result.lengths.sum())} tokens in {elapsed:.1f}s (compile included). "
        "Random weights: the text is noise; the formats and the sampler are real.")
  return texts
