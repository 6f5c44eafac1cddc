"""Main and sub-agent over an exchange give the same episodes as the colocated run."""

import threading
import time

import jax
import numpy as np
import pytest

import loopback
from mgrpo_jax.mgrpo import delegation
from mgrpo_jax import byte_tokenizer
from mgrpo_jax.agents import experts, rollout
from mgrpo_jax.envs import retrieval, search, world
from mgrpo_jax.exchange import Exchange, ExchangeConflict
from mgrpo_jax.mgrpo import hierarchy

TOK = byte_tokenizer.ByteTokenizer()
LIMITS = rollout.Limits(max_turns=6, max_new_tokens=160, max_len=4096, max_delegations=4)


@pytest.fixture(scope="module")
def env():
  w = world.generate_world(world.WorldConfig(seed=4))
  return world.make_questions(w, num=6, seed=2), retrieval.Bm25Retriever.from_documents(w.documents)


def _sub_service(index, key):
  # Noisy experts: results differ between calls, so a mix-up of waves or keys would show.
  policy = rollout.ExpertPolicy(experts.SubExpert(noise=0.4), TOK, seed=5)
  return rollout.ColocatedSubAgent(policy, TOK, search.local_tools(index), limits=LIMITS,
                                   key=key)


def _main_policy():
  return rollout.ExpertPolicy(experts.MainExpert(noise=0.2), TOK, seed=6)


def _outcome(eps, qs, k):
  return hierarchy.main_outcomes(eps, [q.answer for q in qs], len(qs), k)


def test_decoupled_step_equals_colocated(env, tmp_path):
  qs, index = env
  key, step, k = jax.random.key(0), 3, 2
  colocated_sub = _sub_service(index, key)
  want = rollout.rollout_main(_main_policy(), colocated_sub, qs, num_rollouts=k, tokenizer=TOK,
                              limits=LIMITS, key=key, step=step)

  exchange = Exchange(f"file://{tmp_path}/exchange")
  remote_sub = _sub_service(index, key)
  served = {}
  thread = threading.Thread(target=lambda: served.setdefault(
      "outcome", delegation.serve_step(exchange, remote_sub, step, timeout_s=60)))
  thread.start()
  main_side = delegation.ExchangeSubAgent(exchange, step=step, timeout_s=60)
  got = rollout.rollout_main(_main_policy(), main_side, qs, num_rollouts=k, tokenizer=TOK,
                             limits=LIMITS, key=key, step=step)
  outcome = _outcome(got, qs, k)
  delegation.publish_outcome(exchange, step, outcome, main_side.waves)
  thread.join(timeout=60)
  assert not thread.is_alive()

  assert [e.tokens for e in got] == [e.tokens for e in want]
  assert [e.tokens for e in remote_sub.episodes] == [e.tokens for e in colocated_sub.episodes]
  np.testing.assert_array_equal(served["outcome"].correct, outcome.correct)
  np.testing.assert_array_equal(served["outcome"].reward, _outcome(want, qs, k).reward)
  # Only small records crossed: no tokens, no parameters.
  stats = exchange.stats()
  assert stats["bytes_written"] < 400 * (len(remote_sub.episodes) * 2 + main_side.waves + 8)


def test_loopback_is_the_colocated_service_through_the_exchange(env):
  """The colocated trainer's service: the same episodes, with every record crossing."""
  qs, index = env
  key, step, k = jax.random.key(2), 4, 2
  colocated_sub = _sub_service(index, key)
  want = rollout.rollout_main(_main_policy(), colocated_sub, qs, num_rollouts=k, tokenizer=TOK,
                              limits=LIMITS, key=key, step=step)
  exchange = loopback.memory_exchange()
  loop = loopback.LoopbackSubAgent(exchange, _sub_service(index, key), step=step)
  got = rollout.rollout_main(_main_policy(), loop, qs, num_rollouts=k, tokenizer=TOK,
                             limits=LIMITS, key=key, step=step)
  assert [e.tokens for e in got] == [e.tokens for e in want]
  assert [e.tokens for e in loop.episodes] == [e.tokens for e in colocated_sub.episodes]
  calls = {(step, e.q, e.k, e.call) for e in loop.episodes}
  assert set(exchange.list("request")) == set(exchange.list("result")) == calls
  assert loop.waves > 0
  outcome = _outcome(got, qs, k)
  relayed = loop.relay_outcome(outcome)  # What the sub-agent's side trains on.
  for name in ("reward", "correct", "format_ok"):
    np.testing.assert_array_equal(getattr(relayed, name), getattr(outcome, name))
    assert getattr(relayed, name).dtype == getattr(outcome, name).dtype
  assert exchange.wait_mark("rollouts_done", step, timeout_s=0) == {"waves": loop.waves}
  # Each loopback has its own store, so a long run keeps one step's records at most.
  assert loopback.memory_exchange().list("request") == []


def test_evaluation_and_training_records_of_a_step_do_not_collide(env, tmp_path):
  """Evaluation delegations carry the same (step, q, k, call) as training ones."""
  qs, index = env
  exchange = Exchange(f"file://{tmp_path}/exchange")
  for svc_step, q in ((3, qs[0]), (delegation.EVAL_STEP_BASE + 3, qs[1])):
    sub = _sub_service(index, jax.random.key(0))
    thread = threading.Thread(target=delegation.serve_step, args=(exchange, sub, svc_step),
                              kwargs=dict(timeout_s=60, read_outcome=False))
    thread.start()
    main_side = delegation.ExchangeSubAgent(exchange, step=svc_step, timeout_s=60)
    # The rollouts' own step is 3 for both, as in the programs' evaluation.
    rollout.rollout_main(_main_policy(), main_side, [q], num_rollouts=1, tokenizer=TOK,
                         limits=LIMITS, key=jax.random.key(0), step=3)
    exchange.mark("rollouts_done", svc_step, {"waves": main_side.waves})
    thread.join(timeout=60)
    assert sub.episodes
  assert {k[0] for k in exchange.list("request")} == {3, delegation.EVAL_STEP_BASE + 3}


def test_restarted_sub_agent_rewrites_identical_results(env, tmp_path):
  """A sub-agent killed after serving and restarted regenerates the same records."""
  qs, index = env
  key, step = jax.random.key(1), 0
  exchange = Exchange(f"file://{tmp_path}/exchange")

  def serve(service):
    return delegation.serve_step(exchange, service, step, timeout_s=60)

  first = _sub_service(index, key)
  thread = threading.Thread(target=serve, args=(first,))
  thread.start()
  main_side = delegation.ExchangeSubAgent(exchange, step=step, timeout_s=60)
  eps = rollout.rollout_main(_main_policy(), main_side, qs[:3], num_rollouts=2, tokenizer=TOK,
                             limits=LIMITS, key=key, step=step)
  delegation.publish_outcome(exchange, step, _outcome(eps, qs[:3], 2), main_side.waves)
  thread.join(timeout=60)
  before = exchange.stats()["records_written"]
  again = _sub_service(index, key)  # A fresh process restarting the step.
  serve(again)
  assert exchange.stats()["records_written"] == before  # Nothing new: exactly once.
  assert [e.tokens for e in again.episodes] == [e.tokens for e in first.episodes]


def _two_questions(env):
  """Questions of 1 and 2 hops, and the colocated run of them: episodes, sub episodes."""
  qs, index = env
  questions, key = [qs[0], qs[4]], jax.random.key(3)
  sub = _noise_free_sub(search.local_tools(index), key)
  eps = rollout.rollout_main(_noise_free_main(), sub, questions, num_rollouts=1,
                             tokenizer=TOK, limits=LIMITS, key=key, step=2)
  return questions, key, eps, sub.episodes


def _noise_free_sub(tools, key):
  policy = rollout.ExpertPolicy(experts.SubExpert(), TOK, seed=5)
  return rollout.ColocatedSubAgent(policy, TOK, tools, limits=LIMITS, key=key)


def _noise_free_main():
  return rollout.ExpertPolicy(experts.MainExpert(), TOK, seed=6)


def _put_request(exchange, ep):
  exchange.put("request", (ep.task.step, ep.q, ep.k, ep.call),
               {"subtask": ep.task.subtask, "context": ep.task.context})


def test_sub_agent_answers_each_delegation_as_it_ends(env, tmp_path):
  """A request that arrives while another's episode is held up in its tool is served and
  answered at once; released, every result is the colocated run's."""
  _, index = env
  questions, key, _, want = _two_questions(env)
  first, second = want[0], [e for e in want if e.q == 1][0]
  gate, held = threading.Event(), []

  def hold(tool):  # Holds the tool calls about question 0's entity until released.
    def call(arg):
      if questions[0].hops[0].entity.lower() in arg.lower():
        held.append(arg)
        assert gate.wait(60)
      return tool(arg)
    return call

  exchange = Exchange(f"file://{tmp_path}/exchange")
  sub = _noise_free_sub({k: hold(t) for k, t in search.local_tools(index).items()}, key)
  thread = threading.Thread(target=delegation.serve_step, args=(exchange, sub, 2),
                            kwargs=dict(timeout_s=60, read_outcome=False))
  _put_request(exchange, first)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not held and time.monotonic() < deadline:
      time.sleep(0.01)
    assert held  # The first episode waits in its tool call...
    _put_request(exchange, second)  # ...when the second request comes: it is answered.
    got = exchange.get("result", (2, 1, 0, 0), timeout_s=30)
    assert exchange.try_get("result", (2, 0, 0, 0)) is None
  finally:
    gate.set()
  for ep in want[1:]:
    _put_request(exchange, ep)
  exchange.mark("requests_done", 2)
  thread.join(timeout=60)
  assert not thread.is_alive()
  assert got["text"] == rollout.result_of(second).text
  assert [e.tokens for e in sub.episodes] == [e.tokens for e in want]


def test_main_agent_goes_on_as_each_result_arrives(env, tmp_path):
  """Two delegations sent in one batch: the one whose result comes back goes on to its next
  delegation while the other still waits; served, the run is the colocated one."""
  _, index = env
  questions, key, want, want_sub = _two_questions(env)
  exchange = Exchange(f"file://{tmp_path}/exchange")
  main_side = delegation.ExchangeSubAgent(exchange, step=2, timeout_s=60)
  got = {}
  thread = threading.Thread(target=lambda: got.setdefault("eps", rollout.rollout_main(
      _noise_free_main(), main_side, questions, num_rollouts=1, tokenizer=TOK, limits=LIMITS,
      key=key, step=2)))
  thread.start()
  # Only question 1's first result is there: its episode goes on to its second delegation.
  exchange.get_many("request", [(2, 0, 0, 0), (2, 1, 0, 0)], timeout_s=30)
  answer = rollout.result_of([e for e in want_sub if e.q == 1][0])
  exchange.put("result", (2, 1, 0, 0), {"text": answer.text, "format_ok": answer.format_ok,
                                        "policy_version": answer.policy_version})
  exchange.get("request", (2, 1, 0, 1), timeout_s=30)
  assert exchange.try_get("result", (2, 0, 0, 0)) is None
  # Both first calls went in one batch (a wave would have held question 1 with question 0).
  assert (main_side.waves, main_side.requests) == (2, 3)
  sub = _noise_free_sub(search.local_tools(index), key)  # Serves the rest.
  server = threading.Thread(target=delegation.serve_step, args=(exchange, sub, 2),
                            kwargs=dict(timeout_s=60, read_outcome=False))
  server.start()
  thread.join(timeout=60)
  main_side.close()
  server.join(timeout=60)
  assert not thread.is_alive() and not server.is_alive()
  assert [e.tokens for e in got["eps"]] == [e.tokens for e in want]


def test_restarted_sub_agent_reads_back_its_stored_episodes(env, tmp_path):
  """With stored episodes a restarted sub-agent playing another version (max_staleness >= 1)
  answers what was answered with the episodes that answered it; played again, they differ."""
  qs, index = env
  key, step = jax.random.key(1), 0
  exchange = Exchange(f"file://{tmp_path}/exchange")

  def sub_service(version):
    policy = rollout.ExpertPolicy(experts.SubExpert(noise=0.4), TOK, seed=5, version=version)
    return rollout.ColocatedSubAgent(policy, TOK, search.local_tools(index), limits=LIMITS,
                                     key=key)

  first = sub_service(0)
  thread = threading.Thread(target=delegation.serve_step, args=(exchange, first, step),
                            kwargs=dict(timeout_s=60, read_outcome=False, stored=True))
  thread.start()
  main_side = delegation.ExchangeSubAgent(exchange, step=step, timeout_s=60)
  rollout.rollout_main(_main_policy(), main_side, qs[:3], num_rollouts=2, tokenizer=TOK,
                       limits=LIMITS, key=key, step=step)
  main_side.close()
  thread.join(timeout=60)
  assert first.episodes and set(exchange.list("sub_episode")) == set(exchange.list("result"))
  before = exchange.stats()["records_written"]
  again = sub_service(1)  # Restarted from a later checkpoint: another version.
  delegation.serve_step(exchange, again, step, timeout_s=60, read_outcome=False, stored=True)
  assert exchange.stats()["records_written"] == before  # Nothing new: exactly once.
  for a, b in zip(again.episodes, first.episodes, strict=True):
    assert (a.tokens, a.logprobs, a.loss_mask, a.turns, a.observations, a.failure,
            a.policy_version) == (b.tokens, b.logprobs, b.loss_mask, b.turns, b.observations,
                                  b.failure, 0)
  with pytest.raises(ExchangeConflict):  # Played again by version 1, the results differ.
    delegation.serve_step(exchange, sub_service(1), step, timeout_s=60, read_outcome=False)


def test_missing_main_agent_times_out_with_a_message(env, tmp_path):
  _, index = env
  exchange = Exchange(f"file://{tmp_path}/exchange")
  with pytest.raises(TimeoutError, match="no new request of step 7"):
    delegation.serve_step(exchange, _sub_service(index, jax.random.key(0)), 7, timeout_s=0.3)


@pytest.mark.parametrize("policy", ["model", "expert"])
def test_role_programs_match_the_colocated_run(tmp_path, policy):
  """Both programs (threads here) over a file:// exchange: the colocated run's metrics.

  With the scripted experts playing (policy=expert) too: their results carry no weight
  version, so the staleness bound does not refuse them.
  """
  from configs import mgrpo
  from mgrpo_jax import metrics
  from mgrpo_jax.mgrpo import colocated
  from mgrpo_jax.mgrpo import decoupled as dc

  def cfg():
    c = mgrpo.get_config(f"smoke,policy={policy}")
    c.num_steps = 2 if policy == "model" else 1  # The experts' case: one step shows it.
    return c

  colocated.train_and_evaluate(cfg(), str(tmp_path / "colocated"))
  url = f"file://{tmp_path}/exchange"
  errors = []

  def sub():
    try:
      dc.run_sub_agent(cfg(), str(tmp_path / "sub"), url, timeout_s=120)
    except Exception as e:  # Surface the thread's failure in the test.
      errors.append(e)

  thread = threading.Thread(target=sub)
  thread.start()
  dc.run_main_agent(cfg(), str(tmp_path / "main"), url, timeout_s=120)
  thread.join(timeout=300)
  assert not errors and not thread.is_alive()
  colocated = metrics.stable(metrics.read_metrics(str(tmp_path / "colocated")))
  main = metrics.stable(metrics.read_metrics(str(tmp_path / "main")))
  sub_rows = metrics.stable(metrics.read_metrics(str(tmp_path / "sub")))
  merged = [{**a, **b} for a, b in zip(main, sub_rows)]
  assert [r["step"] for r in merged] == list(range(cfg().num_steps + 1))
  assert merged == colocated


def test_stale_results_are_refused(tmp_path):
  exchange = Exchange(f"file://{tmp_path}/exchange")
  req = rollout.DelegationRequest(5, 0, 0, 0, "Who founded X?")
  exchange.put("result", (5, 0, 0, 0), {"text": "Y", "policy_version": 2, "format_ok": True})
  fresh = delegation.ExchangeSubAgent(exchange, step=5, timeout_s=1, version=5, max_staleness=3)
  assert fresh.delegate([req])[0].text == "Y"
  strict = delegation.ExchangeSubAgent(exchange, step=5, timeout_s=1, version=5, max_staleness=2)
  with pytest.raises(delegation.StaleResultError, match="version 2"):
    strict.delegate([req])


def test_a_main_attempt_owns_its_steps_and_a_sub_agent_waiting_on_another_learns_it(tmp_path):
  """Attempt a owns the training steps from its first one and the evaluations after it; a
  sub-agent waiting for requests or an outcome of a step another attempt took over is told
  (`MainRestarted`) rather than waiting for its timeout."""
  run = f"file://{tmp_path}/run"
  attempts = delegation.Attempts(run)
  assert attempts.begin(0) == 0 and attempts.owner(3) == 0
  old = attempts.exchange(0)
  old.mark("rollouts_done", 0)  # Step 0's outcome published by attempt 0, step 1's not.
  assert attempts.published(0, 3) == 1
  raised = {}

  def wait_for_requests():  # Step 1 of attempt 0, whose main program was killed.
    try:
      delegation.serve_step(old, _sub_service(None, jax.random.key(0)), 1, timeout_s=30,
                            read_outcome=False, check=lambda: attempts.check(1, 0))
    except delegation.MainRestarted as e:
      raised["step"] = e.step

  thread = threading.Thread(target=wait_for_requests)
  thread.start()
  time.sleep(0.2)
  assert thread.is_alive()  # Nothing says yet that step 1 is void.
  assert attempts.begin(1) == 1
  thread.join(timeout=10)
  assert raised == {"step": 1}
  assert attempts.firsts() == {0: 0, 1: 1}
  assert [attempts.owner(s) for s in range(3)] == [0, 1, 1]
  # The weights evaluated at step 1 are every attempt's: the old evaluation still counts.
  assert [attempts.owner(s, evaluation=True) for s in range(3)] == [0, 0, 1]
  with pytest.raises(delegation.MainRestarted):
    delegation.get_outcome(old, 1, timeout_s=30, check=lambda: attempts.check(1, 0))
  assert attempts.exchange(1).list("request") == [] and attempts.exchange(1) is not old


def test_stored_main_episodes_read_back_as_played(env, tmp_path):
  qs, index = env
  key, step, k = jax.random.key(2), 4, 2
  eps = rollout.rollout_main(_main_policy(), _sub_service(index, key), qs[:3], num_rollouts=k,
                             tokenizer=TOK, limits=LIMITS, key=key, step=step)
  exchange = Exchange(f"file://{tmp_path}/exchange")
  delegation.put_main_episodes(exchange, step, eps)
  back = delegation.read_main_episodes(exchange, step, qs[:3], k, LIMITS.max_turns)
  fields = lambda e: (e.q, e.k, e.tokens, e.loss_mask, e.logprobs, e.turns, e.observations,
                      e.final, e.failure, e.format_ok, e.policy_version,
                      e.delegation_versions, e.delegations, e.task)
  assert [fields(e) for e in back] == [fields(e) for e in eps]
  assert any(e.delegations for e in eps)
  np.testing.assert_array_equal(_outcome(back, qs[:3], k).reward,
                                _outcome(eps, qs[:3], k).reward)
  with pytest.raises(Exception, match="without its main episodes"):
    delegation.read_main_episodes(exchange, step + 1, qs[:3], k, LIMITS.max_turns)
