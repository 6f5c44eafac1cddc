"""The MAGRPO rollout tree, batches and advantages with scripted policies and a toy task."""

import jax
import numpy as np
import pytest

from mgrpo_jax import byte_tokenizer, models
from mgrpo_jax.magrpo import rollout, tasks
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import joint, losses


class _Scripted:
  """Answers with a text that says which agent, call and sample it is; records prompts."""

  def __init__(self, agent, tokenizer):
    self.agent, self.tokenizer, self.calls, self.prompts = agent, tokenizer, 0, []

  def complete(self, prompts, key):
    del key
    self.prompts.append([self.tokenizer.decode(p) for p in prompts])
    out = []
    for i, p in enumerate(prompts):
      text = f"{self.agent}{self.calls}.{i}"
      ids = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
      out.append(rollout.Completion(list(p), ids, [-0.5] * len(ids), text, "stop"))
    self.calls += 1
    return out


def _toy_task(n_agents=2):
  """Reward = number of characters in the joint outputs' sample indices (distinct per combo)."""
  def score(examples, outputs):
    out = []
    for ex, texts in zip(examples, outputs):
      r = ex + sum(10 ** i * int(t.rsplit(".", 1)[1]) for i, t in enumerate(texts))
      out.append(tasks.Score(float(r), {"ok": 1.0}, f"fb{r}"))
    return out
  names = tuple(f"x{i}" for i in range(n_agents))
  return tasks.Task("toy", names, [0, 1000], [0], 1.0, lambda ex: [f"q{ex}"] * n_agents, score,
                    success="ok")


@pytest.fixture(scope="module")
def tok():
  return byte_tokenizer.ByteTokenizer()


@pytest.mark.parametrize("mode", ["align", "cross"])
def test_tree_layout_and_feedback(tok, mode):
  task, g = _toy_task(), 2
  pols = [_Scripted(i, tok) for i in range(2)]
  turns = rollout.joint_rollout(task, pols, [0, 1000], group=g, mode=mode, num_turns=2,
                                key=jax.random.key(0))
  j = 2 if mode == "align" else 4
  assert turns[0].rewards_PxM.shape == (2, j) and turns[1].rewards_PxM.shape == (2, j * j)
  assert len(turns[1].completions[0]) == 2 * j * g  # P * nodes * G
  idx = joint.joint_indices(2, g, mode)
  # Turn 0: prompt p's joint action j pairs sample idx[j, i] of each agent at node p.
  for p in range(2):
    for jj in range(j):
      want = p * 1000 + sum(10 ** i * (p * g + idx[jj, i]) for i in range(2))
      assert turns[0].rewards_PxM[p, jj] == want
  # Turn 1, node (p=1, joint action 1): each agent's chat holds its own turn-0 answer and the
  # feedback of that joint action, and nothing of the other agent's answer.
  node = 1 * j + 1
  a0, a1 = turns[0].texts[node]
  for agent, own, other in ((0, a0, a1), (1, a1, a0)):
    prompt = pols[agent].prompts[1][node * g]
    assert own in prompt and other not in prompt
    assert f"fb{turns[0].rewards_PxM[1, 1]:g}" in prompt.replace(".0", "")


def test_returns_and_agent_advantages_follow_the_tree(tok):
  task, g = _toy_task(), 2
  pols = [_Scripted(i, tok) for i in range(2)]
  turns = rollout.joint_rollout(task, pols, [0, 1000], group=g, mode="align", num_turns=2,
                                key=jax.random.key(0))
  rets = joint.tree_returns([t.rewards_PxM for t in turns], num_joint=2, gamma=0.5)
  r0, r1 = turns[0].rewards_PxM, turns[1].rewards_PxM
  np.testing.assert_allclose(rets[0], r0 + 0.5 * r1.reshape(2, 2, 2).mean(-1))
  adv0 = joint.joint_advantages(rets[0], num_joint=2)
  rows, adv = rollout.turn_rows(turns, 0, [joint.agent_advantages(adv0, np.eye(2)),
                                           np.zeros((2, 4))], [1.2, 0.8])
  assert len(rows) == len(adv) == 4 + 8
  with pytest.raises(ValueError, match="turn 1"):
    rollout.turn_rows(turns, 0, [np.zeros((2, 2)), np.zeros((2, 8))], [1.0, 1.0])
  np.testing.assert_allclose(adv[:4], 1.2 * (rets[0] - rets[0].mean(1, keepdims=True)).ravel())


def test_batch_scores_every_generated_token_with_the_samplers_logprobs(tok):
  cfg = models.get_preset("tiny", vocab_size=tok.vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  pol = rollout.Policy(cfg, params, tok, max_new_tokens=12, max_len=64, temperature=0.8)
  prompts = [tok.encode("ab"), tok.encode("hello there")]
  rows = pol.complete(prompts, jax.random.key(1))
  batch = batch_lib.make_batch(rows, np.array([1.0, -1.0], np.float32), max_len=32,
                               pad_id=tok.pad_id, minimum=32)
  for i, r in enumerate(rows):
    n_p, n = len(r.prompt), len(r.tokens)
    assert batch.loss_mask[i].sum() == len(r.generated) and batch.loss_mask[i, n_p:n].all()
  logits = models.logits(cfg, params, batch.tokens, np.ones_like(batch.tokens))
  logp = np.asarray(losses.token_logprobs(logits[:, :-1] / 0.8, batch.tokens[:, 1:]))
  m = batch.loss_mask[:, 1:] > 0
  np.testing.assert_allclose(logp[m], batch.old_logp[:, 1:][m], atol=1e-4)


def test_padding_rows_are_masked():
  rows = [rollout.Completion([1, 2], [3, 4], [-1.0, -2.0], "x", "stop"), None]
  b = batch_lib.make_batch(rows, np.array([2.0, 5.0], np.float32), max_len=8, pad_id=0,
                           minimum=8)
  assert b.loss_mask[1].sum() == 0 and b.adv[1] == 0 and b.adv[0] == 2.0
  np.testing.assert_array_equal(b.loss_mask[0], [0, 0, 1, 1, 0, 0, 0, 0])
  with pytest.raises(ValueError, match="Row 0 has 4 tokens; the batch length is 3"):
    batch_lib.make_batch(rows, np.zeros(2, np.float32), max_len=8, pad_id=0, minimum=1,
                         length=3)


def test_sequential_pipeline_shows_each_agent_the_earlier_agents_sample(tok):
  pols = [_Scripted(i, tok) for i in range(2)]
  turns = rollout.joint_rollout(_toy_task(), pols, [0], group=3, mode="align", num_turns=1,
                                key=jax.random.key(0), pipeline="sequential")
  for g in range(3):
    seen = pols[1].prompts[0][g]
    assert f"x0 wrote:\n{turns[0].completions[0][g].text}" in seen
    assert all(turns[0].completions[0][h].text not in seen for h in range(3) if h != g)
  assert "wrote" not in pols[0].prompts[0][0]
  with pytest.raises(ValueError, match="sequential needs align"):
    rollout.joint_rollout(_toy_task(), pols, [0], group=2, mode="cross", num_turns=1,
                          key=jax.random.key(0), pipeline="sequential")


def test_discussion_pipeline_shows_the_others_previous_outputs(tok):
  pols = [_Scripted(i, tok) for i in range(2)]
  turns = rollout.joint_rollout(_toy_task(), pols, [0], group=1, mode="align", num_turns=2,
                                key=jax.random.key(0), pipeline="discussion")
  a0, a1 = turns[0].texts[0]
  assert f"x1 wrote:\n{a1}" in pols[0].prompts[1][0] and f"x0 wrote:\n{a0}" in pols[1].prompts[1][0]


def test_single_model_baseline_scores_its_answer_as_every_agents(tok):
  task = tasks.build_task(__import__("configs.magrpo", fromlist=["x"]).get_config(
      "task=pick").task, single=True)
  assert task.agent_names == ("single",)
  ex = task.test[0]
  (good, same) = task.score([ex, ex], [(" ".join(ex.items),), (f"{ex.items[0]} {ex.items[0]}",)])
  assert (good.reward, same.reward) == (1.5, 0.5)
  demo = task.demonstration(ex, 0, np.random.default_rng(0)).split()
  assert len(demo) == 2 and set(demo) <= set(ex.items)


def test_a_prompt_that_leaves_no_room_is_refused_before_sampling(tok):
  cfg = models.get_preset("tiny", vocab_size=tok.vocab_size)
  pol = rollout.Policy(cfg, None, tok, max_new_tokens=8, max_len=16, temperature=1.0)
  with pytest.raises(rollout.PromptTooLongError, match="config.max_len=16"):
    pol.complete([tok.encode("a" * 9)], jax.random.key(0))
