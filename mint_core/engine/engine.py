"""The engine: one resident base, a working set of adapter slots, batched generation with mixed adapters."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mint_core.engine.base import Base
from mint_core.engine.kv_cache import preallocated_cache
from mint_core.engine.sampling import SamplingParams, choose_tokens
from mint_core.engine.working_set import WorkingSet
from mint_core.errors import AdapterError, MintError
from mint_core.lora.adapter import AdapterWeights, to_peft_state
from mint_core.lora.layers import LoRAModel, inject
from mint_core.lora.validate import BaseSpec, read_adapter

logger = logging.getLogger(__name__)


class EngineConfig(BaseModel):
    """How an engine holds its base and adapters."""

    model_config = ConfigDict(extra="forbid")

    max_loras: int = Field(8, ge=1, le=65536)
    """Device slots: adapters that can run in one batch without a load."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """Host cache of adapter revisions behind the slots (default 4 x max_loras; at least max_loras)."""
    max_lora_rank: int = Field(16, ge=1, le=1024)
    """Largest rank an adapter may have; slots are sized for it."""
    target_modules: list[str] | Literal["all"] = "all"
    """Short names of the sites that get LoRA slots (q_proj, o_proj, gate_up_proj, ...), or every linear
    and expert parameter of the decoder layers."""
    allowed_roots: list[Path] | None = None
    """If set, adapters may only be loaded from inside these directories."""
    max_model_len: int = Field(2048, ge=8)
    """Longest prompt + completion, in tokens."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


class RequestError(MintError):
    """A generation request that cannot be served as asked (prompt too long, unknown adapter, ...)."""


@dataclass
class Request:
    prompt: str | list[int]
    adapter: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    adapter: str | None
    revision: str | None  # digest of the adapter revision that served this request
    prompt_token_ids: list[int]
    logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None


class Engine:
    """A base model held once, with multi-LoRA slots injected into its layers."""

    def __init__(self, base: Base, config: EngineConfig | None = None):
        self.base = base
        self.config = config = config or EngineConfig()
        if base.tokenizer is None:
            raise ValueError("the engine needs a base with a tokenizer")
        self.tokenizer = base.tokenizer
        targets = set(base.sites) if config.target_modules == "all" else None
        sites = {
            n: s
            for n, s in base.sites.items()
            if targets is not None or s.short in set(config.target_modules)
        }
        if not sites:
            raise ValueError(f"target_modules {config.target_modules} match no layer of the base")
        self.sites = sites
        self.lora: LoRAModel = inject(base.model, sites.values(), config.max_loras, config.max_lora_rank)
        self.spec = BaseSpec(
            base.fingerprint,
            sites,
            config.max_lora_rank,
            frozenset(base.sites) | {s.module_path for s in base.sites.values()},
        )
        assert config.max_cpu_loras is not None
        self.working_set = WorkingSet(self.lora, config.max_cpu_loras, reload=self._read)
        # One forward at a time: the LoRA context is shared state of the model.
        self._forward_lock = threading.Lock()
        self._generator = torch.Generator(device=base.device).manual_seed(0)
        eos = self.tokenizer.eos_token_id
        self.eos_id: int | None = int(eos) if eos is not None else None
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (eos or 0))
        positions = getattr(base.config, "max_position_embeddings", None) or config.max_model_len
        self.max_model_len = min(config.max_model_len, int(positions))

    # ---- adapters -----------------------------------------------------------------------------------------

    def _read(self, name: str, path: Path) -> AdapterWeights:
        return read_adapter(path, self.spec, name=name, allowed_roots=self.config.allowed_roots)

    def load_adapter(self, name: str, path: str | Path, replace: bool = False) -> bool:
        """Validate the adapter at `path`, then register it as `name`. False if `name` already is that revision."""
        weights = self._read(name, Path(path))  # raises AdapterError before any state changes
        return self.working_set.add(name, weights, source=Path(path), replace=replace)

    def add_adapter(self, name: str, weights: AdapterWeights, replace: bool = False) -> bool:
        """Register in-memory weights (trainer handoff); checked against the base like a file would be."""
        problems: list[str] = []
        if weights.rank > self.config.max_lora_rank:
            problems.append(f"rank {weights.rank} is above the engine's max rank {self.config.max_lora_rank}")
        if weights.base_fingerprint not in (None, self.base.fingerprint):
            problems.append(
                f"made for base {weights.base_fingerprint[:12]}, this engine's is {self.base.fingerprint[:12]}"
            )
        for site, (A, B) in weights.tensors.items():
            if site not in self.sites:
                problems.append(f"target {site} is not a LoRA site of this engine")
            elif (
                A.shape[-2] != weights.rank
                or B.shape[-1] != weights.rank
                or A.shape[-1] != self.sites[site].in_features
                or B.shape[-2] != self.sites[site].out_features
            ):
                problems.append(
                    f"target {site}: shapes A{tuple(A.shape)} B{tuple(B.shape)} do not fit the base at rank {weights.rank}"
                )
            elif not (torch.isfinite(A).all() and torch.isfinite(B).all()):
                problems.append(f"target {site} has non-finite values")
        if problems:
            raise AdapterError(name, None, problems)
        if weights.digest is None:
            h = hashlib.sha256()
            for k, t in sorted(to_peft_state(weights.tensors, self.sites).items()):
                h.update(k.encode())
                h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
            weights.digest = h.hexdigest()
        return self.working_set.add(name, weights, replace=replace)

    def unload_adapter(self, name: str) -> bool:
        return self.working_set.remove(name)

    # ---- forward ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(
        self,
        input_ids: torch.Tensor,
        adapters: Sequence[str | None],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full-sequence logits [B, T, V] with each row run under its own adapter (None = bare base)."""
        slots = self._acquire(adapters)
        try:
            with self._forward_lock:
                self.lora.ctx.set_rows(slots, self.base.device)
                try:
                    out = self.base.model(
                        input_ids=input_ids.to(self.base.device), attention_mask=attention_mask
                    )
                finally:
                    self.lora.ctx.clear()
            return out.logits
        finally:
            self._release(slots)

    def _acquire(self, adapters: Sequence[str | None]) -> list[int]:
        slots: list[int] = []
        try:
            for a in adapters:
                slots.append(-1 if a is None else self.working_set.acquire(a))
        except Exception:
            self._release(slots)
            raise
        return slots

    def _release(self, slots: list[int]) -> None:
        for s in slots:
            if s >= 0:
                self.working_set.release(s)

    # ---- generation ---------------------------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise RequestError("prompt is empty")
        return ids

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run all requests as one batch (each with its own adapter or none) to completion."""
        if not requests:
            return []
        prompts = [self._encode(r.prompt) for r in requests]
        for i, (p, r) in enumerate(zip(prompts, requests, strict=True)):
            if len(p) + r.params.max_tokens > self.max_model_len:
                raise RequestError(
                    f"request {i}: prompt ({len(p)} tokens) + max_tokens ({r.params.max_tokens}) exceeds "
                    f"max_model_len {self.max_model_len}"
                )
        slots = self._acquire([r.adapter for r in requests])
        try:
            revisions = [self.working_set.revision_in(s) if s >= 0 else None for s in slots]
            with self._forward_lock:
                try:
                    results = self._decode(prompts, requests, slots)
                finally:
                    self.lora.ctx.clear()
        finally:
            self._release(slots)
        for res, rev in zip(results, revisions, strict=True):
            res.revision = rev
        return results

    def _decode(
        self, prompts: list[list[int]], requests: Sequence[Request], slots: list[int]
    ) -> list[Completion]:
        dev = self.base.device
        model = self.base.model
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        params = [r.params for r in requests]
        gens = [
            torch.Generator(device=dev).manual_seed(p.seed) if p.seed is not None else self._generator
            for p in params
        ]
        echo = any(p.echo for p in params)
        ctx = self.lora.ctx
        ctx.set_rows(slots, dev)
        cache = preallocated_cache(model.config, width + max(p.max_tokens for p in params))
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if echo else 1,
        )
        prompt_lp: list[list[float | None] | None] = [None] * n
        if echo:
            lp = (
                torch.log_softmax(out.logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            )
            for i, p in enumerate(prompts):
                if params[i].echo:
                    prompt_lp[i] = [None, *lp[i, width - len(p) :].tolist()]
        logits = out.logits[:, -1].float()

        gen_ids: list[list[int]] = [[] for _ in range(n)]
        gen_lp: list[list[float]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        texts: list[str | None] = [None] * n
        active = list(range(n))  # original row index of each live batch row
        last_pos = pos[:, -1]
        while True:
            tokens = choose_tokens(logits, [params[i] for i in active], [gens[i] for i in active])
            want_lp = any(params[i].logprobs for i in active)
            lps = (
                torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1).tolist()
                if want_lp
                else None
            )
            tok_list = tokens.tolist()
            keep: list[int] = []
            for j, i in enumerate(active):
                t = tok_list[j]
                sp = params[i]
                if t == self.eos_id and not sp.ignore_eos:
                    finish[i] = "stop"
                    continue
                gen_ids[i].append(t)
                if lps is not None:
                    gen_lp[i].append(lps[j])
                if sp.stop:
                    text = str(self.tokenizer.decode(gen_ids[i], skip_special_tokens=True))
                    hit = min((text.find(s) for s in sp.stop if s in text), default=-1)
                    if hit >= 0:
                        texts[i], finish[i] = text[:hit], "stop"
                        continue
                if len(gen_ids[i]) >= sp.max_tokens:
                    finish[i] = "length"
                    continue
                keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                mask, last_pos, tokens = mask[idx], last_pos[idx], tokens[idx]
                active = [active[j] for j in keep]
                ctx.set_rows([slots[i] for i in active], dev)
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            last_pos = last_pos + 1
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=last_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1].float()

        results = []
        for i in range(n):
            cut = texts[i]
            text = (
                cut if cut is not None else str(self.tokenizer.decode(gen_ids[i], skip_special_tokens=True))
            )
            results.append(
                Completion(
                    text=text,
                    token_ids=gen_ids[i],
                    finish_reason="length" if finish[i] == "length" else "stop",
                    adapter=requests[i].adapter,
                    revision=None,
                    prompt_token_ids=prompts[i],
                    logprobs=gen_lp[i] if params[i].logprobs else None,
                    prompt_logprobs=prompt_lp[i],
                )
            )
        return results
