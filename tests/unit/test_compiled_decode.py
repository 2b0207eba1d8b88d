"""The compiled decode step (`EngineConfig.compile_decode`) generates what the eager forward generates: the same
tokens, logprobs to float rounding, in batches of mixed adapters and the bare base with rows that retire at
different steps, in a batch of one adapter, and without adapters; bases it does not cover are refused by name."""

from __future__ import annotations

import pytest
import torch

from mint_core.engine.compiled_decode import unsupported
from mint_core.engine.engine import Engine, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.lora.adapter import random_adapter, save_adapter
from tests.conftest import TARGETS
from tests.unit.test_generation import RANKS, mixed_batch

ATOL = 1e-4


@pytest.fixture
def pair(make_engine, adapter_dir) -> tuple[Engine, Engine]:  # type: ignore[no-untyped-def]
    """Two engines on the same tiny Llama (grouped-query attention) with the same three adapters: eager, compiled."""
    engines = (make_engine("dense", max_loras=4), make_engine("dense", max_loras=4, compile_decode=True))
    for i, (name, rank) in enumerate(RANKS.items()):
        a = random_adapter(
            engines[0].sites,
            TARGETS["dense"],
            rank,
            seed=i,
            std=0.3,
            base_fingerprint=engines[0].base.fingerprint,
        )
        save_adapter(a, adapter_dir / name, engines[0].sites)
        for e in engines:
            e.load_adapter(name, adapter_dir / name)
    return engines


def same_generation(eager: Engine, compiled: Engine, requests: list[Request]) -> None:
    want, got = eager.generate(requests), compiled.generate(requests)
    for req, w, g in zip(requests, want, got, strict=True):
        assert g.token_ids == w.token_ids, (req.adapter, req.prompt)
        assert g.finish_reason == w.finish_reason
        assert w.logprobs is not None and g.logprobs is not None
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=ATOL, rtol=0)


@pytest.mark.slow  # the inductor compile takes 11-39 s (warm or cold cache) of a CPU-bound default run, for an
# opt-in feature (`compile_decode` is off by default); the default tier keeps its single-row and refusal checks
def test_mixed_adapters_and_retiring_rows_generate_the_eager_tokens(pair):
    eager, compiled = pair
    assert compiled.compiled_decode is not None and eager.compiled_decode is None
    requests = [
        *mixed_batch(logprobs=True, ignore_eos=True),
        # sampled, seeded: the same draws need the same logits to the last bit that decides a token
        Request(
            "xyz",
            "r4",
            SamplingParams(max_tokens=7, temperature=1.0, seed=11, logprobs=True, ignore_eos=True),
        ),
        Request(
            "xyz",
            None,
            SamplingParams(max_tokens=9, temperature=1.0, seed=12, logprobs=True, ignore_eos=True),
        ),
    ]
    same_generation(eager, compiled, requests)
    assert compiled.compiled_decode.compiles == 1  # rows retiring and caches growing did not compile again
    # a batch of another size and other lengths runs the same graph
    same_generation(eager, compiled, requests[1:5])
    assert compiled.compiled_decode.compiles == 1
    assert [n for _, _, n in compiled.working_set.slot_table()] == [0, 0, 0, 0]


@pytest.mark.slow
def test_one_adapter_and_no_adapter_batches_generate_the_eager_tokens(pair):
    eager, compiled = pair
    greedy = SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True)
    one = [Request(p, "r8", greedy) for p in ("Hello", "The quick brown fox", "ab", "0123456789")]
    same_generation(eager, compiled, one)
    same_generation(eager, compiled, [Request(r.prompt, None, greedy) for r in one])
    assert compiled.compiled_decode is not None and compiled.compiled_decode.compiles == 2


def test_a_single_row_decodes_eagerly(pair):
    eager, compiled = pair
    req = [Request("Hello", "r2", SamplingParams(max_tokens=5, logprobs=True, ignore_eos=True))]
    same_generation(eager, compiled, req)
    assert compiled.compiled_decode is not None and compiled.compiled_decode.compiles == 0


def test_bases_it_does_not_cover_are_refused_with_the_reason(make_engine, make_base):
    with pytest.raises(ValueError, match="no compiled decode for this base: model_type 'qwen3_moe'"):
        make_engine("moe", compile_decode=True)
    eager_attn = make_base("dense")
    eager_attn.model.config._attn_implementation = "eager"
    assert unsupported(eager_attn.model) == "attention implementation 'eager', not sdpa"
    assert unsupported(make_base("dense").model) is None
