"""Rollouts through the engine: G samples per prompt, prompts of many policies in one batch, rewards attached."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mint_core.data.generators import Example
from mint_core.data.rewards import Rewarder, builtin_scores
from mint_core.engine.chat import prompt_ids
from mint_core.engine.engine import Engine, Request
from mint_core.engine.sampling import SamplingParams


@dataclass
class RolloutRow:
    policy: str
    group: int  # rows with the same group share a prompt (and a policy)
    example: Example
    prompt_ids: list[int]
    completion_ids: list[int]  # generated tokens, plus EOS when the model chose to stop
    sampling_logprobs: list[float]  # of the generated tokens (EOS excluded), as sampled
    text: str
    reward: float
    finish_reason: str


def rollout(
    engine: Engine,
    prompts: dict[str, list[Example]],
    rewarder: Rewarder,
    group_size: int | Mapping[str, int],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    greedy_in_group: bool = False,
    overrides: dict[str, str | None] | None = None,
) -> list[RolloutRow]:
    """`group_size` samples (per policy, where it is a mapping) of every prompt of every policy (adapter name ->
    its examples), one engine batch,
    each scored by its task's rewards (`rewarder`), or by the built-in reward a policy names in `overrides`.
    With `greedy_in_group`, each group's first completion is the greedy one (what a served greedy request
    answers) and the others are sampled at `temperature`."""
    requests: list[Request] = []
    meta: list[tuple[str, int, Example]] = []
    group = 0
    for policy, examples in prompts.items():
        size = group_size if isinstance(group_size, int) else group_size[policy]
        for ex in examples:
            # tokenized once for its group, as serving does: chat rows as vLLM's chat route (a template's own
            # BOS, none added)
            ids = prompt_ids(engine.tokenizer, ex.prompt)
            for g in range(size):
                params = SamplingParams(
                    max_tokens=max_new_tokens,
                    temperature=0.0 if greedy_in_group and g == 0 else temperature,
                    logprobs=True,
                    seed=None if seed is None else hash((seed, group, g)) & 0x7FFFFFFF,
                )
                requests.append(Request(list(ids), policy, params))
                meta.append((policy, group, ex))
            group += 1
    out = engine.generate(requests)
    scores = [0.0] * len(out)
    by_override: dict[str | None, list[int]] = {}
    for i, (policy, _, _) in enumerate(meta):
        by_override.setdefault((overrides or {}).get(policy), []).append(i)
    for name, idx in by_override.items():
        exs, texts = [meta[i][2] for i in idx], [out[i].text for i in idx]
        got = rewarder.score(exs, texts) if name is None else builtin_scores(name, exs, texts)
        for i, s in zip(idx, got, strict=True):
            scores[i] = s
    rows = []
    for j, ((policy, g, ex), c) in enumerate(zip(meta, out, strict=True)):
        ids = list(c.token_ids)
        if c.finish_reason == "stop" and engine.eos_id is not None and not requests[0].params.stop:
            ids.append(engine.eos_id)
        rows.append(
            RolloutRow(
                policy=policy,
                group=g,
                example=ex,
                prompt_ids=c.prompt_token_ids,
                completion_ids=ids,
                sampling_logprobs=list(c.logprobs or []),
                text=c.text,
                reward=scores[j],
                finish_reason=c.finish_reason,
            )
        )
    return rows
