"""Tests for mgrpo_jax.sampling: HF parity, behaviour log-probs, stops, multi-turn, sharding.

Every model here is a tiny randomised HF `Qwen3ForCausalLM` written once per module and read
back with `models.load_hf`, so the sampler runs on the same weights as the torch reference.
Prompts are at most 16 tokens and completions at most 32, so most calls share one compiled
(prefill, decode) pair; the no-recompilation test relies on the jit caches being shared.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import kv_cache_plan, models, sampling
from mgrpo_jax.sharding import make_mesh, param_shardings

N_NEW = 32  # New tokens in the parity tests (>= 32, as the sampler's contract promises).
# Unequal prompt lengths; 16 fills the smallest prompt bucket. Eight rows everywhere, so the
# sharded tests' unsharded reference reuses the compiled functions of the other tests.
LENS = (5, 11, 3, 16, 8, 1, 13, 9)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A tiny Qwen3; prime-ish sizes, num_heads * head_dim != hidden."""

    vocab: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    tie: bool
    layers: int = 2
    seed: int = 0


SPECS = {
    # Divisible by fsdp=2 / tensor=2, so the sharding test really splits parameters.
    "untied": Spec(vocab=136, hidden=48, inter=80, heads=4, kv_heads=2, head_dim=12, tie=False),
    "tied": Spec(vocab=131, hidden=46, inter=58, heads=6, kv_heads=3, head_dim=14, tie=True,
                 seed=1),
}


def _build_hf(spec: Spec):
    """A float32 eval-mode torch model with every parameter re-drawn (norms included)."""
    import torch
    import transformers

    hf_config = transformers.Qwen3Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.inter,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        tie_word_embeddings=spec.tie, rope_theta=10_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=512, attn_implementation="eager")
    torch.manual_seed(spec.seed)
    model = transformers.Qwen3ForCausalLM(hf_config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            # Large weights and non-unit norms keep greedy decoding away from repeats and ties.
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.3 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@dataclasses.dataclass
class Model:
    hf: object
    config: models.Qwen3Config
    params: object
    vocab: int


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> Model, written by transformers and loaded by `models.load_hf`."""
    import torch

    # Torch's intra-op threads fight XLA's for two cores: ~20x slower tiny forwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for name, spec in SPECS.items():
        hf = _build_hf(spec)
        path = tmp_path_factory.mktemp(f"sampling_{name}")
        hf.save_pretrained(str(path))
        config, params = models.load_hf(str(path))
        assert config.tie_embeddings == spec.tie
        out[name] = Model(hf, config, params, spec.vocab)
    yield out
    torch.set_num_threads(threads)


def _prompts(vocab, lens=LENS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lens]


def _hf_greedy(hf, prompt, n):
    import torch

    ids = torch.as_tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _full_logits(m: Model, rows):
    """Float32 [B, T, V] logits of `models.logits` (no cache) on right-padded rows."""
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], mask[i, :len(r)] = r, 1
    return np.asarray(models.logits(m.config, m.params, jnp.asarray(tokens), jnp.asarray(mask)))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_truncated_log_softmax(scaled_V, top_k, top_p):
    """Reference top-k then nucleus: keep a token if the mass of higher tokens is < top_p."""
    order = np.argsort(-scaled_V, kind="stable")
    probs = np.exp(_log_softmax(scaled_V))[order]
    keep = np.zeros_like(scaled_V, bool)
    mass = 0.0
    for rank, (tok, p) in enumerate(zip(order, probs)):
        if (top_k > 0 and rank >= top_k) or mass >= top_p:
            break
        keep[tok] = True
        mass += p
    return _log_softmax(np.where(keep, scaled_V, -np.inf))


def _rows(res, prompts):
    """prompt + completion of each row."""
    return [list(p) + res.tokens[i, :res.lengths[i]].tolist() for i, p in enumerate(prompts)]


# ----------------------------------------------------------------------- 1. HF parity


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_greedy_matches_hf_generate(tiny, name):
    m = tiny[name]
    prompts = _prompts(m.vocab, seed=3)
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0)
    assert res.tokens.shape == (len(prompts), N_NEW)
    np.testing.assert_array_equal(res.lengths, [N_NEW] * len(prompts))
    assert res.finish_reasons == ["length"] * len(prompts)
    for i, p in enumerate(prompts):
        expected = _hf_greedy(m.hf, p, N_NEW)
        assert res.tokens[i].tolist() == expected, f"row {i} (prompt length {len(p)})"
    # The random model must not be degenerate, or the comparison proves little.
    assert len(set(res.tokens.ravel().tolist())) > 20


def test_split_decode_attention_matches_hf_generate(tiny):
    # Flash-decoding (the cache read in 3 chunks at once) must pick the same greedy tokens.
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=3)[:2]
    cfg = m.config.replace(decode_splits=3)
    res = sampling.generate(cfg, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0)
    for i, p in enumerate(prompts):
        assert res.tokens[i].tolist() == _hf_greedy(m.hf, p, N_NEW), f"row {i}"


def test_gpu_decode_options_compile_and_keep_the_tokens(tiny, monkeypatch):
    # The options the project sets on a GPU's decode loop are real XLA options (a misspelt
    # one fails to compile) that change no token: run them here, on this backend.
    assert sampling.xla_options.decode("gpu") and not sampling.xla_options.decode("cpu")
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=3)[:2]
    want = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW,
                             temperature=0.0).tokens
    gpu_options = sampling.xla_options.decode("gpu")
    monkeypatch.setattr(sampling.xla_options, "decode", lambda backend=None: gpu_options)
    sampling.decode_jit.cache_clear()
    try:
        jitted = sampling.decode_jit(jax.default_backend())
        got = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW,
                                temperature=0.0).tokens
        assert jitted._cache_size() >= 1  # The optioned loop is the one that ran.
    finally:
        sampling.decode_jit.cache_clear()
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------- 2. behaviour log-probs


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, 0), (0.7, 0.9, 50)])
def test_logprobs_match_recomputed_forward(tiny, temperature, top_p, top_k):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=4)
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW,
                            temperature=temperature, top_p=top_p, top_k=top_k,
                            key=jax.random.key(7))
    logits = _full_logits(m, _rows(res, prompts))
    t = temperature if temperature > 0 else 1.0
    for i, p in enumerate(prompts):
        n = int(res.lengths[i])
        assert n == N_NEW
        step_logits = logits[i, len(p) - 1:len(p) - 1 + n] / t  # predict completion token j
        toks = res.tokens[i, :n]
        logp = np.take_along_axis(_log_softmax(step_logits), toks[:, None], -1)[:, 0]
        np.testing.assert_allclose(res.logprobs[i, :n], logp, atol=1e-4, err_msg=f"row {i}")
        if temperature == 0:
            assert (toks == step_logits.argmax(-1)).all()
            np.testing.assert_array_equal(res.sample_logprobs[i], 0.0)
        else:
            ref = np.array([_np_truncated_log_softmax(s, top_k, top_p)[tok]
                            for s, tok in zip(step_logits, toks)])
            np.testing.assert_allclose(res.sample_logprobs[i, :n], ref, atol=1e-4)
    assert (res.logprobs <= 0).all() and (res.sample_logprobs <= 1e-6).all()
    if temperature > 0:
        # Truncation renormalises over fewer tokens: never less likely, and with top-k 50 of
        # 136 tokens strictly more likely at every step.
        assert (res.sample_logprobs > res.logprobs + 1e-6).all()


# ---------------------------------------------------------------- 3. no recompilation


def test_sampling_settings_do_not_recompile(tiny):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=5)

    def run(**kw):
        return sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, **kw)

    run(temperature=0.0)
    decode = sampling.decode_jit(jax.default_backend())
    sizes = (decode._cache_size(), sampling.prefill_rows._cache_size())
    for kw in [dict(temperature=1.0, key=jax.random.key(1)),
               dict(temperature=0.7, top_p=0.9, top_k=50, key=jax.random.key(2)),
               dict(temperature=1.3, top_k=1, stop_token_ids=[3, 4, 5]),
               dict(temperature=0.0, top_p=0.01, stop_token_ids=[17])]:
        run(**kw)
        assert (decode._cache_size(), sampling.prefill_rows._cache_size()) == sizes, kw


# ------------------------------------------------------------------------- 4. stops


@pytest.fixture(scope="module")
def greedy_ref(tiny):
    """Greedy completions of the shared prompts, with no stops."""
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=6)
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0)
    return prompts, res.tokens


def _first(row, tok):
    hits = np.flatnonzero(row == tok)
    return int(hits[0]) if hits.size else None


def test_stop_token_ids_stop_rows_independently(tiny, greedy_ref):
    m = tiny["untied"]
    prompts, ref = greedy_ref
    # Stop ids: tokens that first occur in row 1 (resp. 2) mid-way, and never in row 0.
    stops = []
    for row in (1, 2):
        stops.append(next(int(t) for j, t in enumerate(ref[row])
                          if 4 <= j <= 20 and _first(ref[row], t) == j
                          and _first(ref[0], t) is None and int(t) not in stops))
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            stop_token_ids=stops)
    for i in range(len(prompts)):
        hits = [j for j in (_first(ref[i], s) for s in stops) if j is not None]
        n = min(hits) + 1 if hits else N_NEW
        assert res.lengths[i] == n, f"row {i}"
        assert res.finish_reasons[i] == ("stop" if hits else "length")
        np.testing.assert_array_equal(res.tokens[i, :n], ref[i, :n])  # stop token included
        np.testing.assert_array_equal(res.tokens[i, n:], 0)
        np.testing.assert_array_equal(res.logprobs[i, n:], 0.0)
    assert res.finish_reasons[0] == "length" and res.lengths[0] == N_NEW
    assert res.finish_reasons[1] == res.finish_reasons[2] == "stop"


class _BracketTokenizer:
    """Decodes id t as "[t]", so a stop string can straddle token boundaries."""

    @staticmethod
    def decode(ids):
        return "".join(f"[{int(t)}]" for t in ids)


def _expected_cut(row, stop):
    text = ""
    for j, t in enumerate(row):
        text += f"[{int(t)}]"
        if stop in text:
            return j + 1
    return None


@pytest.mark.parametrize("chunk", [64, 4])
def test_stop_strings_cut_row_and_refresh_next_logits(tiny, greedy_ref, chunk):
    m = tiny["untied"]
    prompts, ref = greedy_ref
    # Straddles tokens 6 and 7 of row 3: "…6]" + "[7…" -> cut after token 7 (n = 8).
    stop = f"{ref[3, 6]}][{ref[3, 7]}"
    cut = [_expected_cut(r, stop) for r in ref]
    assert cut[3] is not None and cut[3] <= 8 and cut.count(None) >= 1
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            stop_strings=[stop], tokenizer=_BracketTokenizer(), chunk=chunk)
    for i in range(len(prompts)):
        n = cut[i] or N_NEW
        assert res.lengths[i] == n, f"row {i}"
        assert res.finish_reasons[i] == ("stop_string" if cut[i] else "length")
        np.testing.assert_array_equal(res.tokens[i, :n], ref[i, :n])
        np.testing.assert_array_equal(res.tokens[i, n:], 0)
    seqs = res.sequences
    np.testing.assert_array_equal(np.asarray(seqs.lengths_B)[:len(prompts)],
                                  [len(p) + n for p, n in zip(prompts, res.lengths)])
    # next_logits of every row (cut ones re-extended) follow exactly the kept tokens.
    rows = _rows(res, prompts)
    full = _full_logits(m, rows)
    last = np.array([full[i, len(r) - 1] for i, r in enumerate(rows)])
    np.testing.assert_allclose(np.asarray(seqs.next_logits_BxV)[:len(prompts)], last,
                               atol=1e-4, rtol=1e-4)


def test_stop_string_before_stop_token_in_same_chunk_wins(tiny, greedy_ref):
    """The earliest stop ends a row, even when a stop token follows in the same chunk."""
    m = tiny["untied"]
    prompts, ref = greedy_ref
    stop = f"[{ref[3, 4]}][{ref[3, 5]}]"
    n_string = _expected_cut(ref[3], stop)
    stop_id = next(int(t) for j, t in enumerate(ref[3])
                   if j > n_string + 2 and _first(ref[3], t) == j)
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            stop_strings=[stop], tokenizer=_BracketTokenizer(),
                            stop_token_ids=[stop_id])
    assert res.finish_reasons[3] == "stop_string"
    assert res.lengths[3] == n_string


class _BytesTokenizer:
    """Byte-level decoding: ids `a`, `b` are the two UTF-8 bytes of "é", others "[t]"."""

    def __init__(self, a, b):
        self.pieces = {a: b"\xc3", b: b"\xa9"}

    def decode(self, ids):
        raw = b"".join(self.pieces.get(int(t), f"[{int(t)}]".encode()) for t in ids)
        return raw.decode("utf-8", errors="replace")


def test_stop_string_split_inside_a_character(tiny, greedy_ref):
    m = tiny["untied"]
    prompts, ref = greedy_ref
    j = next(j for j in range(3, 20) if ref[3, j] != ref[3, j + 1]
             and not np.isin(ref[3, j:j + 2], ref[3, :j]).any())
    tok = _BytesTokenizer(int(ref[3, j]), int(ref[3, j + 1]))
    # Reference: the shortest prefix whose decoded text holds the stop string.
    cut = [next((k for k in range(1, N_NEW + 1) if "é" in tok.decode(r[:k])), None) for r in ref]
    assert cut[3] == j + 2
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            stop_strings=["é"], tokenizer=tok)
    np.testing.assert_array_equal(res.lengths, [c or N_NEW for c in cut])
    assert res.finish_reasons[3] == "stop_string"


# -------------------------------------------------------------- 5. multi-turn, context


def test_multi_turn_extend_matches_decoding_from_scratch(tiny):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=8)
    n1, n2 = 20, 17  # Both bucket to 32 columns, like N_NEW: no new decode compile.
    turn1 = sampling.generate(m.config, m.params, prompts, max_new_tokens=n1, temperature=0.0,
                              max_len=64)
    rng = np.random.default_rng(9)
    tool = [rng.integers(1, m.vocab, size=c).tolist() for c in (3, 0, 7, 1, 5, 2, 0, 4)]
    seqs = sampling.extend(m.config, m.params, turn1.sequences, tool)
    np.testing.assert_array_equal(np.asarray(seqs.lengths_B),
                                  [len(p) + n1 + len(t) for p, t in zip(prompts, tool)])
    turn2 = sampling.sample(m.config, m.params, seqs, num_rows=len(prompts), max_new_tokens=n2,
                            temperature=0.0)
    full = [r + t for r, t in zip(_rows(turn1, prompts), tool)]
    scratch = sampling.generate(m.config, m.params, full, max_new_tokens=n2, temperature=0.0)
    np.testing.assert_array_equal(turn2.tokens, scratch.tokens)
    np.testing.assert_allclose(turn2.logprobs, scratch.logprobs, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(turn2.sequences.lengths_B),
                                  [len(r) + n2 for r in full])


LONG_LENS = (40, 20, 50, 33, 60, 35, 45, 63)  # Prompt bucket 64 = the cache: one compile.


def _teacher_forced_argmax(m, prompts, res):
    """Per row, the argmax of the full forward at each generated position."""
    logits = _full_logits(m, _rows(res, prompts))
    return [logits[i, len(p) - 1:len(p) - 1 + res.lengths[i]].argmax(-1)
            for i, p in enumerate(prompts)]


def test_context_overflow_ends_rows_and_extend_refuses(tiny):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, lens=LONG_LENS, seed=12)
    max_len = 64
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            max_len=max_len)
    for i, (p, greedy) in enumerate(zip(prompts, _teacher_forced_argmax(m, prompts, res))):
        n = min(N_NEW, max_len - len(p))
        assert res.lengths[i] == n, f"row {i}"
        assert res.finish_reasons[i] == ("context" if n < N_NEW else "length"), f"row {i}"
        np.testing.assert_array_equal(res.tokens[i, :n], greedy)
    assert "context" in res.finish_reasons and "length" in res.finish_reasons
    np.testing.assert_array_equal(np.asarray(res.sequences.lengths_B),
                                  [len(p) + n for p, n in zip(prompts, res.lengths)])
    room = max_len - np.asarray(res.sequences.lengths_B)
    extra = [[1] * (int(r) + (i == 2)) for i, r in enumerate(room)]  # Row 2 overflows by one.
    with pytest.raises(ValueError, match="Row 2"):
        sampling.extend(m.config, m.params, res.sequences, extra)


def _fill_to_context(m):
    """Sequences whose rows all hold exactly max_len tokens (the last ones via extend)."""
    prompts = _prompts(m.vocab, lens=LONG_LENS, seed=12)
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            max_len=64)
    room = 64 - np.asarray(res.sequences.lengths_B)
    seqs = sampling.extend(m.config, m.params, res.sequences, [[1] * int(r) for r in room])
    np.testing.assert_array_equal(np.asarray(seqs.lengths_B), 64)
    return seqs


def test_rows_full_on_entry_generate_nothing(tiny):
    m = tiny["untied"]
    res = sampling.sample(m.config, m.params, _fill_to_context(m), max_new_tokens=N_NEW,
                          temperature=0.0)
    np.testing.assert_array_equal(res.lengths, 0)
    np.testing.assert_array_equal(res.tokens, 0)
    np.testing.assert_array_equal(np.asarray(res.sequences.lengths_B), 64)


def test_rows_full_on_entry_finish_with_context(tiny):
    m = tiny["untied"]
    seqs = _fill_to_context(m)
    res = sampling.sample(m.config, m.params, seqs, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(res.lengths, 0)
    assert res.finish_reasons == ["context"] * len(LONG_LENS)


# -------------------------------------------------------------------------- 6. sharded


@pytest.mark.devices(8)
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (8, 1, 1)])
def test_sharded_greedy_matches_unsharded(tiny, mesh_shape):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=10)
    ref = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0)
    mesh = make_mesh(mesh_shape)
    sharded = jax.device_put(m.params, param_shardings(m.params, mesh))
    q = sharded["layers"]["attn"]["q"][...]
    if mesh_shape == (2, 2, 2):
        assert q.addressable_shards[0].data.shape != q.shape  # Really split.
    res = sampling.generate(m.config, sharded, prompts, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    np.testing.assert_allclose(res.logprobs, ref.logprobs, atol=1e-4)


# ----------------------------------------------------------- 7. sampling distribution


def test_sampling_is_keyed_and_truncation_limits_to_greedy(tiny, greedy_ref):
    m = tiny["untied"]
    prompts, ref = greedy_ref

    def run(**kw):
        return sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, **kw)

    a = run(temperature=1.0, key=jax.random.key(1))
    b = run(temperature=1.0, key=jax.random.key(1))
    c = run(temperature=1.0, key=jax.random.key(2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).any()
    assert (a.tokens != ref).any()  # Temperature 1 is not greedy on this model.
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        r = run(temperature=1.0, key=jax.random.key(3), **kw)
        np.testing.assert_array_equal(r.tokens, ref, err_msg=str(kw))
        # One token kept: probability 1 under the truncated distribution.
        np.testing.assert_allclose(r.sample_logprobs, 0.0, atol=1e-6)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.5, 1.0, 3), (1.0, 0.7, 0)])
def test_sample_token_frequencies_follow_truncated_softmax(temperature, top_p, top_k):
    n = 4096
    logits_V = np.array([2.0, 1.5, 1.0, 0.3, -1.0, 0.8, -0.5], np.float32)
    sp = sampling.SamplingParams(jnp.float32(temperature), jnp.float32(top_p),
                                  jnp.int32(top_k), jnp.full(8, -1, jnp.int32))
    tok, logp, slogp = jax.jit(sampling.sample_token)(
        jnp.asarray(np.tile(logits_V, (n, 1))), sp, jax.random.split(jax.random.key(4), n))
    tok, logp, slogp = map(np.asarray, (tok, logp, slogp))
    scaled = logits_V / temperature
    ref = _np_truncated_log_softmax(scaled, top_k, top_p)
    kept = np.flatnonzero(np.isfinite(ref))
    assert kept.size == 3 and set(tok.tolist()) <= set(kept.tolist())
    freq = np.array([(tok == t).mean() for t in kept])
    # Binomial std <= sqrt(0.25 / 4096) = 0.008; allow about 4 sigma.
    np.testing.assert_allclose(freq, np.exp(ref[kept]), atol=0.03)
    np.testing.assert_allclose(logp, _log_softmax(scaled)[tok], atol=1e-5)
    np.testing.assert_allclose(slogp, ref[tok], atol=1e-5)


# ------------------------------------------------------------------ 8. _filter_logits


def test_filter_logits_hand_worked():
    inf = np.inf
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 2.0, -1.0, 1.0]])
    filt = jax.jit(sampling._filter_logits)  # One compile instead of op-by-op dispatch.

    def kept(top_k, top_p):
        return np.asarray(filt(logits, jnp.int32(top_k), jnp.float32(top_p)))

    np.testing.assert_array_equal(kept(2, 1.0), [[2, 1, -inf, -inf], [-inf, 2, -inf, 1]])
    # softmax([2, 1, 0, -1]) = [0.6439, 0.2369, 0.0871, 0.0321]; mass before each token is
    # [0, 0.6439, 0.8808, 0.9679] and a token is kept while that mass is < top_p.
    np.testing.assert_array_equal(kept(0, 0.7), [[2, 1, -inf, -inf], [-inf, 2, -inf, 1]])
    np.testing.assert_array_equal(kept(0, 0.6), [[2, -inf, -inf, -inf], [-inf, 2, -inf, -inf]])
    np.testing.assert_array_equal(kept(0, 0.9), [[2, 1, 0, -inf], [0, 2, -inf, 1]])
    np.testing.assert_array_equal(kept(3, 0.7), [[2, 1, -inf, -inf], [-inf, 2, -inf, 1]])
    np.testing.assert_array_equal(kept(1, 1.0), [[2, -inf, -inf, -inf], [-inf, 2, -inf, -inf]])
    # top_k <= 0 or > vocab and top_p = 1 keep everything.
    for k in (0, -1, 9):
        np.testing.assert_array_equal(kept(k, 1.0), np.asarray(logits))


# ---------------------------------------------- 9. memory: cache by need, shared prompts, budget


def test_cache_grows_by_need_not_max_len(tiny, monkeypatch):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, lens=LONG_LENS, seed=12)
    grows = []
    grow = sampling.grow
    monkeypatch.setattr(sampling, "grow",
                        lambda cfg, c, n: grows.append((c.capacity, n)) or grow(cfg, c, n))
    res = sampling.generate(m.config, m.params, prompts, max_new_tokens=N_NEW, temperature=0.0,
                            max_len=32768)
    # Rows reach 63 + 32 = 95 tokens: prefilled into 64 slots, grown once to 128, not 32768.
    reached = max(len(p) for p in prompts) + N_NEW
    assert grows == [(64, 128)] and kv_cache_plan.cache_len(reached, 32768) == 128
    assert res.sequences.capacity == 128 and res.sequences.max_len == 32768
    for i, (p, greedy) in enumerate(zip(prompts, _teacher_forced_argmax(m, prompts, res))):
        assert res.lengths[i] == N_NEW and res.finish_reasons[i] == "length"
        np.testing.assert_array_equal(res.tokens[i], greedy, err_msg=f"row {i}")
    # An extend past the capacity grows the cache again; the next logits stay exact.
    tool = [[7] * (140 - len(p) - N_NEW) for p in prompts]
    seqs = sampling.extend(m.config, m.params, res.sequences, tool)
    assert grows[-1] == (128, 256) and seqs.capacity == 256
    # The outgrown cache is freed, not held by the caller's (donated) Sequences.
    assert all(x.is_deleted() for x in jax.tree.leaves(res.sequences.cache))
    rows = [r + t for r, t in zip(_rows(res, prompts), tool)]
    full = _full_logits(m, rows)
    np.testing.assert_allclose(np.asarray(seqs.next_logits_BxV), full[:, -1], atol=1e-4, rtol=1e-4)


def test_cache_len_buckets():
    assert [kv_cache_plan.cache_len(n, 32768) for n in (1, 64, 65, 95, 1024, 1025)] == [
        64, 64, 128, 128, 1024, 2048]
    assert kv_cache_plan.cache_len(40_000, 32768) == 32768
    assert kv_cache_plan.cache_len(70, 100) == 100
    cfg = models.get_preset("tiny")  # 2 layers, 2 kv heads of 16, float32.
    assert kv_cache_plan.kv_cache_bytes(cfg, 3, 64) == 2 * 2 * 3 * 2 * 64 * 16 * 4
    # 3 rows pad to 4; growing into 128 slots holds the old 64 beside the new 128.
    assert kv_cache_plan.kv_cache_peak_bytes(cfg, 3, 100, 32768) == (
        kv_cache_plan.kv_cache_bytes(cfg, 4, 128) + kv_cache_plan.kv_cache_bytes(cfg, 4, 64))
    assert (kv_cache_plan.kv_cache_peak_bytes(cfg, 1, 10, 32768)
            == kv_cache_plan.kv_cache_bytes(cfg, 1, 64))


def test_0p6b_kv_cache_for_1024_token_traces_is_under_10gb():
    """Real scale: max_len=32768, 64 rows of Qwen3-0.6B (bf16) whose traces reach 1024 tokens."""
    from mgrpo_jax.models import qwen3

    cfg = models.get_preset("qwen3_0p6b", compute_dtype="bfloat16", param_dtype="bfloat16")
    rows, max_len, reached = 64, 32768, 1024
    capacity = kv_cache_plan.cache_len(reached, max_len)  # What prefill/extend/sample allocate.
    # The decode step the sampler runs at that capacity, traced with abstract inputs only.
    s = jax.ShapeDtypeStruct
    cache = jax.eval_shape(lambda: sampling.init_cache(cfg, rows, capacity))
    seqs = sampling.Sequences(cache, s((rows,), jnp.int32),
                              s((rows, cfg.vocab_size), jnp.float32), max_len)
    ints, floats = s((rows, 16), jnp.int32), s((rows, 16), jnp.float32)
    state = sampling.LoopState(seqs, ints, floats, floats, *[s((rows,), jnp.int32)] * 4)
    sp = sampling.SamplingParams(s((), jnp.float32), s((), jnp.float32), s((), jnp.int32),
                                  s((8,), jnp.int32))
    key = jax.eval_shape(lambda: jax.random.key(0))
    out = sampling.decode_jit(jax.default_backend()).lower(
        cfg, jax.eval_shape(functools.partial(sampling.decode_params, cfg), qwen3.abstract_params(cfg)),
        state, sp, s((), jnp.int32), key, capacity).out_info
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out.seqs.cache))
    assert held == kv_cache_plan.kv_cache_bytes(cfg, rows, capacity) == 7_516_192_768
    assert held < 10e9
    # Allocated at max_len, as before, the cache alone would be 240.5 GB.
    assert kv_cache_plan.kv_cache_bytes(cfg, rows, max_len) == 240_518_168_576


def test_shared_prompts_are_prefilled_once(tiny, monkeypatch):
    m = tiny["untied"]
    a, b = _prompts(m.vocab, lens=(11, 6), seed=13)
    prompts = [a] * 4 + [b] * 3 + [a]
    batches = []
    prefill = sampling.prefill_rows
    monkeypatch.setattr(sampling, "prefill_rows",
                        lambda *args: batches.append(args[2].shape[0]) or prefill(*args))
    kw = dict(max_new_tokens=N_NEW, temperature=1.0, top_k=50, key=jax.random.key(3))
    shared = sampling.generate(m.config, m.params, prompts, **kw)
    assert batches == [2]  # The two distinct prompts, then only decoding.
    # Reference: every copy prefilled in its own row.
    monkeypatch.setattr(sampling, "_dedupe", lambda ps: (list(ps), list(range(len(ps)))))
    each = sampling.generate(m.config, m.params, prompts, **kw)
    assert batches[1:] == [8]
    np.testing.assert_array_equal(shared.tokens, each.tokens)
    np.testing.assert_allclose(shared.logprobs, each.logprobs, atol=1e-5)
    np.testing.assert_allclose(shared.sample_logprobs, each.sample_logprobs, atol=1e-5)
    assert len({tuple(r) for r in shared.tokens[:4]}) == 4  # Copies still sample apart.


def test_budget_runs_rows_in_waves_with_the_same_results(tiny):
    m = tiny["untied"]
    prompts = _prompts(m.vocab, seed=14)
    kw = dict(max_new_tokens=N_NEW, temperature=1.0, key=jax.random.key(5), max_len=64,
              stop_token_ids=[3, 4, 5, 6])
    free = sampling.generate(m.config, m.params, prompts, **kw)
    # Room for two rows of 64 slots: four waves of two.
    budget = kv_cache_plan.kv_cache_bytes(m.config, 2, 64)
    bounds = [len(p) + N_NEW for p in prompts]
    waves = kv_cache_plan.plan_waves(m.config, bounds, max_len=64, budget_bytes=budget)
    assert len(waves) == 4 and sorted(i for w in waves for i in w) == list(range(8))
    tight = sampling.generate(m.config, m.params, prompts, kv_cache_budget_bytes=budget, **kw)
    assert tight.sequences is None
    np.testing.assert_array_equal(tight.tokens, free.tokens)
    np.testing.assert_array_equal(tight.lengths, free.lengths)
    assert tight.finish_reasons == free.finish_reasons and "stop" in free.finish_reasons
    np.testing.assert_allclose(tight.logprobs, free.logprobs, atol=1e-5)
    np.testing.assert_allclose(tight.sample_logprobs, free.sample_logprobs, atol=1e-5)
    # One row at a time gives the same rows too: a row's samples do not depend on its batch.
    for i in (0, 5):
        one = sampling.generate(m.config, m.params, [prompts[i]], row_ids=[i], **kw)
        np.testing.assert_array_equal(one.tokens[0], free.tokens[i])
    with pytest.raises(ValueError, match="cannot hold even this one row"):
        sampling.generate(m.config, m.params, prompts, kv_cache_budget_bytes=budget // 3, **kw)
