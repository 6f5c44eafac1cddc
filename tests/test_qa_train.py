"""task=qa end to end on CPU at smoke size, and a Qwen3 HF directory with its own BPE tokenizer.

The MuSiQue sample (tests/data/qa): the experts' warm start, two M-GRPO steps from it, and
`launch/evaluate.py --workdir` of the finished run reading the run's own config.
"""

import json
import os
import pathlib
import random

import pytest

from configs import mgrpo, sft as sft_config
from mgrpo_jax import evaluate, hf_demo, hf_tokenizer, metrics, offline_tokenizer, tokenizer_io
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import colocated, play, sft, tasks

MUSIQUE = str(pathlib.Path(__file__).parent / "data" / "qa" / "musique.jsonl")


def _qa(module, arg="task=qa,smoke", **data):
  c = module.get_config(arg)
  c.data.update({"format": "musique", "train": MUSIQUE, "eval": MUSIQUE, **data})
  return c


def test_warm_start_two_mgrpo_steps_and_evaluation(tmp_path):
  warm, rl = str(tmp_path / "sft"), str(tmp_path / "rl")
  sft.train_sft(_qa(sft_config), warm)
  nll = [m["sft/sub/nll"] for m in metrics.read_metrics(warm) if "sft/sub/nll" in m]
  assert len(nll) == 2 and nll[1] < nll[0]  # The experts' traces are learnt.
  c = _qa(mgrpo, f"task=qa,smoke,init={warm}")
  workdir_lib.write_config(rl, c)  # As launch/train.py does.
  colocated.train_and_evaluate(c, rl)
  lines = metrics.read_metrics(rl)
  assert [m["step"] for m in lines] == [0, 1, 2]
  assert {"main/loss", "sub/loss", "eval/f1", "eval/retrieval_recall_hop1"} <= set(lines[0])
  # The finished run evaluates from its workdir alone.
  result = evaluate.run(workdir_lib.load_config(rl), rl)
  assert result["step"] == 2 and result["num_questions"] == 4
  assert {"accuracy", "f1", "retrieval_recall", "retrieval_recall_hop2"} <= set(result)
  assert json.load(open(os.path.join(rl, "eval.json")))["f1"] == result["f1"]
  # The run's final evaluation recorded what evaluating its final weights records (the
  # hierarchy sweep reads it instead of evaluating those weights again).
  with open(os.path.join(rl, evaluate.QUESTIONS_FILE)) as f:
    again = json.load(f)
  with open(play.questions_path(rl, 2)) as f:
    final = json.load(f)
  assert len(final["question_ids"]) == 4 and final == again
  assert sorted(os.listdir(os.path.join(rl, "hf"))) == ["main", "sub"]


def test_expert_evaluation_reads_only_what_search_finds(tmp_path):
  c = _qa(mgrpo, "task=qa,policy=expert")
  result = evaluate.run(c, str(tmp_path))
  assert result["accuracy"] >= 0.5 and result["f1"] >= result["accuracy"]
  assert 0.5 < result["retrieval_recall"] <= 1.0 and result["format"] == 1.0


def test_qa_config_errors(tmp_path):
  c = _qa(mgrpo)
  c.retrieval.corpus = "/data/wiki.jsonl"
  with pytest.raises(ValueError, match="retrieval.corpus='/data/wiki.jsonl' to config.data.corpus"):
    tasks.build_env(c)
  c = _qa(mgrpo, format="jsonl")
  with pytest.raises(ValueError, match="'jsonl' has no paragraphs"):
    tasks.build_env(c)
  c = _qa(mgrpo, "task=qa,policy=expert", format="jsonl", corpus=str(tmp_path / "c.jsonl"))
  (tmp_path / "c.jsonl").write_text('{"id": "a", "contents": "\\"A\\"\\nText."}\n')
  with pytest.raises(ValueError, match="no gold structure"):
    evaluate.run(c, str(tmp_path / "e"))


def test_qwen3_checkpoint_trains_with_its_own_tokenizer(tmp_path):
  """hf_path means the checkpoint's tokenizer; the export carries it and loads with transformers."""
  from transformers import AutoModelForCausalLM, AutoTokenizer

  ckpt = hf_demo.write_random_checkpoint(str(tmp_path / "qwen3"))
  c = mgrpo.get_config(f"smoke,hf_path={ckpt}")
  env = tasks.build_env(c)
  assert isinstance(env.tokenizer, hf_tokenizer.HFTokenizer)
  c.num_steps = 1
  colocated.train_and_evaluate(c, str(tmp_path / "run"))
  export = str(tmp_path / "run" / "hf" / "main")
  text = "<|im_start|>user\nWho founded the Halvard Institute?<|im_end|>\n<search>Halvard</search>"
  mine, theirs = (AutoTokenizer.from_pretrained(p, local_files_only=True) for p in (ckpt, export))
  assert theirs.encode(text) == mine.encode(text) == env.tokenizer.encode(text)
  assert len(mine.encode(text)) < len(text.encode()) / 2  # BPE, not bytes.
  model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
  assert model.config.vocab_size >= len(theirs)
  # A byte tokenizer named on purpose still runs (it fits), and the mismatch of a tokenizer
  # larger than the model is refused naming both.
  rng = random.Random(0)
  words = [" ".join("".join(rng.choices("abcdefghij", k=6)) for _ in range(20)) for _ in range(400)]
  big = offline_tokenizer.write_test_hf_tokenizer(tmp_path / "big", texts=words, vocab_size=4096)
  assert len(tokenizer_io.load_tokenizer(big).hf_tokenizer) > env.tokenizer.vocab_size + 128
  c = mgrpo.get_config(f"smoke,hf_path={ckpt}")
  c.tokenizer = str(big)
  with pytest.raises(ValueError, match=f"{ckpt}: the checkpoint has .* token ids but the "
                                       f"tokenizer in '{big}'"):
    colocated.train_and_evaluate(c, str(tmp_path / "bad"))
