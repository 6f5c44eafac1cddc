"""The task=qa experts through the real tools: EM, F1 and retrieval recall, with and without
the supporting paragraphs in the corpus (the leakage check: an expert that answers without
its evidence would still score there).

  python benchmarks/qa_experts.py   # the shared MuSiQue and HotpotQA samples

For each file: `launch/evaluate.py --config=configs/mgrpo.py:task=qa,policy=expert
--config.data.format=<fmt> --config.data.eval=<file>` (the data's own paragraphs as the
corpus), then the same with `--config.data.corpus=<JSONL of those paragraphs less every
supporting one>`, both through the library. Writes benchmarks/results/qa-experts-cpu.json.
"""

import json
import os
import time

from absl import app, flags

from configs import mgrpo as mgrpo_config
from mgrpo_jax import evaluate
from mgrpo_jax.envs import datasets, qa, retrieval

_DATA = flags.DEFINE_multi_string(
    "data", ["musique=/work/shared/data/musique_sample.jsonl",
             "hotpotqa=/work/shared/data/hotpotqa_sample.json"], "format=path, repeated.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/qa_experts", "Scratch directory.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/qa-experts-cpu.json", "Results JSON.")
_KEEP = ("accuracy", "f1", "format", "delegations", "num_questions", "sub_overflow")


def _run(fmt: str, path: str, corpus: str, workdir: str) -> dict:
  c = mgrpo_config.get_config("task=qa,policy=expert")
  c.data.update(format=fmt, eval=path, corpus=corpus)
  start = time.perf_counter()
  result = evaluate.run(c, workdir)
  keep = {k: v for k, v in result.items() if k in _KEEP or k.startswith("retrieval_recall")}
  command = ("python launch/evaluate.py --config=configs/mgrpo.py:task=qa,policy=expert "
             f"--config.data.format={fmt} --config.data.eval={path} --workdir={workdir}"
             + (f" --config.data.corpus={corpus}" if corpus else ""))
  return {"dataset": fmt, "data": path, "corpus": corpus or "the data's paragraphs",
          "search_k": c.world.search_k, "visit_chars": c.world.visit_chars,
          "seconds": round(time.perf_counter() - start, 1), "command": command, **keep}


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = []
  for item in _DATA.value:
    fmt, path = item.split("=", 1)
    questions = datasets.load_qa(path, fmt)
    cut = qa.without_support(qa.corpus_documents(questions), questions)
    corpus = retrieval.export_corpus(cut, os.path.join(_WORKDIR.value, f"{fmt}-no-support.jsonl"))
    for name, corpus_path in (("full", ""), ("no_support", corpus)):
      row = _run(fmt, path, corpus_path, os.path.join(_WORKDIR.value, f"{fmt}-{name}"))
      print(json.dumps(row))
      rows.append(row)
  with open(_OUT.value, "w") as f:
    json.dump({"runs": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
