"""The engine: one resident base, a working set of adapter slots, batched generation with mixed adapters."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mint_core.engine.base import Base
from mint_core.engine.batcher import Batcher
from mint_core.engine.chat import stop_token_ids
from mint_core.engine.compiled_decode import CompiledDecode
from mint_core.engine.kv_cache import BufferPool
from mint_core.engine.sequence import Completion, Request, RequestError, Sequence
from mint_core.engine.working_set import WorkingSet
from mint_core.errors import AdapterError
from mint_core.lora.adapter import AdapterWeights, adapter_bytes, digest_files
from mint_core.lora.layers import LoRAModel, inject
from mint_core.lora.validate import BaseSpec, nonfinite_sites, read_adapter

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
    compile_decode: bool = False
    """Run decode steps through a compiled, written-out forward (`mint_core.engine.compiled_decode`; Llama,
    Mistral and Qwen2 bases): faster a step once compiled, at the price of compiling on the first step."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


def _contiguous_head_input(model: torch.nn.Module) -> None:
    """Hand the output projection a contiguous input. A prefill keeps only the last position's logits
    (`logits_to_keep`), a strided slice of the hidden states; on CPU a bfloat16 `linear` over such a slice
    copies the whole transposed weight on every call (1.2 s a prefill for a 151,936 x 896 head, against 21 ms
    for the same product over a contiguous copy of the one row)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, torch.nn.Module):
        head.register_forward_pre_hook(lambda _m, args: tuple(_dense(a) for a in args))


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x with row-major strides. `contiguous()` is not enough: a [B, 1, H] slice of [B, T, H] counts as
    contiguous when B is 1 yet keeps the stride T * H, which sends `linear` down the copying path."""
    want, step = [], 1
    for n in reversed(x.shape):
        want.append(step)
        step *= n
    if list(x.stride()) == want[::-1]:
        return x
    return x.clone(memory_format=torch.contiguous_format)


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
        _contiguous_head_input(base.model)
        self.spec = BaseSpec(
            base.fingerprint,
            sites,
            config.max_lora_rank,
            frozenset(base.sites) | {s.module_path for s in base.sites.values()},
        )
        assert config.max_cpu_loras is not None
        self.working_set = WorkingSet(self.lora, config.max_cpu_loras, reload=self.read_adapter)
        # spare KV-cache buffers on the CPU, reused by the next batch instead of fresh pages (`kv_cache`); on a
        # GPU torch's caching allocator does this already
        self.kv_pool: BufferPool | None = BufferPool() if base.device.type == "cpu" else None
        # One forward at a time: the LoRA context is shared state of the model.
        self._forward_lock = threading.Lock()
        self._generator = torch.Generator(device=base.device).manual_seed(0)
        eos = self.tokenizer.eos_token_id
        self.eos_id: int | None = int(eos) if eos is not None else None
        # generation ends at any of these: the tokenizer's EOS and generation_config's eos_token_id (a chat
        # template's end of turn), the set vLLM stops at
        gen = getattr(base.model, "generation_config", None)
        self.eos_ids: frozenset[int] = stop_token_ids(self.tokenizer, getattr(gen, "eos_token_id", None))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (eos or 0))
        positions = getattr(base.config, "max_position_embeddings", None) or config.max_model_len
        self.compiled_decode: CompiledDecode | None = (
            CompiledDecode(base.model, self.lora.ctx) if config.compile_decode else None
        )
        self.max_model_len = min(config.max_model_len, int(positions))

    # ---- adapters -----------------------------------------------------------------------------------------

    def read_adapter(self, name: str, path: Path) -> AdapterWeights:
        """Read the adapter at `path` and check it against this engine's base; one AdapterError naming `name`
        and every problem otherwise. Changes nothing."""
        return read_adapter(
            path, self.spec, name=name, allowed_roots=self.config.allowed_roots, prepare=self.lora.prepare
        )

    def load_adapter(self, name: str, path: str | Path, replace: bool = False) -> bool:
        """Validate the adapter at `path`, then register it as `name`. False if `name` already is that revision.

        For code that holds the engine in-process (trainer handoffs, tests); a server changes its adapters only
        through `engine.loader.AdapterManager`, which also loads catalog addresses on demand."""
        weights = self.read_adapter(name, Path(path))  # raises AdapterError before any state changes
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
        fit = {}  # the sites whose tensors the engine would take: checked for NaN and inf below, all at once
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
            else:
                fit[site] = (A, B)
        problems += [f"target {site} has non-finite values" for site in nonfinite_sites(fit)]
        if problems:
            raise AdapterError(name, None, problems)
        if (
            weights.digest is None
        ):  # made in memory (a trainer's handoff): named as its exported files would be
            weights.digest = digest_files(*adapter_bytes(weights, self.sites))
        return self.working_set.add(name, weights, replace=replace)

    def unload_adapter(self, name: str) -> bool:
        return self.working_set.remove(name)

    # ---- forward ------------------------------------------------------------------------------------------

    def exclusive(self) -> AbstractContextManager[bool]:
        """The model alone for a `with` block: no other forward runs meanwhile (serving's batcher, a training
        step, a Tinker call), since the LoRA context that routes each row to its slot is shared state of the
        model. Every forward on the resident base, and every write of a slot a forward reads, takes it."""
        return self._forward_lock

    @torch.no_grad()
    def logits(
        self,
        input_ids: torch.Tensor,
        adapters: Sequence_[str | None],
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

    def _acquire(self, adapters: Sequence_[str | None]) -> list[int]:
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

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _encode(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise RequestError("prompt is empty")
        return ids

    def new_sequence(self, request: Request, on_event: Callable[[Sequence], None] | None = None) -> Sequence:
        """Check a request against this engine (prompt length, adapter name) and wrap it; holds no slot yet."""
        ids = self._encode(request.prompt)
        if len(ids) + request.params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({request.params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if request.adapter is not None:
            self.working_set.digest_of(request.adapter)  # UnknownAdapter now rather than at admission
        seed = request.params.seed
        gen = (
            torch.Generator(device=self.base.device).manual_seed(seed)
            if seed is not None
            else self._generator
        )
        return Sequence(request, ids, gen, on_event)

    def acquire_slot(self, seq: Sequence) -> None:
        """Pin the revision `seq` will be served by (held until it finishes)."""
        if seq.request.adapter is not None:
            seq.slot = self.working_set.acquire(seq.request.adapter)
            seq.revision = self.working_set.revision_in(seq.slot)

    @torch.inference_mode()
    def generate(self, requests: Sequence_[Request]) -> list[Completion]:
        """Run all requests as one batch (each with its own adapter or none) to completion."""
        seqs = []
        for i, r in enumerate(requests):
            try:
                seqs.append(self.new_sequence(r))
            except RequestError as e:
                raise RequestError(f"request {i}: {e}") from None
        batcher = Batcher(self)
        try:
            for s in seqs:
                self.acquire_slot(s)
            batcher.admit(seqs)
            while len(batcher):
                batcher.step()
        finally:
            for s in seqs:  # on error, give back whatever is still held
                if s.slot >= 0:
                    self.working_set.release(s.slot)
                    s.slot = -2
        return [s.completion(self.decode) for s in seqs]


__all__ = ["Completion", "Engine", "EngineConfig", "Request", "RequestError"]
