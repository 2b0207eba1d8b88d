"""Continuous batching: sequences with different adapters join and leave one running batch between steps.

A step chooses the next token of every running row from the logits of the previous forward, retires rows that
finished (releasing their adapter slot), and runs one decode forward for the rest. Admission prefills new
sequences as a small batch of their own, then joins their KV cache to the running one, left-padded, so later
arrivals share every following decode step with earlier ones.

Prefill and decode run under `torch.inference_mode`, not just `no_grad`: no version counters or view tracking on
the cache, logits and sampling tensors, which nothing ever differentiates (a decode step of a small model is
mostly such per-op overhead). What they make stays inside the batcher or leaves as Python numbers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from mint_core.engine.kv_cache import BufferPool, RaggedCache
from mint_core.engine.logprobs import log_normalizer
from mint_core.engine.sampling import choose_tokens
from mint_core.engine.sequence import Sequence

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from mint_core.engine.base import Base
    from mint_core.engine.working_set import WorkingSet
    from mint_core.lora.layers import LoRAModel

logger = logging.getLogger(__name__)
# Process-wide, so two batchers (or one after another) never share a key.
_compositions = itertools.count(1)


def _top(logp: torch.Tensor, k: int, lse: torch.Tensor | None = None) -> list[dict[int, float]]:
    """The k most likely tokens and their log-probabilities, per row of logp [n, V] (logits with their
    log-normaliser lse [n] given)."""
    values, ids = logp.topk(k, dim=-1)
    if lse is not None:
        values = values.float() - lse[:, None]
    return [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


class Resident(Protocol):
    """What a batcher runs on: the resident base with its LoRA layers and working set, the model held alone for
    each forward (`exclusive`), and the tokenizer's pad, ends and decoding. `Engine` is one; the batcher names what it uses rather than
    importing the engine that imports it."""

    base: Base
    lora: LoRAModel
    working_set: WorkingSet
    pad_id: int
    eos_ids: frozenset[int]
    kv_pool: BufferPool | None

    def exclusive(self) -> AbstractContextManager[bool]: ...

    def decode(self, ids: list[int]) -> str: ...


class Batcher:
    def __init__(self, engine: Resident, on_finish: Callable[[Sequence], None] | None = None):
        self.engine = engine
        self.seqs: list[Sequence] = []
        self.cache: RaggedCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 where a row has a real token
        self.pos: torch.Tensor | None = None  # [B] position of each row's last token
        self.logits: torch.Tensor | None = None  # [B, V] float32, for each row's next token
        self.composition = next(_compositions)  # new whenever rows join or leave (keys the gathered factors)
        self._on_finish = on_finish
        self.dev = engine.base.device

    def __len__(self) -> int:
        return len(self.seqs)

    def _room(self) -> int:
        return max((s.params.max_tokens - len(s.out_ids) for s in self.seqs), default=0) + 1

    def _forward(self, rows: list[int], **inputs: torch.Tensor | RaggedCache | int | None) -> torch.Tensor:
        eng = self.engine
        with eng.exclusive():
            eng.lora.ctx.set_rows(rows, self.dev, key=self.composition)
            out = eng.base.model(use_cache=True, **inputs)
        return out.logits  # type: ignore[no-any-return]

    @torch.inference_mode()
    def admit(self, seqs: Seq[Sequence]) -> None:
        """Prefill `seqs` (slots already acquired) and join them to the running batch."""
        if not seqs:
            return
        n = len(seqs)
        # A prompt sent k times with one adapter (a GRPO group, n > 1 samples) is prefilled once: its row of
        # keys, values and logits is then copied to the k sequences, which differ only from their first sample.
        reps: list[Sequence] = []  # one sequence per distinct (adapter slot, prompt)
        of: list[int] = []  # seqs[i] is reps[of[i]]'s prompt
        index: dict[tuple[int, tuple[int, ...]], int] = {}
        for s in seqs:
            key = (s.slot, tuple(s.prompt_ids))
            if key not in index:
                index[key] = len(reps)
                reps.append(s)
            of.append(index[key])
        width = max(len(s.prompt_ids) for s in reps)
        ids = torch.full((len(reps), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reps), width), dtype=torch.long)
        for i, s in enumerate(reps):
            ids[i, width - len(s.prompt_ids) :] = torch.tensor(s.prompt_ids)
            mask[i, width - len(s.prompt_ids) :] = 1
        ids, mask = ids.to(self.dev), mask.to(self.dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        echo = any(s.params.echo for s in seqs)
        room = max(s.params.max_tokens for s in seqs) + 1
        cache = RaggedCache(self.engine.base.config, capacity=width + room, pool=self.engine.kv_pool)
        self.composition = next(_compositions)
        logits = self._forward(
            [s.slot for s in reps],
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            logits_to_keep=0 if echo else 1,
        )
        if len(reps) < n:
            expand = torch.tensor(of, device=self.dev)
            cache.select(expand)
            ids, mask, pos, logits = ids[expand], mask[expand], pos[expand], logits[expand]
        if echo:
            # log_softmax by its normaliser: no float32 copy of the prompt's [rows, positions, vocab] logits
            body = logits[:, :-1]
            lse = log_normalizer(body)
            lp = body.gather(-1, ids[:, 1:, None]).squeeze(-1).float() - lse
            for i, s in enumerate(seqs):
                if s.params.echo:
                    start = width - len(s.prompt_ids)
                    s.prompt_logprobs = [None, *lp[i, start:].tolist()]
                    if s.params.top_logprobs:
                        top = _top(body[i, start:], s.params.top_logprobs, lse[i, start:])
                        s.prompt_top = [None, *top]
        last = logits[:, -1].float()
        # Prompt-only requests (max_tokens=0, scoring) are done after the prefill.
        scored = [i for i, s in enumerate(seqs) if s.params.max_tokens == 0]
        if scored:
            for i in scored:
                seq = seqs[i]
                seq.finish_reason = "length"
                self._retire(seq)
                if seq.on_event is not None:
                    seq.on_event(seq)
            live = [i for i in range(n) if seqs[i].params.max_tokens > 0]
            if not live:
                return
            idx = torch.tensor(live, device=self.dev)
            cache.select(idx)
            mask, pos, last = mask[idx], pos[idx], last[idx]
            seqs = [seqs[i] for i in live]
            width = mask.shape[1]
        if self.cache is None or self.mask is None or self.pos is None or self.logits is None:
            self.cache, self.mask, self.pos, self.logits = cache, mask, pos[:, -1], last
        else:
            length = max(self.mask.shape[1], width)
            self.cache.join(cache, max(room, self._room()))
            cache.release()  # what the join copied out of it
            self.mask = torch.cat(
                [
                    torch.nn.functional.pad(self.mask, (length - self.mask.shape[1], 0)),
                    torch.nn.functional.pad(mask, (length - width, 0)),
                ]
            )
            self.pos = torch.cat([self.pos, pos[:, -1]])
            self.logits = torch.cat([self.logits, last])
        self.seqs.extend(seqs)
        self.composition = next(_compositions)  # the prefill routed only the newcomers; the batch is new

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Choose one token for every running row, retire finished rows, run one decode forward.

        Returns the sequences that finished in this step."""
        if not self.seqs:
            return []
        assert (
            self.logits is not None
            and self.mask is not None
            and self.pos is not None
            and self.cache is not None
        )
        seqs = self.seqs
        tokens = choose_tokens(self.logits, [s.params for s in seqs], [s.generator for s in seqs])
        want_lp = any(s.params.logprobs for s in seqs)
        logp = torch.log_softmax(self.logits, dim=-1) if want_lp else None
        lps = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist() if logp is not None else None
        keep: list[int] = []
        done: list[Sequence] = []
        for j, (s, t) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
            n_before = len(s.out_ids)
            self._advance(s, t, None if lps is None else lps[j])
            if logp is not None and s.params.top_logprobs and len(s.out_ids) > n_before:
                s.top.append(_top(logp[j : j + 1], s.params.top_logprobs)[0])
            if s.finished:
                done.append(s)
            else:
                keep.append(j)
            if s.on_event is not None:
                s.on_event(s)
        for s in done:
            self._retire(s)
        if not keep:
            self.cache.release()
            self.seqs, self.cache, self.mask, self.pos, self.logits = [], None, None, None, None
            return done
        if len(keep) < len(seqs):
            idx = torch.tensor(keep, device=self.dev)
            self.cache.select(idx)
            self.mask, self.pos, tokens = self.mask[idx], self.pos[idx], tokens[idx]
            self.seqs = [seqs[j] for j in keep]
            self.composition = next(_compositions)
            lead = int((self.mask.cumsum(1) == 0).sum(1).min())  # columns every row pads
            if lead:
                self.cache.trim_left(lead)
                self.mask = self.mask[:, lead:]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.seqs), 1))], dim=1)
        self.pos = self.pos + 1
        fast = getattr(self.engine, "compiled_decode", None)
        if fast is not None and len(self.seqs) > 1:
            eng = self.engine
            with eng.exclusive():
                eng.lora.ctx.set_rows([s.slot for s in self.seqs], self.dev, key=self.composition)
                self.logits = fast(tokens, self.pos, self.mask.bool()[:, None, None, :], self.cache)
            return done
        self.logits = self._forward(
            [s.slot for s in self.seqs],
            input_ids=tokens[:, None],
            attention_mask=self._decode_mask(),
            position_ids=self.pos[:, None],
            past_key_values=self.cache,
        )[:, -1].float()
        return done

    def _decode_mask(self) -> torch.Tensor:
        """The decode forward's attention mask, [B, 1, 1, L] for the attention implementations that take one ready
        (transformers passes a 4-D mask through as is): the one query of each row sees the row's real tokens,
        what transformers would build from the 2-D mask (~0.2 ms per forward on a CPU, for a few ops here). Other
        implementations get the 2-D mask."""
        assert self.mask is not None
        impl = getattr(self.engine.base.model.config, "_attn_implementation", None)
        if impl == "sdpa":
            return self.mask.bool()[:, None, None, :]
        if impl == "eager":  # additive, as transformers makes it for eager attention
            dtype = self.engine.base.model.dtype
            seen = self.mask[:, None, None, :].bool()
            return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
                ~seen, torch.finfo(dtype).min
            )
        return self.mask

    def _advance(self, s: Sequence, token: int, logprob: float | None) -> None:
        p = s.params
        if s.cancelled:
            s.finish_reason = "abort"
            return
        s.out_ids.append(token)
        if logprob is not None and p.logprobs:
            s.out_logprobs.append(logprob)
        if token in self.engine.eos_ids and not p.ignore_eos:
            # kept in the tokens and logprobs, as vLLM does (its text is empty): lm-eval's scoring drops the
            # one generated token at the end of an echoed prompt, so that token must be there
            s.finish_reason = "stop"
            return
        if p.stop:
            text = self.engine.decode(s.out_ids)
            hit = min((text.find(x) for x in p.stop if x in text), default=-1)
            if hit >= 0:
                s.cut_text, s.finish_reason = text[:hit], "stop"
                return
        if len(s.out_ids) >= p.max_tokens:
            s.finish_reason = "length"

    def _retire(self, s: Sequence) -> None:
        if s.slot >= 0:
            self.engine.working_set.release(s.slot)
            s.slot = -2  # released; never release twice
        if self._on_finish is not None:
            self._on_finish(s)

    def abort_all(self, error: BaseException) -> list[Sequence]:
        """Finish every running row with `error` (the batch could not continue)."""
        done = self.seqs
        for s in done:
            s.error, s.finish_reason = error, "abort"
            self._retire(s)
            if s.on_event is not None:
                s.on_event(s)
        if self.cache is not None:
            self.cache.release()
        self.seqs, self.cache, self.mask, self.pos, self.logits = [], None, None, None, None
        return done
