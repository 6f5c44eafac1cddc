"""Tests for mgrpo_jax.tokenizer: byte tokenizer, HF tokenizer directories, Qwen3 chat format."""

import re
import unicodedata

import hypothesis
import pytest
from hypothesis import strategies as st

from mgrpo_jax import byte_tokenizer, chat_format, hf_tokenizer, offline_tokenizer, tokenizer_io
from mgrpo_jax import tokenizer as tk

SPECIALS = chat_format.CONTROL_TOKENS + chat_format.PROTOCOL_TAGS

THREE_MESSAGES = [
    {
        "role": "system",
        "content": "You are helpful."
    },
    {
        "role": "user",
        "content": "What is 2+2?"
    },
    {
        "role": "assistant",
        "content": "4"
    },
]
# Written by hand from Qwen3's template: the final assistant turn (after the last user query)
# gets an empty think block.
THREE_MESSAGES_TEXT = ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                       "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                       "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
PROMPT_TEXT = ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
               "<|im_start|>assistant\n")

# Mixed text: arbitrary unicode interleaved with the special strings and fragments of them.
mixed_text = st.lists(
    st.one_of(st.text(), st.sampled_from(SPECIALS), st.sampled_from(["<", "</", "<|", ">",
                                                                     "|>"]))).map("".join)


@pytest.fixture(scope="module")
def byte_tok():
  return byte_tokenizer.ByteTokenizer()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return offline_tokenizer.write_test_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"),
                                                   vocab_size=600)


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
  return tokenizer_io.load_tokenizer(hf_dir)


# ------------------------------------------------------------------------------ ByteTokenizer


@hypothesis.given(text=mixed_text)
def test_byte_round_trip(byte_tok, text):
  assert byte_tok.decode(byte_tok.encode(text)) == text


@hypothesis.given(text=st.text())
def test_byte_plain_text_is_utf8_bytes(byte_tok, text):
  hypothesis.assume(not any(s in text for s in SPECIALS))
  assert byte_tok.encode(text) == list(text.encode("utf-8"))


def test_byte_special_strings_are_single_ids(byte_tok):
  ids = [byte_tok.encode(s) for s in SPECIALS]
  assert all(len(i) == 1 for i in ids)
  flat = [i[0] for i in ids]
  assert flat == list(range(256, 256 + len(SPECIALS)))
  assert byte_tok.vocab_size == 256 + len(SPECIALS)
  assert byte_tok.special_ids == dict(zip(SPECIALS, flat))
  assert byte_tok.token_id("</delegate>") == byte_tok.special_ids["</delegate>"]


def test_byte_specials_inside_text_and_longest_match():
  tok = byte_tokenizer.ByteTokenizer(tags=("<a>", "<a>b"))
  a, ab = tok.token_id("<a>"), tok.token_id("<a>b")
  assert tok.encode("x<a>bc<a>") == [ord("x"), ab, ord("c"), a]
  ids = byte_tokenizer.ByteTokenizer().encode("<<think>>")
  assert ids == [ord("<"), byte_tokenizer.ByteTokenizer().token_id("<think>"), ord(">")]


def test_byte_ids_and_padding(byte_tok):
  ids = byte_tok.special_ids
  assert byte_tok.eos_id == ids["<|im_end|>"]
  assert byte_tok.pad_id == ids["<pad>"]
  assert byte_tok.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
  assert byte_tok.vocab_size == 278
  assert byte_tok.padded_vocab_size() == 384
  assert byte_tok.padded_vocab_size(8) == 280
  assert isinstance(byte_tok, tk.Tokenizer)


def test_byte_decode_skip_special_drops_control_keeps_tags(byte_tok):
  ids = byte_tok.encode("<|im_start|>assistant\n<answer>é</answer><|im_end|><pad>")
  assert byte_tok.decode(ids, skip_special=True) == "assistant\n<answer>é</answer>"


def test_byte_decode_bad_input(byte_tok):
  assert byte_tok.decode([0xC3]) == "\ufffd"  # A truncated 2-byte character.
  # Ids past the vocabulary (padded embeddings) are visible garbage, not an exception.
  assert byte_tok.decode([65, byte_tok.vocab_size, 66]) == "A\ufffdB"
  with pytest.raises(KeyError):
    byte_tok.token_id("ab")


def test_byte_chat_template_exact(byte_tok):
  assert byte_tok.render_chat(THREE_MESSAGES, False) == THREE_MESSAGES_TEXT
  ids = byte_tok.apply_chat_template(THREE_MESSAGES[:2], add_generation_prompt=True)
  im_start, im_end = byte_tok.token_id("<|im_start|>"), byte_tok.token_id("<|im_end|>")
  assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
  assert ids[-len("assistant\n") - 1:] == [im_start, *b"assistant\n"]
  assert byte_tok.decode(ids) == PROMPT_TEXT


# -------------------------------------------------------------------------- chat format rules

CONVERSATIONS = [
    # History assistant turns lose their reasoning; the final one keeps it.
    [
        {
            "role": "user",
            "content": "q1"
        },
        {
            "role": "assistant",
            "content": "<think>\nr1\n</think>\n\na1"
        },
        {
            "role": "user",
            "content": "q2"
        },
        {
            "role": "assistant",
            "content": "<think>r2</think>a2"
        },
    ],
    # Consecutive tool messages share one user turn; tool output does not count as a query.
    [
        {
            "role": "system",
            "content": "s"
        },
        {
            "role": "user",
            "content": "q"
        },
        {
            "role": "assistant",
            "content": "call"
        },
        {
            "role": "tool",
            "content": "t1"
        },
        {
            "role": "tool",
            "content": "t2"
        },
        {
            "role": "assistant",
            "content": "done",
            "reasoning_content": "why"
        },
    ],
    [{
        "role": "user",
        "content": "<tool_response>x</tool_response>"
    }],
    [{
        "role": "user",
        "content": "a"
    }, {
        "role": "system",
        "content": "late system"
    }],
]
CONVERSATION_TEXTS = [
    "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
    "<|im_start|>user\nq2<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n",
    "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
    "<|im_start|>assistant\ncall<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nt1\n</tool_response>\n<tool_response>\nt2\n</tool_response>"
    "<|im_end|>\n<|im_start|>assistant\n<think>\nwhy\n</think>\n\ndone<|im_end|>\n",
    "<|im_start|>user\n<tool_response>x</tool_response><|im_end|>\n",
    "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nlate system<|im_end|>\n",
]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_python_renderer_matches_jinja_template(hf_tok, index):
  messages = CONVERSATIONS[index]
  assert chat_format.render_qwen3_chat(messages, False) == CONVERSATION_TEXTS[index]
  for prompt in (False, True):
    for thinking in (None, True, False):
      expected = chat_format.render_qwen3_chat(messages, prompt, enable_thinking=thinking)
      assert hf_tok.render_chat(messages, prompt, enable_thinking=thinking) == expected


def test_generation_prompt_thinking_switch():
  messages = [{"role": "user", "content": "hi"}]
  base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert chat_format.render_qwen3_chat(messages, True) == base
  assert chat_format.render_qwen3_chat(messages, True, enable_thinking=True) == base
  assert chat_format.render_qwen3_chat(messages, True,
                              enable_thinking=False) == (base + "<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "message",
    [{
        "role": "robot",
        "content": "x"
    }, {
        "role": "user",
        "content": None
    }, {
        "role": "assistant",
        "content": "",
        "tool_calls": [{
            "name": "f"
        }]
    }],
)  # fmt: skip
def test_unsupported_messages_raise(hf_tok, message):
  with pytest.raises(ValueError):
    chat_format.render_qwen3_chat([message], False)
  with pytest.raises(Exception):  # jinja's TemplateError, via HF.
    hf_tok.render_chat([message], False)


# ------------------------------------------------------------------------------- HFTokenizer


def test_hf_directory_loads_with_auto_tokenizer(hf_dir):
  from transformers import AutoTokenizer

  assert (hf_dir / "tokenizer.json").exists() and (hf_dir / "tokenizer_config.json").exists()
  auto = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
  assert auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>"
  text = auto.apply_chat_template(THREE_MESSAGES, tokenize=False)
  assert text == THREE_MESSAGES_TEXT


def test_hf_load_tokenizer_and_ids(hf_tok):
  assert isinstance(hf_tok, hf_tokenizer.HFTokenizer) and isinstance(hf_tok, tk.Tokenizer)
  ids = hf_tok.special_ids
  assert set(SPECIALS) - {"<pad>"} == set(ids)
  # As in Qwen3, the added tokens come after the trained BPE vocabulary, in order.
  first = ids["<|endoftext|>"]
  assert [ids[s] for s in SPECIALS if s != "<pad>"] == list(range(first, hf_tok.vocab_size))
  assert hf_tok.eos_id == ids["<|im_end|>"]
  assert hf_tok.pad_id == ids["<|endoftext|>"]
  assert hf_tok.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
  assert hf_tok.padded_vocab_size() % 128 == 0 >= hf_tok.vocab_size - hf_tok.padded_vocab_size()


def test_hf_special_strings_are_single_ids(hf_tok):
  for s in SPECIALS[:3] + chat_format.PROTOCOL_TAGS:
    assert hf_tok.encode(s) == [hf_tok.special_ids[s]]
    assert hf_tok.encode(f"ab{s}cd").count(hf_tok.special_ids[s]) == 1
  text = "<|im_start|>assistant\n<answer>é</answer><|im_end|>"
  assert hf_tok.decode(hf_tok.encode(text), skip_special=True) == "assistant\n<answer>é</answer>"


@hypothesis.settings(deadline=None)
@hypothesis.given(text=mixed_text.filter(lambda t: "<pad>" not in t))
# transformers 4's space cleanup rewrites the first example; NFC changes the second.
@hypothesis.example(text="Hi , it 's x . y ! n't")
@hypothesis.example(text="cafe\u0301 <think>\u212b</think>")
def test_hf_round_trip(hf_tok, text):
  # Qwen3's tokenizer normalises to NFC, so the round trip is exact up to NFC.
  assert hf_tok.decode(hf_tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_hf_chat_template_exact(hf_tok):
  assert hf_tok.render_chat(THREE_MESSAGES, False) == THREE_MESSAGES_TEXT
  ids = hf_tok.apply_chat_template(THREE_MESSAGES[:2], add_generation_prompt=True)
  assert hf_tok.decode(ids) == PROMPT_TEXT
  im_start = hf_tok.token_id("<|im_start|>")
  header = [im_start, *hf_tok.encode("assistant\n")]
  assert ids[-len(header):] == header
  assert ids.count(im_start) == 3 and ids.count(hf_tok.eos_id) == 2


def test_hf_custom_texts_and_generation_config(tmp_path):
  directory = offline_tokenizer.write_test_hf_tokenizer(tmp_path, texts=["aaa bbb"] * 10,
                                                        tags=("<x>",))
  (directory / "generation_config.json").write_text('{"eos_token_id": [5, 6]}')
  tok = hf_tokenizer.HFTokenizer(directory)
  assert tok.encode("<x>") == [tok.special_ids["<x>"]]
  assert tok.stop_ids[2:] == (5, 6) and tok.stop_ids[0] == tok.eos_id


def test_missing_directory_error_names_path(tmp_path):
  missing = tmp_path / "no_such_model"
  with pytest.raises(FileNotFoundError, match="no_such_model"):
    tokenizer_io.load_tokenizer(missing)
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"empty.*tokenizer_config\.json.*tokenizer\.json"):
    hf_tokenizer.HFTokenizer(tmp_path / "empty")


def test_load_tokenizer_byte():
  assert isinstance(tokenizer_io.load_tokenizer("byte"), byte_tokenizer.ByteTokenizer)


# --------------------------------------------------------------------------- words (names)

WORDS = ("Avel", "Aveland", "doc007", "Pesti Pictures", "é-town", "Where is ", " lie?")


@hypothesis.given(text=st.lists(st.one_of(mixed_text, st.sampled_from(WORDS + (" ", "x")))).map(
    "".join))
def test_words_round_trip(text):
  tok = byte_tokenizer.ByteTokenizer(words=WORDS)
  assert tok.decode(tok.encode(text)) == text


def test_words_are_one_id_between_non_alphanumerics():
  tok = byte_tokenizer.ByteTokenizer(words=WORDS)
  base = byte_tokenizer.ByteTokenizer().vocab_size
  assert tok.vocab_size == base + len(WORDS)
  word_id = {w: base + i for i, w in enumerate(WORDS)}
  assert tok.encode("Avel") == [word_id["Avel"]]
  # Longest match, and never inside a longer word or a number.
  assert tok.encode("Aveland.") == [word_id["Aveland"], ord(".")]
  assert tok.encode("Avelands") == list(b"Avelands")
  assert tok.encode("xAvel") == list(b"xAvel")
  assert tok.encode("doc0071") == list(b"doc0071")
  assert tok.encode("[doc007]") == [ord("["), word_id["doc007"], ord("]")]
  assert tok.encode("<search>Pesti Pictures</search>") == [
      tok.token_id("<search>"), word_id["Pesti Pictures"], tok.token_id("</search>")]
  # A word that ends (starts) in a space or punctuation needs no boundary there.
  assert tok.encode("Where is Avel lie?") == [word_id["Where is "], word_id["Avel"],
                                              word_id[" lie?"]]
  assert tok.encode("xWhere is Avel") == list(b"xWhere is ") + [word_id["Avel"]]


# Prefixes of each other, with and without boundaries: where the trie must backtrack.
TRIE_WORDS = WORDS + ("Ave", "Avel-", "Aveland Pictures", "doc0", "é", "is A", "  ")


def _alternation(words):
  """The reference: one alternation of every word, longest first, each with its boundaries."""
  edge = lambda ch: "[^\\W_]" if ch.isalnum() else None
  return re.compile("|".join(
      (f"(?<!{edge(w[0])})" if edge(w[0]) else "") + re.escape(w) +
      (f"(?!{edge(w[-1])})" if edge(w[-1]) else "")
      for w in sorted(words, key=len, reverse=True)))


@hypothesis.given(text=st.lists(st.one_of(
    mixed_text, st.sampled_from(TRIE_WORDS + (" ", "x", "s", "1", "-", "_"))), max_size=12).map(
        "".join))
def test_words_pattern_finds_what_the_longest_first_alternation_finds(text):
  spans = lambda pattern: [(m.start(), m.group()) for m in pattern.finditer(text)]
  assert spans(byte_tokenizer.words_pattern(TRIE_WORDS)) == spans(_alternation(TRIE_WORDS))


@hypothesis.given(
    words=st.lists(st.text(st.sampled_from("Aa1é_-. (*\u0301"), min_size=1, max_size=5),
                   min_size=1, max_size=8, unique=True),
    text=st.text(st.sampled_from("Aa1é_-. (*\u0301"), max_size=30))
def test_words_pattern_matches_the_alternation_for_any_words(words, text):
  spans = lambda pattern: [(m.start(), m.group()) for m in pattern.finditer(text)]
  assert spans(byte_tokenizer.words_pattern(words)) == spans(_alternation(words))


def test_words_pattern_takes_long_words():
  long = "Pesti Pictures of the River " * 100
  assert byte_tokenizer.words_pattern([long, long[:-1] + "x"]).fullmatch(long)


def test_words_are_text_not_specials():
  tok = byte_tokenizer.ByteTokenizer(words=WORDS)
  assert not set(WORDS) & set(tok.special_ids)
  ids = tok.encode("<|im_start|>Avel<|im_end|>")
  assert tok.decode(ids, skip_special=True) == "Avel"
  # A tool reply escapes the special strings in it, never a word.
  assert "Avel" in chat_format.render_qwen3_chat([{"role": "tool", "content": "Avel"}], False)


@pytest.mark.parametrize("words", [("",), (" ",), ("a", "a"), ("<answer>",)])
def test_bad_words_raise(words):
  with pytest.raises(ValueError, match="words must be distinct"):
    byte_tokenizer.ByteTokenizer(words=words)


@pytest.mark.parametrize("spec", ["byte+names", "byte+world"])
def test_load_tokenizer_byte_words(spec):
  tok = tokenizer_io.load_tokenizer(spec, words=WORDS)
  assert tok.words == WORDS
  with pytest.raises(ValueError, match=spec.replace("+", "\\+")):
    tokenizer_io.load_tokenizer(spec)


@pytest.mark.parametrize("spec", ["byte", "byte+names", "byte+world", "byte+phrases",
                                  "byte+phrases+ids"])
def test_a_native_run_adds_the_protocol_strings_and_a_tags_run_keeps_its_words(spec):
  from mgrpo_jax.agents import native
  from mgrpo_jax.envs import world
  from mgrpo_jax.mgrpo import tasks

  the_world = world.generate_world(world.WorldConfig(seed=3))
  tags = tasks.tokenizer_words(spec, the_world)
  assert tasks.tokenizer_words(spec, the_world, "tags") == tags
  assert (spec == "byte") == (tags == ())
  # The tags' and the world's ids stay where they were; the protocol's come after them.
  words = tasks.tokenizer_words(spec, the_world, "native")
  assert words == tags + native.vocabulary()
  tok = tokenizer_io.load_tokenizer(spec, words=words)
  assert tok.words == words
  assert all(len(tok.encode(w)) == 1 for w in native.vocabulary())
  assert tasks.tokenizer_words("/ckpt/Qwen3-0.6B", the_world, "native") == ()  # Its own tokens.


def test_tokenizer_follows_the_checkpoint(hf_dir, tmp_path):
  """config.tokenizer '': the checkpoint's own tokenizer; a named one wins; no files: an error."""
  assert tokenizer_io.resolve_spec("", str(hf_dir)) == str(hf_dir)
  assert tokenizer_io.resolve_spec("", "") == "byte"
  assert tokenizer_io.resolve_spec("byte+world", str(hf_dir)) == "byte+world"
  with pytest.raises(FileNotFoundError, match="checkpoint's own tokenizer.*no tokenizer files"):
    tokenizer_io.resolve_spec("", str(tmp_path))
  assert hf_tokenizer.has_tokenizer_files(hf_dir) and not hf_tokenizer.has_tokenizer_files(tmp_path)


def test_saved_tokenizer_loads_with_auto_tokenizer_and_tokenizes_alike(hf_tok, tmp_path):
  from transformers import AutoTokenizer

  assert not tokenizer_io.save_tokenizer(byte_tokenizer.ByteTokenizer(), tmp_path / "byte")
  assert tokenizer_io.save_tokenizer(hf_tok, tmp_path / "export")
  auto = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
  text = "<|im_start|>user\nWho wrote Brand?<|im_end|>\n<search>Brand author</search>"
  assert auto.encode(text, add_special_tokens=False) == hf_tok.encode(text)
  chat = [{"role": "user", "content": "Q"}]
  assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
      hf_tok.render_chat(chat, True)
  assert "byte tokenizer" in tokenizer_io.describe(byte_tokenizer.ByteTokenizer())
  assert str(hf_tok.directory) in tokenizer_io.describe(hf_tok)
