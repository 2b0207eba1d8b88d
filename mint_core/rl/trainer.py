"""Many LoRA policies trained with GRPO at once over one shared base.

Every policy owns a slot of the engine's multi-LoRA banks. A step runs one batched rollout over the prompts of
all policies, then one batched forward/backward over all their rows, each row routed to its policy's slot, so
each policy's gradient lands only in its own slot. Each policy then takes its own AdamW step (its own state,
step count, learning rate, rank) on its slot, in place: torch's fused AdamW over views of the slots
(`SlotAdamW`). The base never changes and no second model is loaded: the reference for the KL term is the same
forward with slot -1.

The G rows of a group share their prompt, so the update's forward runs each distinct (policy, prompt) once,
packed with its rows' completions behind a block mask (`mint_core.rl.packing`): the prompt's forward and backward are
paid once per group instead of G times, with the same logprobs and gradients.

With `micro_batch_rows` set, the forward/backward runs over micro-batches of at most that many rows (rows
ordered by policy) and gradients accumulate across them, so activation memory stays that of one micro-batch
however many policies train. Each policy's loss keeps its normalisation over all of its rows, so the
update is the same as in one batch (up to float summation order).

The banks hold B with alpha/r folded in; B's learning rate is scaled by the same factor, so updates match
PEFT's parameterisation (where the scale multiplies B in the forward).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mint_core.data.generators import Example
from mint_core.data.rewards import Rewarder
from mint_core.engine.engine import Engine
from mint_core.engine.logprobs import head_logprobs, selected_logprobs, token_logprobs
from mint_core.lora.adapter import AdapterWeights, initial_adapter, save_adapter
from mint_core.rl.grpo import GRPOConfig, group_advantages, grpo_loss, k3_kl
from mint_core.rl.optim import SlotAdamW
from mint_core.rl.packing import Packing
from mint_core.rl.policy import PolicySpec, PolicyState, rollout_seed
from mint_core.rl.rollout import RolloutRow, rollout
from mint_core.types import Digest

logger = logging.getLogger(__name__)

# Model types whose causal LM ends in a plain linear projection to the vocabulary (no scaling or soft-capping of
# the logits after it): the update fuses that projection with its log-softmax (see `_output_mode`).
PLAIN_HEAD_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
    }
)

# The default of `fused_head_min_bytes`: the update fuses the output projection with its log-softmax
# (`_output_mode` "hidden") only when the logits it would otherwise hold, float32 at the predicted positions,
# reach this size; below it, making them once is faster.
FUSED_HEAD_MIN_BYTES = 512 * 2**20

# How a checkpoint names a site's AdamW moments (`SlotAdamW.moments` order).
_MOMENTS = ("mA", "vA", "mB", "vB")


@dataclass
class StepStats:
    step: int
    seconds: float
    reward: dict[str, float]  # mean reward per policy in this step's rollouts
    loss: dict[str, float]
    kept_groups: dict[str, int]
    extra: dict[str, dict[str, float]] = field(default_factory=dict)


def _subset_kl(
    lp: torch.Tensor, ref: torch.Tensor, comp: torch.Tensor, rows: list[int], ref_rows: list[int]
) -> float:
    """Mean k3 KL to the base over the completion tokens of `rows`, `ref` holding the base's logprobs of
    `ref_rows` (a superset, in that order, cut to its own width); 0 when they have no such token."""
    if not rows:
        return 0.0
    at = {r: j for j, r in enumerate(ref_rows)}
    width = ref.shape[1]
    idx = torch.tensor(rows, device=lp.device)
    ref_idx = torch.tensor([at[r] for r in rows], device=ref.device)
    mask = comp.index_select(0, idx)[:, :width].bool()
    if not bool(mask.any()):
        return 0.0
    kl = k3_kl(lp.detach().index_select(0, idx)[:, :width], ref.index_select(0, ref_idx))
    return float(kl[mask].mean())


@dataclass
class _Batch:
    """One update's rows as tensors: right-padded prompt + completion ids, and what the loss needs."""

    ids: torch.Tensor  # [B, T]
    attn: torch.Tensor  # [B, T]
    comp: torch.Tensor  # [B, T-1] next-token targets that are completion tokens of kept groups
    adv: torch.Tensor  # [B] group-relative advantages
    keep: torch.Tensor  # [B] bool, on the host: the row's group carries signal (or nothing is dropped)
    slots: list[int]  # each row's policy slot
    prompt_lens: list[int] = field(default_factory=list)  # each row's prompt length (its completion follows)
    groups: list[int] = field(default_factory=list)  # each row's group (one prompt, G completions)

    def take(self, idx: Sequence[int]) -> _Batch:
        """The rows `idx` as a batch of their own, right padding beyond its longest row cut off."""
        at = torch.tensor(list(idx), dtype=torch.long)
        at_dev = at.to(self.ids.device)
        attn = self.attn.index_select(0, at_dev)
        width = int(attn.sum(dim=1).max())
        return _Batch(
            self.ids.index_select(0, at_dev)[:, :width],
            attn[:, :width],
            self.comp.index_select(0, at_dev)[:, : width - 1],
            self.adv.index_select(0, at_dev),
            self.keep.index_select(0, at),
            [self.slots[i] for i in idx],
            [self.prompt_lens[i] for i in idx] if self.prompt_lens else [],
            [self.groups[i] for i in idx] if self.groups else [],
        )


class MultiPolicyTrainer:
    def __init__(
        self,
        engine: Engine,
        config: GRPOConfig,
        policies: list[PolicySpec],
        seed: int = 0,
        micro_batch_rows: int | None = None,
        fused_head_min_bytes: int = FUSED_HEAD_MIN_BYTES,
    ):
        """`micro_batch_rows`: most rows in one forward/backward of an update (gradients accumulate over
        the micro-batches, each policy's loss still normalised over all its rows); None: all rows at once.
        `fused_head_min_bytes`: from this size of float32 logits at the predicted positions of one forward,
        the output projection runs fused with the log-softmax (less memory, the projection made twice); see
        `_output_mode`."""
        names = [p.name for p in policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique: {names}")
        if micro_batch_rows is not None and micro_batch_rows < 1:
            raise ValueError(f"micro_batch_rows must be >= 1 or None, got {micro_batch_rows}")
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
        self.rewarder = Rewarder()
        """Scores every rollout by its task's spec (a user's reward runs in its process pool)."""
        self.micro_batch_rows = micro_batch_rows
        if fused_head_min_bytes < 0:
            raise ValueError(f"fused_head_min_bytes must be >= 0, got {fused_head_min_bytes}")
        self.fused_head_min_bytes = fused_head_min_bytes
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
            self.policies[spec.name] = PolicyState(spec, slot, sites)
        self.adamw = SlotAdamW(engine.lora.banks, list(self.policies.values()), config)
        self.steps = 0
        self._output: Literal["hidden", "logits", "full"] | None = None  # see _output_mode
        # how the last packed forward got its logprobs out of the model (one of _output_mode's answers)
        self.last_output: str | None = None

    # ---- setup ----------------------------------------------------------------------------------------

    def _fresh(self, spec: PolicySpec, g: torch.Generator) -> AdapterWeights:
        """PEFT's default init: the policy starts as the base (`lora.adapter.initial_adapter`)."""
        return initial_adapter(
            self.engine.sites, spec.targets, spec.rank, spec.alpha, g, self.engine.base.fingerprint
        )

    # ---- one step ------------------------------------------------------------------------------------

    def step(self, prompts: dict[str, list[Example]]) -> StepStats:
        """Rollout -> advantages -> one batched forward/backward -> one AdamW step per policy."""
        t0 = time.perf_counter()
        stats = self.update(self.rollout(prompts))
        stats.seconds = time.perf_counter() - t0
        return stats

    def group_size(self, name: str) -> int:
        """Completions per prompt of a policy: its spec's, else the run's."""
        return self.policies[name].spec.group_size or self.config.group_size

    def group_sizes(self) -> list[int]:
        """The group sizes of this run's policies, each once, smallest first."""
        return sorted({self.group_size(n) for n in self.policies})

    def rollout(self, prompts: dict[str, list[Example]]) -> list[RolloutRow]:
        """One batched rollout of every policy's prompts (policy -> examples), seeded by `rollout_seed`."""
        unknown = set(prompts) - set(self.policies)
        if unknown:
            raise KeyError(f"no such policies: {sorted(unknown)}")
        cfg = self.config
        return rollout(
            self.engine,
            prompts,
            self.rewarder,
            {p: self.group_size(p) for p in prompts},
            cfg.max_new_tokens,
            cfg.temperature,
            seed=rollout_seed(self.seed, self.steps),
            greedy_in_group=cfg.greedy_in_group,
            overrides={p: self.policies[p].spec.reward for p in prompts},
        )

    def update(self, rows: list[RolloutRow], lr_scale: float = 1.0) -> StepStats:
        """One GRPO update of every policy that has rows, at `lr_scale` times each one's learning rate (a run's
        schedule: `grpo.lr_factor`)."""
        eng = self.engine
        batch = self._batch(rows)
        parts = self._parts(batch)
        # each policy's share of its loss normaliser in each micro-batch (exactly 1.0 without micro-batches)
        weights = self._loss_weights(rows, batch, parts) if len(parts) > 1 else [None]
        banks = {eng.lora.banks[s] for p in self.policies.values() for s in p.sites}
        for b in banks:
            b.A.requires_grad_(True)
            b.B.requires_grad_(True)
        try:
            part_losses: list[dict[str, float]] = []
            part_extra: list[dict[str, dict[str, float]]] = []
            for idx, w in zip(parts, weights, strict=True):
                part_rows = rows if idx is None else [rows[i] for i in idx]
                part = batch if idx is None else batch.take(idx)
                ref, ref_rows = self._reference(part)
                with torch.enable_grad(), eng.exclusive():
                    lp = self._logprobs(part, part.slots)
                    total, losses, extra = self._losses(part_rows, part, lp, ref, w, ref_rows)
                    total.backward()
                del lp, total
                part_losses.append(losses)
                part_extra.append(extra)
            losses, extra = _merge_parts(part_losses, part_extra)
            norms = self.adamw.step([self.policies[name] for name in losses], lr_scale) or {}
            for name, norm in norms.items():
                extra[name]["grad_norm"] = norm
        finally:
            for b in banks:
                b.A.grad = None
                b.B.grad = None
                b.A.requires_grad_(False)
                b.B.requires_grad_(False)
        self.steps += 1
        return self._stats(rows, batch, losses, extra)

    def _parts(self, batch: _Batch) -> list[list[int] | None]:
        """The update's micro-batches as row indices, rows ordered by policy slot and split into as few
        near-equal parts as `micro_batch_rows` allows; [None] when all rows go in one forward/backward."""
        n = len(batch.slots)
        cap = self.micro_batch_rows
        if cap is None or n <= cap:
            return [None]
        order = sorted(range(n), key=lambda i: batch.slots[i])
        k = -(-n // cap)
        bounds = [round(j * n / k) for j in range(k + 1)]
        return [order[a:b] for a, b in itertools.pairwise(bounds)]

    def _loss_weights(
        self, rows: list[RolloutRow], batch: _Batch, parts: list[list[int] | None]
    ) -> list[dict[str, float] | None]:
        """For each micro-batch, each policy's count there over its count in the whole update, counting what
        `loss_agg` divides by (kept tokens for "token_mean", rows with a kept token otherwise): scaled by it,
        the per-part losses add up to the loss over all rows."""
        per_token = self.config.loss_agg == "token_mean"
        tokens_B = batch.comp.sum(dim=1).cpu()
        count_B = tokens_B if per_token else (tokens_B > 0).float()
        policy_B = [r.policy for r in rows]
        totals: dict[str, float] = {}
        for name, c in zip(policy_B, count_B.tolist(), strict=True):
            totals[name] = totals.get(name, 0.0) + c
        out: list[dict[str, float] | None] = []
        for idx in parts:
            assert idx is not None
            here: dict[str, float] = {}
            for i in idx:
                here[policy_B[i]] = here.get(policy_B[i], 0.0) + float(count_B[i])
            out.append({p: c / totals[p] for p, c in here.items() if totals[p] > 0})
        return out

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
        prompt_lens = [len(r.prompt_ids) for r in rows]
        groups = [r.group for r in rows]
        return _Batch(ids.to(dev), attn.to(dev), comp.to(dev), adv.to(dev), keep, slots, prompt_lens, groups)

    def _reference(self, batch: _Batch) -> tuple[torch.Tensor | None, list[int] | None]:
        """Token logprobs of the bare base (slot -1) for the KL term and the KL metric, and which rows they are
        of (None: all of them); (None, None) when kl_coef is 0 and the KL is not tracked.

        With kl_coef 0 the KL is only a metric, so it is measured on one row of every group with signal (the
        rows the loss reads): the sampled tokens of one completion per prompt estimate the same KL without
        bias, and the reference forward shrinks from the whole packed batch to one row per group (on the
        built-in recipe, G = 8, about a sixth of a GRPO step's time goes back to training)."""
        cfg = self.config
        if cfg.kl_coef <= 0 and not cfg.track_kl:
            return None, None
        rows: list[int] | None = None
        if cfg.kl_coef <= 0 and batch.groups:
            firsts: dict[
                int, int
            ] = {}  # the first kept row of each group (groups as `_batch` keys advantages)
            for i, (group, kept) in enumerate(zip(batch.groups, batch.keep.tolist(), strict=True)):
                if kept:
                    firsts.setdefault(group, i)
            rows = sorted(firsts.values())
            if not rows:
                return None, None
        with torch.no_grad(), self.engine.exclusive():
            if rows is None:
                return self._logprobs(batch, [-1] * len(batch.slots)), None
            sub = batch.take(rows)
            return self._logprobs(sub, [-1] * len(rows)), rows

    def _logprobs(self, batch: _Batch, slots: list[int]) -> torch.Tensor:
        """Token logprobs [B, T-1] of `batch` with row i under slot slots[i], in `token_logprobs`' layout,
        exact at the completion tokens (the only ones the loss reads).

        When rows share prompts the batch is packed (`mint_core.rl.packing`): one sequence per distinct (slot,
        prompt) behind a block mask, in buckets of similar width, with the logprobs and gradients of the full
        rows. Otherwise (no shared prompt, no prompt lengths, or an attention implementation that takes no
        custom mask) one forward over the full rows. Either way without a KV cache: transformers would copy
        every layer's keys and values into one that nothing reads."""
        eng = self.engine
        model = eng.base.model
        ctx = eng.lora.ctx
        dev = batch.ids.device
        ids_host = batch.ids.cpu()
        attn_impl = getattr(model.config, "_attn_implementation", None)
        packing = None
        if batch.prompt_lens and attn_impl in ("sdpa", "eager"):
            lens = batch.attn.sum(dim=1).cpu().tolist()
            packing = Packing.plan(ids_host, lens, slots, batch.prompt_lens)
        if packing is None:
            ctx.set_rows(slots, dev)
            try:
                out = model(input_ids=batch.ids, attention_mask=batch.attn, use_cache=False)
                return token_logprobs(out.logits, batch.ids)
            finally:
                ctx.clear()

        # the fused projection saves memory at the price of making its logits twice: worth it once they are large
        use = self._output_mode()
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        if use == "hidden" and packing.kept_positions() * vocab * 4 < self.fused_head_min_bytes:
            use = "logits"
        self.last_output = use
        # Logits only where a completion token is predicted, not at the prompt's other positions: the output
        # projection over a large vocabulary costs as much as a layer, and its output is the largest tensor.
        pieces: list[torch.Tensor] = []
        for bucket in packing.buckets(eng.pad_id):
            mask = bucket.mask.to(dev)
            if attn_impl == "eager":  # an additive mask
                mask = torch.zeros(mask.shape, dtype=model.dtype, device=dev).masked_fill(
                    ~mask, torch.finfo(model.dtype).min
                )
            ctx.set_rows([packing.slots[u] for u in bucket.sequences], dev)
            try:
                pieces.append(
                    self._kept_outputs(
                        use,
                        bucket.keep.to(dev),
                        input_ids=bucket.ids.to(dev),
                        attention_mask=mask,
                        position_ids=bucket.positions.to(dev),
                        use_cache=False,
                    )
                )
            finally:
                ctx.clear()
        out_NX = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # hidden states or logits
        rows_M, targets_M, row_of_M, col_of_M = packing.targets(ids_host)
        rows_M, targets_M = rows_M.to(dev), targets_M.to(dev)
        if self._output == "full":  # found out during this forward
            self.last_output = "full"
        if use == "hidden" and self._output == "hidden":
            head = model.get_output_embeddings()
            lp_M = head_logprobs(out_NX, head.weight, head.bias, rows_M, targets_M)
        else:
            lp_M = selected_logprobs(out_NX, rows_M, targets_M)
        out = lp_M.new_zeros(len(slots), batch.ids.shape[1] - 1)
        return out.index_put((row_of_M.to(dev), col_of_M.to(dev)), lp_M)

    def _kept_outputs(
        self, use: Literal["hidden", "logits", "full"], keep: torch.Tensor, **inputs: torch.Tensor | bool
    ) -> torch.Tensor:
        """What the output projection gets or gives at the K True positions of keep [B, T], in row-major order:
        its input, the final hidden states [K, H], for `use` "hidden" (the projection then runs fused with the
        log-softmax, `head_logprobs`); else the logits [K, V]. `use` is `_output_mode()` or a cheaper mode the
        model also supports; a model found to ignore a boolean `logits_to_keep` is moved to "full" for good."""
        model = self.engine.base.model
        mode = "full" if self._output == "full" else use
        if mode == "full":
            return model(**inputs).logits[keep]  # type: ignore[no-any-return]
        head = model.get_output_embeddings()
        if mode == "hidden":
            model.set_output_embeddings(nn.Identity())
        try:
            out = model(**inputs, logits_to_keep=keep).logits
        finally:
            if mode == "hidden":
                model.set_output_embeddings(head)
        if out.ndim == 2 and out.shape[0] == keep.sum():
            return out  # type: ignore[no-any-return]
        logger.info(
            "%s ignores a boolean logits_to_keep; computing every position's logits", type(model).__name__
        )
        self._output = "full"
        return model(**inputs).logits[keep]  # type: ignore[no-any-return]

    def _output_mode(self) -> Literal["hidden", "logits", "full"]:
        """How the update gets logprobs out of the model, decided once per trainer:
        "hidden"  the model takes a boolean `logits_to_keep` and its output is a plain linear projection (a
                  known family, no logit scaling or soft-capping after it): the projection is swapped out for
                  the forward and fused with the log-softmax, so no [positions, vocab] tensor is ever made;
        "logits"  it takes a boolean `logits_to_keep`: logits at the kept positions only;
        "full"    neither: logits at every position, the kept ones selected.
        An update uses "hidden" only when its kept logits would reach `fused_head_min_bytes`, "logits" below."""
        if self._output is None:
            model = self.engine.base.model
            if "logits_to_keep" not in inspect.signature(model.forward).parameters:
                self._output = "full"
            elif (
                getattr(model.config, "model_type", None) in PLAIN_HEAD_FAMILIES
                and type(model.get_output_embeddings()) is nn.Linear
                and callable(getattr(model, "set_output_embeddings", None))
            ):
                self._output = "hidden"
            else:
                self._output = "logits"
        return self._output

    def _losses(
        self,
        rows: list[RolloutRow],
        batch: _Batch,
        lp: torch.Tensor,
        ref: torch.Tensor | None,
        weights: dict[str, float] | None = None,
        ref_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float], dict[str, dict[str, float]]]:
        """Each policy's GRPO loss over its own rows, and their sum (what backward runs on). A policy with no
        kept token (no rows, or every group without variance) gets no loss and so no step at all, since Adam's
        momentum would still move the weights on a zero gradient. With `weights` (a micro-batch of a larger
        update), each policy's loss here is scaled by its weight and the "loss" stat is the scaled one. With
        `ref_rows` (`_reference` on some rows only, the KL a metric), each policy's "kl" is over those rows."""
        losses: dict[str, float] = {}
        extra: dict[str, dict[str, float]] = {}
        total = lp.sum() * 0.0
        policy_B = [r.policy for r in rows]
        for name in self.policies:
            if name not in policy_B:
                continue
            sel = torch.tensor([p == name for p in policy_B], device=lp.device)
            if not bool(batch.comp[sel].any()):
                continue
            loss, st = grpo_loss(
                lp[sel],
                lp[sel].detach(),
                batch.adv[sel],
                batch.comp[sel],
                self.config,
                None if ref is None or ref_rows is not None else ref[sel],
            )
            if ref is not None and ref_rows is not None:
                st["kl"] = _subset_kl(
                    lp, ref, batch.comp, [i for i in ref_rows if policy_B[i] == name], ref_rows
                )
            if weights is not None:
                loss = loss * weights[name]
                st["loss"] = float(loss.detach())
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
        # every policy that rolled out, also one whose groups all lacked variance (it took no step)
        rolled = dict.fromkeys(r.policy for r in rows)
        rewards = {p: torch.tensor([r.reward for r in rows if r.policy == p]) for p in rolled}
        reward = {p: float(r.mean()) for p, r in rewards.items()}
        keep = batch.keep.tolist()
        kept = {
            p: len({r.group for r, k in zip(rows, keep, strict=True) if r.policy == p and k}) for p in losses
        }
        group_rewards: dict[tuple[str, int], set[float]] = {}
        for row in rows:
            group_rewards.setdefault((row.policy, row.group), set()).add(row.reward)
        for p, values in rewards.items():
            groups = [len(v) > 1 for (q, _), v in group_rewards.items() if q == p]
            st = extra.setdefault(p, {})
            st["reward_std"] = float(values.std(correction=0))
            st["no_signal"] = 1.0 - sum(groups) / len(groups)  # groups whose rewards are all equal
        return StepStats(self.steps, 0.0, reward, losses, kept, extra)

    # ---- out ----------------------------------------------------------------------------------------

    def weights(self, name: str) -> AdapterWeights:
        """The policy's current adapter, read from its slot (scale taken back out of B); exported in the base's
        dtype."""
        p = self.policies[name]
        tensors = {}
        for s in p.sites:
            A, B = self.engine.lora.banks[s].read(p.slot, p.spec.rank, p.scale)
            tensors[s] = (A.detach().cpu().clone(), B.detach().cpu().clone())
        return AdapterWeights(
            p.spec.rank,
            p.spec.alpha,
            tensors,
            self.engine.base.fingerprint,
            self.engine.base.name,
            dtype=self.engine.base.dtype,
        )

    def export(self, name: str, path: Path) -> Digest:
        """Write the policy's current revision in PEFT format; returns its digest."""
        return save_adapter(self.weights(name), path, self.engine.sites)

    def save_state(self, path: Path) -> None:
        """Adapters and optimizer state of every policy, so a run resumes where it stopped."""
        path.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        meta = {"steps": self.steps, "seed": self.seed, "config": self.config.model_dump(), "policies": {}}
        for name, p in self.policies.items():
            meta["policies"][name] = {"spec": p.spec.model_dump(), "adam_step": p.optimizer_steps}  # type: ignore[index]
            for s in p.sites:
                bank = self.engine.lora.banks[s]
                tensors[f"{name}/{s}/A"] = bank.A.data[p.slot].cpu().contiguous()
                tensors[f"{name}/{s}/B"] = bank.B.data[p.slot].cpu().contiguous()
                for key, t in zip(_MOMENTS, self.adamw.moments(name, s), strict=True):
                    tensors[f"{name}/{s}/{key}"] = t.cpu().contiguous()
        save_file(tensors, str(path / "state.safetensors"))
        (path / "state.json").write_text(json.dumps(meta, indent=2, default=str))

    def _check_saved(self, meta: dict) -> None:  # type: ignore[type-arg]
        """A saved state fits this trainer: the same policies, each with the same rank, alpha and targets."""
        missing = set(self.policies) ^ set(meta["policies"])
        if missing:
            raise ValueError(
                f"the saved state has policies {sorted(meta['policies'])}, this trainer {sorted(self.policies)}"
            )
        problems = []
        for name, p in self.policies.items():
            saved = meta["policies"][name]["spec"]
            for key in ("rank", "alpha", "targets"):
                if saved.get(key) != getattr(p.spec, key):
                    problems.append(f"{name}: {key} {saved.get(key)} saved, {getattr(p.spec, key)} now")
        if problems:
            raise ValueError("the saved state does not fit this trainer: " + "; ".join(problems))

    def load_state(self, path: Path) -> None:
        meta = json.loads((path / "state.json").read_text())
        self._check_saved(meta)
        tensors = load_file(str(path / "state.safetensors"))
        with torch.no_grad():
            for name, p in self.policies.items():
                p.optimizer_steps = int(meta["policies"][name]["adam_step"])
                for s in p.sites:
                    bank = self.engine.lora.banks[s]
                    bank.A.data[p.slot].copy_(tensors[f"{name}/{s}/A"])
                    bank.B.data[p.slot].copy_(tensors[f"{name}/{s}/B"])
                    moments = [tensors[f"{name}/{s}/{key}"] for key in _MOMENTS]
                    self.adamw.set_moments(name, s, moments, p.optimizer_steps)
        self.steps = int(meta["steps"])


def _merge_parts(
    losses: list[dict[str, float]], extra: list[dict[str, dict[str, float]]]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """One update's losses and stats from those of its micro-batches: losses (already weighted) add up,
    n_tokens adds up, the other stats (means over tokens) average weighted by each part's tokens."""
    if len(losses) == 1:
        return losses[0], extra[0]
    loss: dict[str, float] = {}
    stats: dict[str, dict[str, float]] = {}
    for part_loss, part_stats in zip(losses, extra, strict=True):
        for name, value in part_loss.items():
            loss[name] = loss.get(name, 0.0) + value
            st = part_stats[name]
            acc = stats.setdefault(name, {k: 0.0 for k in st})
            n = st["n_tokens"]
            for k, v in st.items():
                acc[k] += v if k in ("loss", "n_tokens") else v * n
    for st in stats.values():
        for k in st:
            if k not in ("loss", "n_tokens"):
                st[k] /= max(st["n_tokens"], 1.0)
    return loss, stats
