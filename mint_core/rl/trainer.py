"""Many LoRA policies trained with GRPO at once over one shared base.

Every policy owns a slot of the engine's multi-LoRA banks. A step runs one batched rollout over the prompts of
all policies, then one batched forward/backward over all their rows, each row routed to its policy's slot, so
each policy's gradient lands only in its own slot. Each policy then takes its own AdamW step (its own state,
step count, learning rate, rank) on its slot, in place. The base never changes and no second model is loaded:
the reference for the KL term is the same forward with slot -1.

The banks hold B with alpha/r folded in; B's learning rate is scaled by the same factor, so updates match
PEFT's parameterisation (where the scale multiplies B in the forward).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from mint_core.data.tasks import Example
from mint_core.engine.engine import Engine
from mint_core.lora.adapter import AdapterWeights, save_adapter
from mint_core.rl.grpo import GRPOConfig, group_advantages, grpo_loss
from mint_core.rl.rollout import RolloutRow, rollout

logger = logging.getLogger(__name__)


class PolicySpec(BaseModel):
    """One policy of a multi-policy run."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    """Adapter name (also its MLflow registered model later)."""
    task: str
    """Task whose prompts it trains on (see mint_core.data.tasks)."""
    reward: str = "match_and_format"
    """Reward function name (see mint_core.rl.rewards)."""
    rank: int = Field(8, ge=1)
    """LoRA rank."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha (scale = alpha / rank)."""
    learning_rate: float | None = Field(None, gt=0)
    """This policy's learning rate (default: the GRPO config's)."""
    targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Short names of the sites it adapts."""


@dataclass
class _Adam:
    m: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # site -> (m_A, m_B)
    v: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    step: int = 0


@dataclass
class PolicyState:
    spec: PolicySpec
    slot: int
    sites: list[str]
    adam: _Adam

    @property
    def scale(self) -> float:
        return self.spec.alpha / self.spec.rank


@dataclass
class StepStats:
    step: int
    seconds: float
    reward: dict[str, float]  # mean reward per policy in this step's rollouts
    loss: dict[str, float]
    kept_groups: dict[str, int]
    extra: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class _Batch:
    """One update's rows as tensors: right-padded prompt + completion ids, and what the loss needs."""

    ids: torch.Tensor  # [B, T]
    attn: torch.Tensor  # [B, T]
    comp: torch.Tensor  # [B, T-1] next-token targets that are completion tokens of kept groups
    adv: torch.Tensor  # [B] group-relative advantages
    keep: torch.Tensor  # [B] bool, on the host: the row's group carries signal (or nothing is dropped)
    slots: list[int]  # each row's policy slot


class MultiPolicyTrainer:
    def __init__(self, engine: Engine, config: GRPOConfig, policies: list[PolicySpec], seed: int = 0):
        names = [p.name for p in policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique: {names}")
        if len(policies) > engine.config.max_loras:
            raise ValueError(
                f"{len(policies)} policies need {len(policies)} slots; the engine has {engine.config.max_loras}"
            )
        for p in policies:
            if p.rank > engine.config.max_lora_rank:
                raise ValueError(
                    f"policy {p.name}: rank {p.rank} is above the engine's max rank {engine.config.max_lora_rank}"
                )
        self.engine = engine
        self.config = config
        self.seed = seed
        self.policies: dict[str, PolicyState] = {}
        g = torch.Generator().manual_seed(seed)
        for spec in policies:
            if spec.name not in engine.working_set.names():
                engine.add_adapter(spec.name, self._fresh(spec, g))
            slot = engine.working_set.pin(spec.name)
            sites = [s for s in engine.sites if engine.sites[s].short in spec.targets]
            if not sites:
                raise ValueError(
                    f"policy {spec.name}: targets {spec.targets} match no LoRA site of the engine"
                )
            self.policies[spec.name] = PolicyState(spec, slot, sites, self._zero_adam(sites))
        self.steps = 0

    # ---- setup ----------------------------------------------------------------------------------------

    def _fresh(self, spec: PolicySpec, g: torch.Generator) -> AdapterWeights:
        """PEFT's default init: A kaiming-uniform (a=sqrt(5)), B zero, so the policy starts as the base."""
        tensors = {}
        for name, site in self.engine.sites.items():
            if site.short not in spec.targets:
                continue
            lead = (site.experts,) if site.experts else ()
            bound = 1.0 / math.sqrt(site.in_features)
            A = (torch.rand(*lead, spec.rank, site.in_features, generator=g) * 2 - 1) * bound
            tensors[name] = (A, torch.zeros(*lead, site.out_features, spec.rank))
        return AdapterWeights(spec.rank, spec.alpha, tensors, self.engine.base.fingerprint)

    def _zero_adam(self, sites: list[str]) -> _Adam:
        adam = _Adam()
        for s in sites:
            bank = self.engine.lora.banks[s]
            adam.m[s] = (torch.zeros_like(bank.A[0]), torch.zeros_like(bank.B[0]))
            adam.v[s] = (torch.zeros_like(bank.A[0]), torch.zeros_like(bank.B[0]))
        return adam

    # ---- one step ------------------------------------------------------------------------------------

    def step(self, prompts: dict[str, list[Example]]) -> StepStats:
        """Rollout -> advantages -> one batched forward/backward -> one AdamW step per policy."""
        t0 = time.perf_counter()
        unknown = set(prompts) - set(self.policies)
        if unknown:
            raise KeyError(f"no such policies: {sorted(unknown)}")
        cfg = self.config
        rows = rollout(
            self.engine,
            prompts,
            {p: self.policies[p].spec.reward for p in prompts},
            cfg.group_size,
            cfg.max_new_tokens,
            cfg.temperature,
            seed=self.seed * 1_000_003 + self.steps,
        )
        stats = self.update(rows)
        stats.seconds = time.perf_counter() - t0
        return stats

    def update(self, rows: list[RolloutRow]) -> StepStats:
        """One GRPO update of every policy that has rows."""
        eng = self.engine
        batch = self._batch(rows)
        ref = self._reference(batch)
        banks = [eng.lora.banks[s] for p in self.policies.values() for s in p.sites]
        for b in set(banks):
            b.A.requires_grad_(True)
            b.B.requires_grad_(True)
        try:
            with torch.enable_grad(), eng._forward_lock:
                eng.lora.ctx.set_rows(batch.slots, batch.ids.device)
                try:
                    lp = _token_logprobs(
                        eng.base.model(input_ids=batch.ids, attention_mask=batch.attn).logits, batch.ids
                    )
                finally:
                    eng.lora.ctx.clear()
                total, losses, extra = self._losses(rows, batch, lp, ref)
                total.backward()
            with torch.no_grad():
                for name in losses:
                    self._adam_step(self.policies[name])
        finally:
            for b in set(banks):
                b.A.grad = None
                b.B.grad = None
                b.A.requires_grad_(False)
                b.B.requires_grad_(False)
        self.steps += 1
        return self._stats(rows, batch, losses, extra)

    def _batch(self, rows: list[RolloutRow]) -> _Batch:
        """Group advantages, and one right-padded batch of prompt + completion for every row."""
        cfg = self.config
        eng = self.engine
        by_group: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_group.setdefault(r.group, []).append(i)
        adv = torch.zeros(len(rows))
        keep = torch.zeros(len(rows), dtype=torch.bool)
        for idx in by_group.values():
            rewards = torch.tensor([[rows[i].reward for i in idx]])
            a, k = group_advantages(rewards, cfg.advantage)
            adv[idx] = a[0]
            keep[idx] = bool(k[0]) or not cfg.drop_zero_variance
        seqs = [r.prompt_ids + r.completion_ids for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(rows), width), eng.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        comp = torch.zeros((len(rows), width - 1))  # mask over next-token targets that are completion tokens
        for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            if keep[i]:
                comp[i, len(r.prompt_ids) - 1 : len(s) - 1] = 1
        dev = eng.base.device
        slots = [self.policies[r.policy].slot for r in rows]
        return _Batch(ids.to(dev), attn.to(dev), comp.to(dev), adv.to(dev), keep, slots)

    def _reference(self, batch: _Batch) -> torch.Tensor | None:
        """Token logprobs of the bare base (slot -1) for the KL term; None when kl_coef is 0."""
        if self.config.kl_coef <= 0:
            return None
        eng = self.engine
        with torch.no_grad(), eng._forward_lock:
            eng.lora.ctx.set_rows([-1] * len(batch.slots), batch.ids.device)
            try:
                logits = eng.base.model(input_ids=batch.ids, attention_mask=batch.attn).logits
            finally:
                eng.lora.ctx.clear()
            return _token_logprobs(logits, batch.ids)

    def _losses(
        self, rows: list[RolloutRow], batch: _Batch, lp: torch.Tensor, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float], dict[str, dict[str, float]]]:
        """Each policy's GRPO loss over its own rows, and their sum (what backward runs on). A policy with no
        kept token (no rows, or every group without variance) gets no loss and so no step at all, since Adam's
        momentum would still move the weights on a zero gradient."""
        losses: dict[str, float] = {}
        extra: dict[str, dict[str, float]] = {}
        total = lp.sum() * 0.0
        for name in self.policies:
            sel = torch.tensor([r.policy == name for r in rows], device=lp.device)
            if not bool(batch.comp[sel].any()):
                continue
            loss, st = grpo_loss(
                lp[sel],
                lp[sel].detach(),
                batch.adv[sel],
                batch.comp[sel],
                self.config,
                None if ref is None else ref[sel],
            )
            total = total + loss
            losses[name] = float(loss.detach())
            extra[name] = st
        return total, losses, extra

    def _stats(
        self,
        rows: list[RolloutRow],
        batch: _Batch,
        losses: dict[str, float],
        extra: dict[str, dict[str, float]],
    ) -> StepStats:
        reward = {p: float(torch.tensor([r.reward for r in rows if r.policy == p]).mean()) for p in losses}
        kept = {
            p: len({r.group for r, k in zip(rows, batch.keep.tolist(), strict=True) if r.policy == p and k})
            for p in losses
        }
        return StepStats(self.steps, 0.0, reward, losses, kept, extra)

    def _adam_step(self, p: PolicyState) -> None:
        """AdamW on this policy's slot only (decoupled weight decay, bias correction, global-norm clipping)."""
        cfg = self.config
        banks = [self.engine.lora.banks[s] for s in p.sites]
        grads = [
            (b.A.grad[p.slot], b.B.grad[p.slot])
            for b in banks
            if b.A.grad is not None and b.B.grad is not None
        ]
        if len(grads) != len(banks):
            return
        clip = 1.0
        if cfg.max_grad_norm is not None:
            norm = torch.sqrt(sum((gA.pow(2).sum() + gB.pow(2).sum() for gA, gB in grads), torch.tensor(0.0)))
            clip = min(1.0, cfg.max_grad_norm / (float(norm) + 1e-6))
        p.adam.step += 1
        t = p.adam.step
        b1, b2 = cfg.adam_betas
        lr = p.spec.learning_rate or cfg.learning_rate
        for s, b, (gA, gB) in zip(p.sites, banks, grads, strict=True):
            for j, (param, g) in enumerate(((b.A, gA), (b.B, gB))):
                w = param.data[p.slot]
                m, v = p.adam.m[s][j], p.adam.v[s][j]
                g = g * clip
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                step_lr = lr * (p.scale if j == 1 else 1.0)
                if cfg.weight_decay:
                    w.mul_(1 - step_lr * cfg.weight_decay)
                denom = (v / (1 - b2**t)).sqrt_().add_(cfg.adam_eps)
                w.addcdiv_(m / (1 - b1**t), denom, value=-step_lr)

    # ---- out ----------------------------------------------------------------------------------------

    def weights(self, name: str) -> AdapterWeights:
        """The policy's current adapter, read from its slot (scale taken back out of B)."""
        p = self.policies[name]
        tensors = {}
        for s in p.sites:
            A, B = self.engine.lora.banks[s].read(p.slot, p.spec.rank, p.scale)
            tensors[s] = (A.detach().cpu().clone(), B.detach().cpu().clone())
        return AdapterWeights(
            p.spec.rank, p.spec.alpha, tensors, self.engine.base.fingerprint, self.engine.base.name
        )

    def export(self, name: str, path: Path) -> str:
        """Write the policy's current revision in PEFT format; returns its digest."""
        return save_adapter(self.weights(name), path, self.engine.sites)

    def save_state(self, path: Path) -> None:
        """Adapters and optimizer state of every policy, so a run resumes where it stopped."""
        path.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        meta = {"steps": self.steps, "seed": self.seed, "config": self.config.model_dump(), "policies": {}}
        for name, p in self.policies.items():
            meta["policies"][name] = {"spec": p.spec.model_dump(), "adam_step": p.adam.step}  # type: ignore[index]
            for s in p.sites:
                bank = self.engine.lora.banks[s]
                tensors[f"{name}/{s}/A"] = bank.A.data[p.slot].cpu().contiguous()
                tensors[f"{name}/{s}/B"] = bank.B.data[p.slot].cpu().contiguous()
                for j, ab in enumerate("AB"):
                    tensors[f"{name}/{s}/m{ab}"] = p.adam.m[s][j].cpu().contiguous()
                    tensors[f"{name}/{s}/v{ab}"] = p.adam.v[s][j].cpu().contiguous()
        save_file(tensors, str(path / "state.safetensors"))
        (path / "state.json").write_text(json.dumps(meta, indent=2, default=str))

    def load_state(self, path: Path) -> None:
        meta = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "state.safetensors"))
        missing = set(self.policies) ^ set(meta["policies"])
        if missing:
            raise ValueError(f"saved state has other policies: {sorted(missing)}")
        with torch.no_grad():
            for name, p in self.policies.items():
                p.adam.step = int(meta["policies"][name]["adam_step"])
                for s in p.sites:
                    bank = self.engine.lora.banks[s]
                    bank.A.data[p.slot].copy_(tensors[f"{name}/{s}/A"])
                    bank.B.data[p.slot].copy_(tensors[f"{name}/{s}/B"])
                    for j, ab in enumerate("AB"):
                        p.adam.m[s][j].copy_(tensors[f"{name}/{s}/m{ab}"])
                        p.adam.v[s][j].copy_(tensors[f"{name}/{s}/v{ab}"])
        self.steps = int(meta["steps"])


def _token_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position: [B, T-1]."""
    return torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
