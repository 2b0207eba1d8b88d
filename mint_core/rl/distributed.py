"""The multi-policy GRPO trainer under DeepSpeed: ZeRO stage by config, for bases that need several GPUs.

The plain trainer runs AdamW over views of each policy's slice of the stacked slot tensors (`SlotAdamW`, left
unused here). DeepSpeed wants parameters and an optimizer it owns (ZeRO flattens and partitions them), so here
each policy's LoRA factors are parameters of their own, in PEFT orientation and scale, and each policy is one
param group of the optimizer (its own learning rate; policies never share a parameter, so their optimizer
state and step counts stay apart). A forward stacks the factors into stand-ins for the engine's slot banks
(differentiable, every other slot zero) and routes each row to its policy's slot as usual, so a policy's
gradient reaches only its own factors. After each step the new factors are written back into the banks, which rollouts, `weights()`
and `export()` read.

- Clipping is per policy (`GRPOConfig.max_grad_norm`, inside the optimizer). DeepSpeed's `gradient_clipping`
  takes one norm over every trainable parameter, which would let one policy's gradient shrink another's
  step, so a config that sets it is refused.
- A policy with no kept token on any rank takes no step at all (the plain trainer's rule).
- Each rank rolls out its share of every policy's prompts; DeepSpeed averages the gradients over ranks.
- ZeRO-3 shards the frozen base. The slot banks stay whole on every rank: they are the engine's working set,
  written outside any forward (adapter loads, the write-back after a step).
- Precision follows the base: a bfloat16 base turns on DeepSpeed's bf16 (fp32 master weights in the
  optimizer); a float32 base trains in float32 (CPU runs).
- The B learning rate is not scaled by alpha/r as in the plain trainer: the factors here are PEFT's own
  (scale applied in the forward), which is what that scaling emulates. Adam's first step is the same either
  way; the clip norm sees PEFT's B gradient (scale times the folded one).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils import set_z3_leaf_modules
from torch import nn

from mint_core.data.generators import Example
from mint_core.engine.engine import Engine
from mint_core.engine.logprobs import selected_logprobs
from mint_core.lora.layers import MultiLoRAExperts, MultiLoRALinear, _SlotBank
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.optim import warmup_factor
from mint_core.rl.policy import PolicySpec, PolicyState
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer, StepStats, _Batch

logger = logging.getLogger(__name__)


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group DeepSpeed trains in; returns (rank, world size).

    Under the `deepspeed` launcher (or torchrun) its environment names the group. A process started on its
    own forms a world of one on a free local port, so one process trains under DeepSpeed on one GPU or on
    the CPU (`DS_ACCELERATOR=cpu`, gloo). `backend` defaults to the accelerator's (nccl, gloo).
    """
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }.items():
            os.environ.setdefault(key, value)
    if os.environ.get("WORLD_SIZE") == "1":
        # DeepSpeed JIT-compiles its shared-memory allreduce for CPU ranks when a group forms (about a
        # minute, once per machine); a world of one never reduces across processes, so skip the build
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)
    return dist.get_rank(), dist.get_world_size()


def rank_placement() -> tuple[str, str]:
    """Where this rank loads its base (device, dtype): its own GPU in bfloat16, else the CPU in float32."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}", "bfloat16"
    return "cpu", "float32"


def load_config(config: Path | str | dict[str, Any], base_dtype: torch.dtype) -> dict[str, Any]:
    """A DeepSpeed config (a JSON file or a dict) checked against what this trainer owns, with its defaults.

    Refused: an `optimizer` or `scheduler` section (the optimizer is the trainer's, built from the GRPO
    config), `gradient_clipping` (it would clip all policies together), gradient accumulation, fp16, and
    a bf16 setting that contradicts the base's dtype.
    """
    if isinstance(config, dict):
        cfg = copy.deepcopy(config)
        where = "DeepSpeed config"
    else:
        cfg = json.loads(Path(config).read_text())
        where = f"DeepSpeed config {config}"
    problems = []
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            problems.append(
                f"has a {section!r} section; the trainer builds its own per-policy AdamW from the GRPO config"
            )
    if cfg.get("gradient_clipping"):
        problems.append(
            "sets gradient_clipping, one norm over every policy; per-policy clipping is GRPOConfig.max_grad_norm"
        )
    if int(cfg.get("gradient_accumulation_steps", 1)) != 1:
        problems.append("sets gradient_accumulation_steps; one update is one optimizer step per policy")
    if cfg.get("fp16", {}).get("enabled"):
        problems.append(
            "enables fp16 (loss scaling skips steps of every policy at once); use a bfloat16 base"
        )
    bf16 = cfg.get("bf16", {}).get("enabled")
    if bf16 is not None and bool(bf16) != (base_dtype == torch.bfloat16):
        problems.append(
            f"sets bf16.enabled={bf16} but the base is {base_dtype}; precision follows the base "
            "(load it in bfloat16 for bf16), so leave bf16 out"
        )
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    if base_dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.setdefault("steps_per_print", 2**31 - 1)
    # a thin AdamW subclass; ZeRO only knows the stock optimizers by type
    cfg["zero_allow_untested_optimizer"] = True
    return cfg


class PolicyAdamW(torch.optim.AdamW):
    """torch AdamW with one param group per policy (its name under the group's "policy" key).

    At each step only the policies in `active` move: a policy without kept tokens would otherwise drift on
    Adam's momentum alone, and its state and step count must not advance. Each moving policy's gradient is
    first clipped to its own norm. ZeRO stages 1-3 hand this optimizer one group at a time, the group's
    parameters flattened into this rank's partition, so with `reduce_norms` the squared norm is summed over
    ranks first.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float | None,
        reduce_norms: bool = False,
    ):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.reduce_norms = reduce_norms
        self.active: set[str] = set()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        everything = self.param_groups
        live = [g for g in everything if g["policy"] in self.active]
        if self.max_grad_norm is not None:
            for g in live:
                grads = [p.grad for p in g["params"] if p.grad is not None]
                sq = sum((gr.float().pow(2).sum() for gr in grads), torch.zeros((), device=_device(g)))
                if self.reduce_norms:
                    dist.all_reduce(sq)
                clip = min(1.0, self.max_grad_norm / (float(sq.sqrt()) + 1e-6))
                if clip < 1.0:
                    for gr in grads:
                        gr.mul_(clip)
        self.param_groups = live
        try:
            return super().step(closure)
        finally:
            self.param_groups = everything


def _device(group: dict[str, Any]) -> torch.device:
    params = group["params"]
    return params[0].device if params else torch.device("cpu")


class _Banks(nn.Module):
    """Slot banks under one parent, so `torch.func.functional_call` can stand tensors in for their A and B."""

    def __init__(self, banks: list[_SlotBank]):
        super().__init__()
        self.banks = nn.ModuleList(banks)

    def forward(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        return run()


class PolicyFactors(nn.Module):
    """What DeepSpeed wraps: the frozen base, and every policy's LoRA factors as parameters of their own.

    Factors are PEFT-shaped: per site A [(E,) r, in] and B [(E,) out, r], alpha/r applied in the forward.
    They are direct parameters of this module, so ZeRO-3 gathers them when its forward starts.
    """

    def __init__(self, engine: Engine, policies: dict[str, PolicyState]):
        super().__init__()
        self.model = engine.base.model
        self._engine = engine
        self._policies = policies
        self.owned: dict[str, list[tuple[str, nn.Parameter, nn.Parameter]]] = {}
        for i, (name, p) in enumerate(policies.items()):
            self.owned[name] = []
            for j, site in enumerate(p.sites):
                A, B = engine.lora.banks[site].read(p.slot, p.spec.rank, p.scale)
                pA, pB = nn.Parameter(A.detach().clone()), nn.Parameter(B.detach().clone())
                self.register_parameter(f"policy{i}_site{j}_A", pA)
                self.register_parameter(f"policy{i}_site{j}_B", pB)
                self.owned[name].append((site, pA, pB))

    def params_of(self, name: str) -> list[nn.Parameter]:
        return [t for _, A, B in self.owned[name] for t in (A, B)]

    def _stand_ins(self) -> tuple[list[_SlotBank], dict[str, torch.Tensor]]:
        """Per bank that some policy trains: [S+1, ...] A and B built from the factors (other slots zero)."""
        lora = self._engine.lora
        per_site: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, factors in self.owned.items():
            p = self._policies[name]
            for site, A, B in factors:
                pad = lora.banks[site].max_rank - p.spec.rank
                A_RI = F.pad(A, (0, 0, 0, pad))
                B_RO = F.pad((B * p.scale).transpose(-1, -2), (0, 0, 0, pad))
                per_site.setdefault(site, {})[p.slot] = (A_RI, B_RO)
        banks = []
        tensors = {}
        for i, (site, by_slot) in enumerate(per_site.items()):
            bank = lora.banks[site]
            zero_A = bank.A.new_zeros(bank.A.shape[1:])
            zero_B = bank.B.new_zeros(bank.B.shape[1:])
            slots = range(bank.A.shape[0])
            A_SRI = torch.stack([by_slot[s][0] if s in by_slot else zero_A for s in slots])
            B_SRO = torch.stack([by_slot[s][1] if s in by_slot else zero_B for s in slots])
            tensors[f"banks.{i}.A"] = A_SRI.to(bank.A.dtype)
            tensors[f"banks.{i}.B"] = B_SRO.to(bank.B.dtype)
            banks.append(bank)
        return banks, tensors

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        slots: list[int],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V], row i under slot slots[i], the banks' policy slots read from the factors; with
        `keep` (bool [B, T]) passed on as `logits_to_keep`, only those positions' [K, V]."""
        extra = {} if keep is None else {"logits_to_keep": keep}
        banks, tensors = self._stand_ins()
        ctx = self._engine.lora.ctx
        ctx.set_rows(slots, input_ids.device)
        try:
            logits: torch.Tensor = torch.func.functional_call(
                _Banks(banks),
                tensors,
                (lambda: self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits,),
            )
        finally:
            ctx.clear()
        return logits


def _keep_banks_whole(model: nn.Module) -> None:
    """Take the slot banks out of the module tree ZeRO-3 partitions; the layers reach them as plain
    attributes. Mark the multi-LoRA layers as ZeRO-3 leaves: their forward reads the wrapped layer's
    weights directly, so all of a layer's parameters are gathered when it starts."""
    for m in list(model.modules()):
        if isinstance(m, MultiLoRALinear | MultiLoRAExperts):
            for key in ("bank", "banks"):
                if key in m._modules:
                    object.__setattr__(m, key, m._modules.pop(key))
    set_z3_leaf_modules(model, [MultiLoRALinear, MultiLoRAExperts], raise_if_not_found=False)


class DeepSpeedTrainer(MultiPolicyTrainer):
    """`MultiPolicyTrainer` whose updates run under a DeepSpeed engine, ZeRO stage from `deepspeed_config`.

    Forms a world of one when no process group exists (see `init_distributed`). Under ZeRO-3 the engine's
    banks leave the base's module tree for good. ZeRO-3 over several ranks needs rollouts from elsewhere
    (a vLLM deployment serving the exported revisions) passed to `update`: `step` refuses, because the
    engine's generation does not keep ranks in step, and ZeRO-3 gathers each layer collectively.
    """

    def __init__(
        self,
        engine: Engine,
        config: GRPOConfig,
        policies: list[PolicySpec],
        deepspeed_config: Path | str | dict[str, Any],
        seed: int = 0,
    ):
        super().__init__(engine, config, policies, seed)
        ds_config = load_config(deepspeed_config, engine.base.dtype)
        if not dist.is_initialized():
            init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        if self.stage == 3:
            _keep_banks_whole(engine.base.model)
        self.module = PolicyFactors(engine, self.policies)
        self.optimizer = PolicyAdamW(
            [
                {
                    "params": self.module.params_of(name),
                    "lr": (p.spec.learning_rate or config.learning_rate) * p.spec.rate_scale,
                    "policy": name,
                }
                for name, p in self.policies.items()
            ],
            lr=config.learning_rate,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            reduce_norms=self.stage >= 1 and self.world > 1,
        )
        self.ds, *_ = deepspeed.initialize(model=self.module, optimizer=self.optimizer, config=ds_config)
        logger.info(
            "DeepSpeed ZeRO-%d over %d rank(s) on %s: %d policies, %d trainable parameters",
            self.stage,
            self.world,
            self.ds.device,
            len(self.policies),
            sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters() if p.requires_grad),
        )

    def rollout(self, prompts: dict[str, list[Example]]) -> list[RolloutRow]:
        """Rollout of this rank's share of each policy's prompts."""
        if self.stage == 3 and self.world > 1:
            raise RuntimeError(
                "ZeRO-3 over several ranks: the engine's generation does not keep ranks in step; "
                "roll out with a serving deployment and call update(rows)"
            )
        if self.world > 1:
            prompts = {p: examples[self.rank :: self.world] for p, examples in prompts.items()}
        return super().rollout(prompts)

    def update(self, rows: list[RolloutRow], lr_scale: float = 1.0) -> StepStats:
        """One forward/backward under the DeepSpeed engine, one optimizer step per policy with kept tokens, at
        `lr_scale` times each policy's learning rate."""
        for group in self.optimizer.param_groups:
            p = self.policies[group["policy"]]
            warm = warmup_factor(p.spec.warmup_steps, p.optimizer_steps)
            group["lr"] = group.setdefault("base_lr", group["lr"]) * lr_scale * warm
        batch = self._batch(rows)
        ref, ref_rows = self._reference(batch)
        with torch.enable_grad(), self.engine.exclusive():
            lp = self._completion_logprobs(batch)
            total, losses, extra = self._losses(rows, batch, lp, ref, None, ref_rows)
            self.optimizer.active = self._agree(set(losses))
            self.ds.backward(total)
            self.ds.step()
        for name in self.optimizer.active:
            self.policies[name].optimizer_steps += 1
        self._write_back(self.optimizer.active)
        self.steps += 1
        return self._stats(rows, batch, losses, extra)

    def _completion_logprobs(self, batch: _Batch) -> torch.Tensor:
        """Token logprobs [B, T-1] in `token_logprobs`' layout, computed only where the loss reads them (the
        completion tokens of kept groups; 0 elsewhere): logits at those positions alone where the model takes a
        boolean `logits_to_keep`, and no float32 copy of them (`selected_logprobs`). The head is not fused here:
        under ZeRO-3 its weight is a partition."""
        comp = batch.comp.bool()
        keep = torch.zeros_like(batch.ids, dtype=torch.bool)
        keep[:, :-1] = comp  # position t predicts token t + 1
        logits = self.ds(batch.ids, batch.attn, batch.slots, None if self._output_mode() == "full" else keep)
        if logits.ndim == 3:  # every position's logits (a model without a boolean logits_to_keep)
            logits = logits[keep]
        targets = batch.ids[:, 1:][comp]
        lp = selected_logprobs(logits, torch.arange(targets.shape[0], device=logits.device), targets)
        return lp.new_zeros(comp.shape).index_put(comp.nonzero(as_tuple=True), lp)

    def _agree(self, active: set[str]) -> set[str]:
        """The policies that step: those with kept tokens on any rank (every rank must step the same ones)."""
        if self.world == 1:
            return active
        names = list(self.policies)
        flags = torch.tensor([n in active for n in names], dtype=torch.int32, device=self.ds.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return {n for n, f in zip(names, flags.tolist(), strict=True) if f}

    @torch.no_grad()
    def _write_back(self, names: set[str] | list[str]) -> None:
        """Copy the policies' factors into their slots, where rollouts and `weights()` read them."""
        names = [n for n in self.policies if n in names]
        if not names:
            return
        params = [t for n in names for t in self.module.params_of(n)]
        with deepspeed.zero.GatheredParameters(params):
            for n in names:
                p = self.policies[n]
                for site, A, B in self.module.owned[n]:
                    self.engine.lora.banks[site].write(p.slot, A, B, p.scale)

    # ---- state ----------------------------------------------------------------------------------------

    def save_state(self, path: Path) -> None:
        """A DeepSpeed checkpoint of the factors and optimizer state (not the frozen base) under
        path/deepspeed, and the run's metadata in path/state.json. Every rank must call it."""
        path.mkdir(parents=True, exist_ok=True)
        self.ds.save_checkpoint(str(path / "deepspeed"), tag="state", exclude_frozen_parameters=True)
        if self.rank == 0:
            meta = {
                "steps": self.steps,
                "seed": self.seed,
                "config": self.config.model_dump(),
                "policies": {
                    n: {"spec": p.spec.model_dump(), "adam_step": p.optimizer_steps}
                    for n, p in self.policies.items()
                },
            }
            (path / "state.json").write_text(json.dumps(meta, indent=2, default=str))

    def load_state(self, path: Path) -> None:
        meta = json.loads((path / "state.json").read_text())
        self._check_saved(meta)
        self.ds.load_checkpoint(str(path / "deepspeed"), tag="state", load_module_strict=False)
        self._write_back(list(self.policies))
        for name, p in self.policies.items():
            p.optimizer_steps = int(meta["policies"][name]["adam_step"])
        self.steps = int(meta["steps"])
