"""The native protocol: tool schemas, <tool_call> parsing, bad calls as recorded format
failures, the byte tokenizer's twin of Qwen3's tool template, and token-in/token-out."""

import jax
import numpy as np
import pytest

from mgrpo_jax import models
from mgrpo_jax import byte_tokenizer, offline_tokenizer, tokenizer_io
from mgrpo_jax import chat_format as cf
from mgrpo_jax.agents import continuation, experts, native, prompts, protocol, rollout
from mgrpo_jax.envs import retrieval, search, world
from mgrpo_jax.rl import rewards

from qwen3_tools_template import write_qwen3_tools_tokenizer

BYTE = byte_tokenizer.ByteTokenizer()
# A native run's byte tokenizer: the protocol's fixed strings one id each (tasks.tokenizer_words).
BYTE_NATIVE = byte_tokenizer.ByteTokenizer(words=native.vocabulary())
LIMITS = rollout.Limits(max_turns=6, max_new_tokens=160, max_len=4096, max_delegations=4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  """A real HF tokenizer with Qwen3's tool-calling chat template and <tool_call> tokens."""
  return tokenizer_io.load_tokenizer(str(write_qwen3_tools_tokenizer(tmp_path_factory.mktemp("q3"))))


@pytest.fixture(scope="module")
def env():
  w = world.generate_world(world.WorldConfig(seed=3))
  qs = world.make_questions(w, num=12, seed=1)
  return qs, retrieval.Bm25Retriever.from_documents(w.documents)


def test_each_role_declares_its_tools_as_json_schemas():
  names = {r: [t["function"]["name"] for t in native.tools(r)] for r in protocol.ROLES}
  assert names == {"main": ["delegate", "python"], "sub": ["search", "visit"],
                   "single": ["search", "visit", "python"]}
  delegate = native.tools("main")[0]["function"]["parameters"]
  assert set(delegate["properties"]) == {"subtask", "context"}
  assert delegate["required"] == ["subtask"]


@pytest.mark.parametrize("role,action,argument,think,context", [
    ("main", "delegate", "Who founded Avel?", "plan", "Avel is a city."),
    ("main", "python", "print(1 + 1)", None, None),
    ("main", "answer", "Maria Sand", "done", None),
    ("sub", "search", "Avel founder", None, None),
    ("sub", "visit", "d12", "read it", None),
    ("sub", "result", "Avel was founded by Maria Sand.", None, None),
    ("single", "search", "naïve café → 東京", None, None),
])
def test_rendered_turns_parse_back(role, action, argument, think, context):
  text = native.render_turn(action, argument, think=think, context=context)
  turn = native.parse_turn(text + cf.IM_END, role)
  assert turn == protocol.Turn(ok=True, action=action, argument=argument, context=context,
                               think=think)
  # The tag turn of the same decision renders to the same native turn.
  tags = protocol.render_action(action, argument, think=think, context=context)
  assert native.from_tags(tags, role) == text


def test_preamble_before_a_call_is_allowed_and_not_read():
  text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
  assert native.parse_turn(text, "sub") == protocol.Turn(ok=True, action="search", argument="x")


CALL = '<tool_call>\n{}\n</tool_call>'
BAD = [
    ("sub", CALL.format('{"name": "search", "arguments": {"query": "x"'), "malformed tool call JSON"),
    ("sub", CALL.format('{"name": "browse", "arguments": {"query": "x"}}'),
     "unknown tool 'browse' for the sub agent"),
    ("main", CALL.format('{"name": "search", "arguments": {"query": "x"}}'),
     "unknown tool 'search' for the main agent"),
    ("sub", CALL.format('{"name": "search", "arguments": {}}'),
     "tool 'search' is missing argument 'query'"),
    ("main", CALL.format('{"name": "delegate", "arguments": {"context": "c"}}'),
     "tool 'delegate' is missing argument 'subtask'"),
    ("sub", CALL.format('{"name": "visit", "arguments": {"page": "d1", "x": "y"}}'),
     "tool 'visit' has no argument 'x'"),
    ("sub", CALL.format('{"name": "search", "arguments": {"query": 3}}'), "not a string"),
    ("sub", CALL.format('{"name": "search", "arguments": {"query": "  "}}'), "is empty"),
    ("sub", CALL.format('["search"]'), "JSON object with a string \"name\""),
    ("sub", CALL.format('{"name": "search", "arguments": "query=x"}'), "must be a JSON object"),
    ("sub", CALL.format('{"name": "search", "arguments": {"query": "a"}}') * 2,
     "2 tool calls in one turn"),
    ("sub", '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}', "unclosed <tool_call>"),
    ("sub", CALL.format('{"name": "search", "arguments": {"query": "a"}}') + " and more",
     "text after the tool call"),
    ("sub", "report <|im_start|>user", "stray <|im_start|>"),
    ("sub", "report</think>", "a think block must come first"),
    ("main", "<think>\nhmm\n</think>\n\n", "empty final message"),
    ("main", "answer </tool_call>", "</tool_call> without <tool_call>"),
]


@pytest.mark.parametrize("role,text,reason", BAD)
def test_every_bad_call_is_a_recorded_format_failure(role, text, reason):
  turn = native.parse_turn(text, role)
  assert not turn.ok and reason in turn.error, turn.error
  validator = native.EpisodeValidator(role, max_turns=5)
  validator.step(text)
  assert validator.done and not validator.format_ok
  assert validator.failure.startswith("turn 1: ") and reason in validator.failure


def test_an_episode_ends_on_a_final_message_without_a_call():
  v = native.EpisodeValidator("sub", max_turns=5)
  v.step(native.render_turn("search", "Avel"))
  assert not v.done
  v.step("Avel was founded by Maria Sand.")
  assert v.format_ok and v.final.action == "result"
  assert v.final.argument == "Avel was founded by Maria Sand."
  assert native.parse_turn(123, "sub").error == "turn is a int, not a str"
  with pytest.raises(ValueError):
    native.parse_turn("x", "judge")


def _conversations():
  system = {"role": "system", "content": "You are an agent."}
  user = {"role": "user", "content": "Question: who?"}
  call = native.render_turn("search", "who", think="plan")
  plain = 'Looking.\n' + native.render_turn("visit", "d1")
  tool = protocol.tool_message("[d1] Doc: text")
  return [
      ([system, user], True, None),
      ([user], True, False),
      ([system, user, native.assistant_message(call), tool], True, None),
      ([system, user, native.assistant_message(call), tool, tool], False, None),
      ([user, native.assistant_message(plain), tool, native.assistant_message("It was Ann.")],
       False, None),
      ([system, user, native.assistant_message(call), tool,
        native.assistant_message("<think>\nsure\n</think>\n\nAnn")], False, None),
  ]


@pytest.mark.parametrize("role", protocol.ROLES)
def test_the_byte_tokenizers_template_renders_tools_as_qwen3s_does(qwen3, role):
  for messages, gen, thinking in _conversations():
    hf = native.render_chat(qwen3, messages, gen, role, enable_thinking=thinking)
    byte = native.render_chat(BYTE, messages, gen, role, enable_thinking=thinking)
    assert hf == byte
    assert '"name": "' + native.ROLE_TOOLS[role][0] + '"' in hf


def test_the_protocol_strings_come_from_the_rendering_and_cost_what_tags_cost():
  """The byte tokenizer's native words are what `render_chat` and `render_turn` write: a
  prompt's tool declarations are one id, and a call costs what its tag turn costs."""
  words = native.vocabulary()
  word_ids = {BYTE_NATIVE.token_id(w) for w in words}  # KeyError unless one id each.
  assert len(word_ids) == len(words) and not set(words) & set(BYTE.special_ids)
  for role in protocol.ROLES:
    declared = native.tools_text(native.tools(role))
    assert declared in words and declared in native.render_chat(BYTE, [], True, role)
    user = prompts.main_messages("Who founded Avel?")[1:]
    system_turn = BYTE_NATIVE.encode(f"{cf.IM_START}system\n{declared}{cf.IM_END}\n")
    assert len(system_turn) == 1 + len(b"system\n") + 1 + 2  # The declarations: one id.
    assert native.prompt_ids(BYTE_NATIVE, user, role) == (
        system_turn + BYTE_NATIVE.apply_chat_template(user, add_generation_prompt=True))
    assert (len(native.continuation_ids(BYTE_NATIVE, "[d3] Avel", role))
            == len(continuation.continuation_ids(BYTE, "[d3] Avel")))
  # A call: one id before its value (the tool's name in it), one after, as <search>...</search>.
  for action, argument in [("search", "Avel founder"), ("visit", "d12"),
                           ("delegate", "Who founded Avel?"), ("python", "print(1 + 1)")]:
    ids = BYTE_NATIVE.encode(native.render_turn(action, argument))
    assert ids[0] in word_ids and ids[-1] in word_ids and ids[1:-1] == list(argument.encode())
    assert len(ids) == len(BYTE.encode(protocol.render_action(action, argument)))
  ids = BYTE_NATIVE.encode(native.render_turn("delegate", "Who?", context="Avel."))
  assert len(ids) == 3 + len("Who?Avel.")  # <delegate>, <context>, </context>, </delegate>: 4.
  # A final message has no closing tag.
  assert BYTE_NATIVE.encode(native.render_turn("answer", "Maria Sand")) == list(b"Maria Sand")
  # Text that only resembles the scaffolding stays bytes.
  assert BYTE_NATIVE.encode('{"name": "search"}') == list(b'{"name": "search"}')


def test_a_template_without_tools_is_refused(tmp_path):
  plain = tokenizer_io.load_tokenizer(str(offline_tokenizer.write_test_hf_tokenizer(tmp_path, vocab_size=400)))
  with pytest.raises(continuation.TemplateError, match="renders tools"):
    native.prompt_ids(plain, native.sub_messages("x"), "sub")


class _Scripted:
  """A policy that says given turns in order (per row), as token ids."""

  version, protocol = 0, "native"

  def __init__(self, tokenizer, turns):
    self.tokenizer, self.turns, self.n = tokenizer, turns, {}

  def begin(self, episodes):
    self.episodes = episodes

  def act(self, rows, key):
    out = []
    for r in rows:
      i = self.n.get(r, 0)
      self.n[r] = i + 1
      ids = self.tokenizer.encode(self.turns[i])
      out.append((ids, [-0.5] * len(ids)))
    return out

  def append(self, appended):
    del appended


@pytest.mark.parametrize("which", ["qwen3", "byte", "byte_native"])
def test_the_live_sequence_is_what_the_template_renders(qwen3, which):
  """Token-in/token-out: the appended sequence equals the checkpoint's own template's
  render of the same conversation (tools, calls, tool messages), at every tool turn and at
  the end."""
  tok = {"qwen3": qwen3, "byte": BYTE, "byte_native": BYTE_NATIVE}[which]
  turns = [native.render_turn("search", "Avel founder", think="find the city's page"),
           "I will read it.\n" + native.render_turn("visit", "d3"),
           # A final message ends with the end of turn it generated; the engine closes calls.
           native.render_turn("result", "Maria Sand founded Avel.", think="it says so")
           + cf.IM_END]
  messages = native.sub_messages("Who founded Avel?")
  ep = rollout.new_episode(tok, "sub", messages, q=0, k=0, call=0, task=None, max_turns=5,
                           protocol_name="native")
  replies = iter(["[d3] Avel: a city <|im_end|> founded by Maria Sand.", "[d3] Avel\nFounded"])
  rollout.run_episodes(_Scripted(tok, turns), [ep], lambda pending: [next(replies)],
                       tokenizer=tok, limits=LIMITS, key=jax.random.key(0))
  assert ep.format_ok and ep.final == "Maria Sand founded Avel."
  specials = tok.special_ids
  full = native.render_chat(tok, native.conversation_messages(
      messages, ep.turns, ep.observations, specials=specials), False, "sub")
  assert tok.encode(full) == ep.tokens + tok.encode("\n")  # The template's last newline.
  assert tok.decode(ep.tokens) + "\n" == full
  # After each tool reply: the conversation so far plus the generation prompt.
  for n in (1, 2):
    partial = native.render_chat(tok, native.conversation_messages(
        messages, ep.turns[:n], ep.observations[:n], specials=specials), True, "sub")
    assert tok.decode(ep.tokens).startswith(partial)
  # The loss mask covers exactly the generated turns.
  mask = np.asarray(ep.loss_mask, bool)
  assert tok.decode(np.asarray(ep.tokens)[mask]) == "".join(ep.turns)
  if which == "qwen3":  # One token each, so generation stops on an id.
    assert native.stop_token_ids(tok, "sub")[0] == tok.token_id("</tool_call>")


def test_experts_in_native_make_the_same_decisions_as_in_tags(env):
  qs, index = env

  def run(name):
    main = rollout.ExpertPolicy(experts.MainExpert(noise=0.2), BYTE, seed=1, protocol=name)
    sub = rollout.ExpertPolicy(experts.SubExpert(noise=0.2), BYTE, seed=2, protocol=name)
    service = rollout.ColocatedSubAgent(sub, BYTE, search.local_tools(index), limits=LIMITS,
                                        key=jax.random.key(7))
    eps = rollout.rollout_main(main, service, qs, num_rollouts=2, tokenizer=BYTE,
                               limits=LIMITS, key=jax.random.key(0))
    return eps, service.episodes

  (tags, tag_subs), (nat, nat_subs) = run("tags"), run("native")
  assert [e.final for e in nat] == [e.final for e in tags]
  assert [e.observations for e in nat] == [e.observations for e in tags]
  assert [e.actions for e in nat] == [e.actions for e in tags]
  assert [s.actions for s in nat_subs] == [s.actions for s in tag_subs]
  assert all(e.format_ok for e in nat + nat_subs) and all(e.protocol == "native" for e in nat)
  assert all("<tool_call>" in e.turns[0] and "<delegate>" not in e.turns[0] for e in nat)
  accuracy = lambda eps: np.mean([rewards.exact_match(e.final or "", qs[e.q].answer)
                                  for e in eps])
  assert accuracy(nat) == accuracy(tags) >= 0.25  # Noisy experts: some answers wrong.


def test_a_random_llm_speaks_native_through_the_engine(env):
  """An LLM policy in the native protocol: turns stop at </tool_call> or the end of turn,
  and every episode ends, nearly always as a recorded format failure."""
  qs, index = env
  cfg = models.get_preset("tiny", vocab_size=BYTE.vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  limits = rollout.Limits(max_turns=2, max_new_tokens=16, max_len=2048, max_delegations=2)
  policy = rollout.LLMPolicy(cfg, params, BYTE, "single", limits=limits, protocol="native")
  assert policy.stop_strings == ("</tool_call>", *protocol.END_OF_TURN)
  eps = rollout.rollout_single(policy, qs[:2], num_rollouts=2, tokenizer=BYTE, limits=limits,
                               key=jax.random.key(3), tools=search.local_tools(index))
  for e in eps:
    assert e.done and e.protocol == "native"
    assert e.format_ok or e.failure
    prompt = e.tokens[:e.loss_mask.index(1)] if 1 in e.loss_mask else e.tokens
    assert "<tools>\n" in BYTE.decode(prompt)  # The tools' schemas, rendered in the prompt.
