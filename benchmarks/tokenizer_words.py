"""How long the byte tokenizer takes to find a world's words: a trie against one alternation.

The CPU multihop task's tokenizer ("byte+phrases+ids") gives the world's phrases and doc ids
one id each. Encoding a page used to run one regex alternation of every word, longest first;
the warm start's traces (every tool reply is encoded) spent about 80% of their time there
(py-spy, session 19). `byte_tokenizer.words_pattern` builds the same matches from a trie of the
words.
This encodes every page of the world with both, checks that the ids are the same, and times
them; then it times the single agent's warm-start traces on `--trace_questions` questions
(the training split and two other worlds) with each. The alternation is rebuilt here as the
reference.

  python benchmarks/tokenizer_words.py --repeats=10 \
      --out=benchmarks/results/tokenizer-words-cpu.json
"""

import contextlib
import json
import os
import pathlib
import re
import sys
import time

from absl import app, flags

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import byte_tokenizer
from mgrpo_jax.envs import world
from mgrpo_jax.mgrpo import setup, sft, tasks

import hierarchy_instrument as hi  # benchmarks/hierarchy_instrument.py

_CONFIG = flags.DEFINE_string("config", "task=multihop,runlocal", "configs/mgrpo.py argument "
                              "whose world and tokenizer to use.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Passes over the pages; the fastest is kept.")
_TRACE_QUESTIONS = flags.DEFINE_integer("trace_questions", 1200, "Questions of the timed "
                                        "warm-start traces (0: none).")
_OUT = flags.DEFINE_string("out", "", "Results JSON (default: print only).")
_NOTE = flags.DEFINE_string("note", "", "What else ran on the machine, for the JSON.")


def alternation(words) -> re.Pattern:
  """The old pattern: every word in one alternation, longest first, with its boundaries."""
  edge = lambda ch: "(?<![^\\W_])" if ch.isalnum() else ""
  after = lambda ch: "(?![^\\W_])" if ch.isalnum() else ""
  return re.compile("|".join(edge(w[0]) + re.escape(w) + after(w[-1])
                             for w in sorted(words, key=len, reverse=True)))


def encode_with(pattern: re.Pattern, tok: byte_tokenizer.ByteTokenizer, text: str) -> list[int]:
  """`tok.encode(text)` with `pattern` finding the words."""
  saved, tok._word_re = tok._word_re, pattern  # pylint: disable=protected-access
  try:
    return tok.encode(text)
  finally:
    tok._word_re = saved  # pylint: disable=protected-access


@contextlib.contextmanager
def patterns_from(make):
  """Tokenizers made inside use `make(words)` to find their words."""
  saved, byte_tokenizer.words_pattern = byte_tokenizer.words_pattern, make
  try:
    yield
  finally:
    byte_tokenizer.words_pattern = saved


def trace_seconds(num_questions: int) -> dict:
  """Seconds of the single agent's warm-start traces (the sweep's config, two other worlds)
  with each pattern, and what they hold (the same with both)."""
  c = sft_config.get_config(f"task=multihop,{hi.SIZE_FLAG['cpu']},{hi.EXTRA['single']}")
  c.sft.update(other_worlds=2, trace_worlds=-1, num_questions=num_questions)
  w = setup.resolve_wiring(c, training=False)
  out = {}
  for name, make in (("alternation", alternation), ("trie", byte_tokenizer.words_pattern)):
    with patterns_from(make):
      env = tasks.build_env(c)
      others = sft.other_world_envs(c)
      start = time.perf_counter()
      data = sft.expert_episodes(c, w, env, seed=c.seed, others=others)
      out[name] = time.perf_counter() - start
    out[f"{name}_tokens"] = sum(len(e.tokens) for eps in data.values() for e in eps)
  if out["alternation_tokens"] != out["trie_tokens"]:
    raise AssertionError(f"the traces differ: {out}")
  return dict(questions=num_questions, tokens=out["trie_tokens"],
              seconds={k: round(out[k], 1) for k in ("alternation", "trie")},
              speedup=round(out["alternation"] / out["trie"], 1))


def fastest(fn, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def main(argv):
  del argv
  c = mgrpo_config.get_config(_CONFIG.value)
  the_world = world.generate_world(tasks.world_config(c))
  words = tasks.tokenizer_words(c.tokenizer, the_world)
  tok = byte_tokenizer.ByteTokenizer(words=words)
  pages = [f"[{d.doc_id}] {d.title}\n{d.text}" for d in the_world.documents]
  patterns = {"alternation": alternation(words), "trie": byte_tokenizer.words_pattern(words)}
  ids = {name: [encode_with(p, tok, page) for page in pages] for name, p in patterns.items()}
  if ids["alternation"] != ids["trie"]:
    bad = sum(a != b for a, b in zip(ids["alternation"], ids["trie"]))
    raise AssertionError(f"the trie encodes {bad} of {len(pages)} pages differently")
  seconds = {name: fastest(lambda p=p: [encode_with(p, tok, page) for page in pages],
                           _REPEATS.value) for name, p in patterns.items()}
  out = dict(
      config=_CONFIG.value, tokenizer=c.tokenizer, words=len(words), pages=len(pages),
      mean_page_chars=round(sum(map(len, pages)) / len(pages), 1),
      mean_page_ids=round(sum(map(len, ids["trie"])) / len(pages), 1), same_ids=True,
      ms_per_page={k: round(1e3 * v / len(pages), 4) for k, v in seconds.items()},
      speedup=round(seconds["alternation"] / seconds["trie"], 1),
      warm_start_traces=trace_seconds(_TRACE_QUESTIONS.value) if _TRACE_QUESTIONS.value else None,
      cpu=os.cpu_count(), note=_NOTE.value, command=" ".join(["python"] + sys.argv))
  text = json.dumps(out, indent=1) + "\n"
  print(text, end="")
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(text)


if __name__ == "__main__":
  app.run(main)
