"""Batched generation with mixed adapters: each request decodes as it would alone (tokens, logprobs, seeded
samples), logprobs agree with a plain forward, and stop, length and error handling are exact."""

from __future__ import annotations

import pytest
import torch

from mint_core.engine.engine import Request, RequestError
from mint_core.engine.sampling import SamplingParams, choose_tokens, filter_top_p
from mint_core.errors import UnknownAdapter
from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import TARGETS

ATOL = 1e-4
RANKS = {"r2": 2, "r4": 4, "r8": 8}


@pytest.fixture
def engine(make_engine, adapter_dir):  # type: ignore[no-untyped-def]
    engine = make_engine("dense", max_loras=4)
    for i, (name, rank) in enumerate(RANKS.items()):
        # std 0.3: large enough that every adapter visibly changes what the tiny base generates
        a = random_adapter(
            engine.sites, TARGETS["dense"], rank, seed=i, std=0.3, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / name, engine.sites)
        engine.load_adapter(name, adapter_dir / name)
    return engine


def mixed_batch(**params) -> list[Request]:  # type: ignore[no-untyped-def]
    """Three adapters and the bare base; prompts of different lengths (left padding) and different max_tokens
    (rows leave the batch at different steps)."""
    return [
        Request("The quick brown fox", "r2", SamplingParams(max_tokens=6, **params)),
        Request("Hi", "r4", SamplingParams(max_tokens=10, **params)),
        Request(
            [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33],
            None,
            SamplingParams(max_tokens=3, **params),
        ),
        Request("abc def", "r8", SamplingParams(max_tokens=8, **params)),
    ]


def full_logprobs(engine, ids: list[int], adapter: str | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """log_softmax of one plain forward over `ids` under `adapter`: [len(ids), V]."""
    return torch.log_softmax(engine.logits(torch.tensor([ids]), [adapter])[0].float(), dim=-1)


def refs(engine) -> list[int]:  # type: ignore[no-untyped-def]
    return [n for _, _, n in engine.working_set.slot_table()]


def test_greedy_is_deterministic_and_batch_invariant(engine):
    reqs = mixed_batch(logprobs=True, ignore_eos=True)
    batch = engine.generate(reqs)
    assert engine.generate(reqs) == batch

    for req, got in zip(reqs, batch, strict=True):
        alone = engine.generate([req])[0]
        assert got.token_ids == alone.token_ids, req.adapter
        assert got.text == alone.text
        assert got.logprobs is not None and alone.logprobs is not None
        assert len(got.logprobs) == len(got.token_ids) == req.params.max_tokens
        assert max(abs(x - y) for x, y in zip(got.logprobs, alone.logprobs, strict=True)) < ATOL
        assert got.finish_reason == "length"
        assert got.adapter == req.adapter
        assert got.revision == (None if req.adapter is None else engine.working_set.digest_of(req.adapter))
    assert batch[2].prompt_token_ids == reqs[2].prompt
    assert refs(engine) == [0, 0, 0, 0]


def test_adapter_changes_output(engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    bare = engine.generate([Request("Hello there", None, params)])[0]
    outs = engine.generate([Request("Hello there", name, params) for name in RANKS])
    for name, out in zip(RANKS, outs, strict=True):
        assert out.token_ids != bare.token_ids, name
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)  # rows did not leak into each other


def test_logprobs_equal_log_softmax_of_full_forward(engine):
    # the sampled row checks that logprobs are the model's, before temperature
    reqs = [
        *mixed_batch(logprobs=True, ignore_eos=True),
        Request(
            "xyz",
            "r4",
            SamplingParams(max_tokens=7, temperature=1.5, seed=11, logprobs=True, ignore_eos=True),
        ),
    ]
    for req, out in zip(reqs, engine.generate(reqs), strict=True):
        prompt, gen = out.prompt_token_ids, out.token_ids
        lp = full_logprobs(engine, prompt + gen[:-1], req.adapter)[len(prompt) - 1 :]
        want = lp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)
        assert out.logprobs is not None
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=ATOL, rtol=0)


def test_logprobs_are_none_unless_asked(engine):
    out = engine.generate([Request("Hi", "r2", SamplingParams(max_tokens=3))])[0]
    assert out.logprobs is None and out.prompt_logprobs is None


def test_echo_returns_prompt_logprobs(engine):
    short = Request("Hi there", "r2", SamplingParams(max_tokens=4, echo=True, ignore_eos=True))
    long = Request("A much longer prompt than that", "r8", SamplingParams(max_tokens=4, ignore_eos=True))
    echoed, other = engine.generate([short, long])

    prompt = echoed.prompt_token_ids
    assert echoed.prompt_logprobs is not None
    assert len(echoed.prompt_logprobs) == len(prompt)
    assert echoed.prompt_logprobs[0] is None  # nothing predicts the first token
    lp = full_logprobs(engine, prompt, "r2")
    want = lp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(echoed.prompt_logprobs[1:]), want, atol=ATOL, rtol=0)
    assert other.prompt_logprobs is None
    # keeping every position's logits for echo must not change what is generated
    plain = engine.generate(
        [Request(short.prompt, "r2", SamplingParams(max_tokens=4, ignore_eos=True)), long]
    )
    assert [c.token_ids for c in plain] == [echoed.token_ids, other.token_ids]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    def sample(seed: int, adapter: str | None = "r4") -> Request:
        return Request(
            "Once upon", adapter, SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
        )

    first = engine.generate([sample(1)])[0]
    again, other = engine.generate([sample(1)])[0], engine.generate([sample(2)])[0]
    assert (again.text, again.token_ids) == (first.text, first.token_ids)
    assert other.text != first.text and other.token_ids != first.token_ids

    # neighbours: a greedy row, an unseeded sample (draws from the engine's shared generator), another seed
    crowd = [
        Request("The quick brown fox jumps", "r8", SamplingParams(max_tokens=5)),
        Request("z", None, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)),
        sample(1),
        sample(2, adapter="r2"),
    ]
    assert engine.generate(crowd)[2].token_ids == first.token_ids


def test_a_prompt_repeated_under_one_adapter_is_prefilled_once(engine):
    """A GRPO group: k samples of one prompt with one adapter share a single prefill row, and each sample
    still decodes (tokens, logprobs, echo) exactly as it does alone."""

    def req(prompt: str, adapter: str | None, seed: int) -> Request:
        params = SamplingParams(
            max_tokens=6, temperature=1.0, seed=seed, logprobs=True, echo=True, ignore_eos=True
        )
        return Request(prompt, adapter, params)

    reqs = [req("Once upon", "r4", seed) for seed in range(4)]
    reqs += [req("Once upon", "r2", 0), req("Once upon", None, 0), req("abc", "r4", 0), req("abc", "r4", 1)]
    rows: list[int] = []
    model = engine.base.model
    hook = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        batch = engine.generate(reqs)
    finally:
        hook.remove()
    assert rows[0] == 4  # (r4, "Once upon"), (r2, "Once upon"), (base, "Once upon"), (r4, "abc")
    assert rows[1] == len(reqs)  # then every sample decodes in its own row
    assert len({tuple(c.token_ids) for c in batch[:4]}) > 1  # the copies sample independently
    for r, got in zip(reqs, batch, strict=True):
        alone = engine.generate([r])[0]
        assert got.token_ids == alone.token_ids
        assert got.logprobs is not None and alone.logprobs is not None
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=ATOL, rtol=0
        )
        assert got.prompt_logprobs is not None and alone.prompt_logprobs is not None
        torch.testing.assert_close(
            torch.tensor(got.prompt_logprobs[1:]), torch.tensor(alone.prompt_logprobs[1:]), atol=ATOL, rtol=0
        )
    assert refs(engine) == [0, 0, 0, 0]


def test_output_head_sees_row_major_input(engine):
    """A prefill keeps the last position's logits through a strided slice of the hidden states; the engine
    hands the head a row-major copy (a bf16 `linear` on CPU copies its whole weight for the strided one)."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    head = engine.base.model.get_output_embeddings()
    hook = head.register_forward_pre_hook(
        lambda _m, args: seen.append((tuple(args[0].shape), args[0].stride()))
    )
    try:
        engine.generate([Request("Hello there", "r2", SamplingParams(max_tokens=2, ignore_eos=True))])
    finally:
        hook.remove()
    (shape, stride), _ = seen  # the prefill, then one decode step
    assert shape[:2] == (1, 1)
    assert stride == (shape[1] * shape[2], shape[2], 1)


def test_tiny_top_p_is_greedy(engine):
    for adapter in (None, "r8"):
        greedy = engine.generate([Request("Hello", adapter, SamplingParams(max_tokens=12, ignore_eos=True))])[
            0
        ]
        nucleus = engine.generate(
            [
                Request(
                    "Hello",
                    adapter,
                    SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True),
                )
            ]
        )[0]
        assert nucleus.token_ids == greedy.token_ids, adapter


def _ascii_pair(text: str) -> str:
    """The first two adjacent printable ASCII characters after the start of `text`."""
    for k in range(1, len(text) - 1):
        pair = text[k : k + 2]
        if all(c.isascii() and c.isprintable() for c in pair):
            return pair
    pytest.fail(f"no printable ASCII pair in {text!r}")


def test_stop_string_cuts_text_before_it(engine):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    full = engine.generate([Request("Hello there", "r2", params)])[0]
    # ASCII bytes are whole tokens, so the partial decodes seen while generating agree with the full text
    stop = _ascii_pair(full.text)
    cut = full.text.find(stop)
    assert cut > 0

    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=["never appears \u2603", stop])
    out = engine.generate([Request("Hello there", "r2", params)])[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    # generation ends on the very token that completes the stop string
    n = len(out.token_ids)
    assert out.token_ids == full.token_ids[:n]
    decode = engine.tokenizer.decode
    assert stop in decode(out.token_ids, skip_special_tokens=True)
    assert stop not in decode(out.token_ids[:-1], skip_special_tokens=True)


def test_max_tokens_and_eos(engine):
    out = engine.generate([Request("Hello", "r4", SamplingParams(max_tokens=5, ignore_eos=True))])[0]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")

    # make a token the greedy path produces count as EOS: generation stops at it, keeping it in the tokens (as
    # vLLM does, so echo + logprobs scoring sees every generated token) but not in the text
    eos_at = 2
    engine.eos_ids = frozenset({out.token_ids[eos_at]})
    first = out.token_ids.index(out.token_ids[eos_at])
    stopped = engine.generate([Request("Hello", "r4", SamplingParams(max_tokens=5, logprobs=True))])[0]
    assert (stopped.token_ids, stopped.finish_reason) == (out.token_ids[: first + 1], "stop")
    assert len(stopped.logprobs or []) == first + 1
    ignoring = engine.generate([Request("Hello", "r4", SamplingParams(max_tokens=5, ignore_eos=True))])[0]
    assert (ignoring.token_ids, ignoring.finish_reason) == (out.token_ids, "length")


def test_prompt_plus_max_tokens_over_max_model_len_is_refused(make_engine, adapter_dir):
    engine = make_engine("dense", max_loras=2, max_model_len=32)
    a = random_adapter(engine.sites, TARGETS["dense"], 2, seed=0, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, adapter_dir / "a", engine.sites)
    engine.load_adapter("a", adapter_dir / "a")
    prompt = list(range(30))

    with pytest.raises(
        RequestError, match=r"request 1: prompt \(30 tokens\) \+ max_tokens \(3\) exceeds max_model_len 32"
    ):
        engine.generate([Request([1, 2], "a"), Request(prompt, "a", SamplingParams(max_tokens=3))])
    assert [n for _, _, n in engine.working_set.slot_table()] == [0, 0]
    out = engine.generate([Request(prompt, "a", SamplingParams(max_tokens=2, ignore_eos=True))])[0]
    assert len(out.token_ids) == 2  # exactly at the limit is allowed

    with pytest.raises(RequestError, match="empty"):
        engine.generate([Request([], "a")])


def test_unknown_adapter_raises_and_holds_no_slot(engine):
    with pytest.raises(UnknownAdapter, match="'nope'"):
        engine.generate([Request("Hi", "r2"), Request("Hi", "r4"), Request("Hi", "nope")])
    assert refs(engine) == [0, 0, 0, 0]
    with pytest.raises(UnknownAdapter):
        engine.logits(torch.tensor([[1, 2], [3, 4]]), ["r8", "nope"])
    assert refs(engine) == [0, 0, 0, 0]
    assert engine.generate([]) == []


def test_filter_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.1, 0.5, 0.05, 0.35])
    logits = (probs.log() + 3.0).repeat(4, 1)  # unnormalised on purpose
    top_p = torch.tensor([0.6, 0.9, 1e-6, 1.0])
    out = filter_top_p(logits, top_p)
    keep = torch.tensor(
        [
            [False, True, False, True],  # 0.5 + 0.35 reaches 0.6
            [True, True, False, True],  # the 0.05 token starts at 0.95, past 0.9
            [False, True, False, False],  # the top token always stays
            [True, True, True, True],
        ]
    )
    assert torch.equal(torch.isfinite(out), keep)
    assert torch.equal(out[keep], logits[keep])  # survivors are not renormalised here


def test_choose_tokens_per_row_greedy_nucleus_and_temperature():
    probs = torch.tensor([0.1, 0.5, 0.05, 0.35])
    logits = probs.log().repeat(4, 1)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.02),  # sharpens to the top token: 0.7 ** 50 odds for the runner-up
        SamplingParams(temperature=5.0),  # flattens: every token at least ~19 %
    ]
    g = torch.Generator().manual_seed(0)
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(200):
        for row, t in enumerate(choose_tokens(logits, params, [None, g, g, g]).tolist()):
            seen[row].add(t)
    assert seen[0] == {1}
    assert seen[1] == {1, 3}  # both nucleus tokens come up in 200 draws (miss chance ~ 0.59 ** 200)
    assert seen[2] == {1}
    assert seen[3] == {0, 1, 2, 3}


def test_sampled_tokens_follow_the_distribution():
    """Each row draws from softmax(logits / temperature), nucleus applied: frequencies over many draws."""
    probs = torch.tensor([0.1, 0.5, 0.0, 0.05, 0.35])
    logits = probs.log().repeat(3, 1)  # token 2 has no mass (-inf) and must never come up
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.8),  # nucleus {1, 4}: renormalised 0.5/0.85, 0.35/0.85
        SamplingParams(temperature=2.0),  # p ** 0.5, renormalised
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    n = 4000
    counts = torch.zeros(3, 5)
    for _ in range(n):
        t = choose_tokens(logits, params, gens)
        counts[torch.arange(3), t] += 1
    freq = counts / n
    hot = probs.sqrt() / probs.sqrt().sum()
    want = torch.stack([probs, torch.tensor([0, 0.5, 0, 0, 0.35]) / 0.85, hot])
    assert counts[:, 2].sum() == 0
    # 4 standard errors of a frequency over 4000 draws is at most 0.032
    torch.testing.assert_close(freq, want, atol=0.032, rtol=0)
