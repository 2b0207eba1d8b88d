"""GRPO: group-relative advantages and the clipped policy-gradient loss over one batch of completions.

Shapes: N prompts, G completions per prompt (a group), B = N * G rows, T completion tokens per row.
Only `logprobs_BT` (the policy being trained) carries gradient; old and reference logprobs and the
advantages are treated as constants.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

AdvantageMode = Literal["std", "mean"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
LrDecay = Literal["none", "linear", "cosine"]
_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class GRPOConfig(BaseModel):
    """How one GRPO run samples, scores and updates a LoRA policy."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=2)
    """Completions sampled per prompt (G); advantages compare completions within a group."""
    advantage: AdvantageMode = "std"
    """"std": (r - mean) / (std + eps) with the population std of the group, as GRPO; "mean": r - mean,
    the Dr. GRPO variant that drops the std normalisation (no up-weighting of near-unanimous groups)."""
    eps_low: float = Field(0.2, gt=0.0, le=1.0)
    """The ratio is clipped below at 1 - eps_low (binds on tokens with negative advantage)."""
    eps_high: float = Field(0.28, gt=0.0, le=1.0)
    """The ratio is clipped above at 1 + eps_high (binds on tokens with positive advantage); larger than
    eps_low is DAPO's "clip-higher", which leaves room to raise unlikely tokens and keeps entropy up."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight (beta) of the per-token k3 KL to the base model added to the loss; 0 turns it off and no
    reference logprobs are needed."""
    loss_agg: LossAgg = "token_mean"
    """How per-token losses become one number: "token_mean" averages over every completion token of the
    batch (DAPO, long answers weigh by their length); "seq_mean_token_sum" sums each row then averages rows;
    "seq_mean_token_mean" averages each row then averages rows (original GRPO). Rows with no token count
    in none of them."""
    track_kl: bool = True
    """Measure the KL to the base every step even when kl_coef is 0 (for the run's metrics): one extra forward
    without gradient, under the bare base, over the update's rows."""
    drop_zero_variance: bool = True
    """Groups whose rewards are all equal have zero advantage; True masks their rows out entirely, so they
    neither contribute nor dilute the token/row counts of the other groups (DAPO's dynamic sampling filter)."""
    learning_rate: float = Field(1e-4, gt=0.0)
    """AdamW step size for the LoRA parameters."""
    lr_decay: LrDecay = "none"
    """The learning rate over a run of known length (`rl.recipe.TrainingRun`): "none" keeps it; "linear" and
    "cosine" take it from `learning_rate` at the first step towards 0 after the last (`lr_factor`), so the late
    steps, which only add noise once the gain is in, move the adapter less."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this before each step; None: no clipping."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the rollouts; must be > 0, since greedy groups are identical and teach nothing."""
    greedy_in_group: bool = False
    """Make each group's first completion the greedy one, the rest sampled at `temperature`. The group's mean,
    the baseline of its advantages, then includes the answer a greedy request gets (in the spirit of
    self-critical sequence training, which baselines samples on the greedy decode): where the greedy answer is
    wrong and a sample is right, the update lowers the one and raises the other, which is what moves greedy
    accuracy, the score served and evaluated."""
    max_new_tokens: int = Field(16, ge=1)
    """Most tokens generated per completion."""
    adam_betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    adam_eps: float = Field(1e-8, gt=0.0)
    """AdamW denominator epsilon."""


def lr_factor(decay: LrDecay, step: int, steps: int) -> float:
    """The learning rate's multiplier at update `step` (0-based) of a run of `steps` updates: 1 for "none";
    1 - step/steps for "linear"; (1 + cos(pi step/steps)) / 2 for "cosine". Never 0 within the run."""
    if steps < 1 or not 0 <= step < steps:
        raise ValueError(f"step {step} is outside a run of {steps} steps")
    if decay == "none":
        return 1.0
    if decay == "linear":
        return 1.0 - step / steps
    if decay == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * step / steps))
    raise ValueError(f"unknown lr_decay {decay!r}; known: {', '.join(get_args(LrDecay))}")


def group_advantages(rewards_NG: Tensor, mode: AdvantageMode, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Advantage of each completion relative to its group, and which groups carry any signal.

    mode "std": (r - mean) / (std + eps), std being the population std (divide by G, not G - 1);
    mode "mean": r - mean. Groups whose rewards are all exactly equal get advantage exactly 0 and
    keep_N False. Returns (advantages_NG, keep_N).
    """
    if rewards_NG.ndim != 2:
        raise ValueError(f"rewards must be [N prompts, G completions], got shape {tuple(rewards_NG.shape)}")
    if mode not in get_args(AdvantageMode):
        raise ValueError(f"unknown advantage mode {mode!r}; known: {', '.join(get_args(AdvantageMode))}")
    r_NG = rewards_NG.detach() if rewards_NG.is_floating_point() else rewards_NG.detach().float()
    keep_N = r_NG.amax(dim=-1) != r_NG.amin(dim=-1)
    centred_NG = r_NG - r_NG.mean(dim=-1, keepdim=True)
    if mode == "std":
        centred_NG = centred_NG / (r_NG.std(dim=-1, correction=0, keepdim=True) + eps)
    # rounding in the mean can leave tiny nonzero values in an all-equal group; those groups carry no signal
    advantages_NG = torch.where(keep_N[:, None], centred_NG, torch.zeros_like(centred_NG))
    return advantages_NG, keep_N


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref) from tokens sampled by the policy:
    exp(ref - lp) - (ref - lp) - 1, unbiased, always >= 0 and 0 where the two agree."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def grpo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    config: GRPOConfig,
    ref_logprobs_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss (to minimise) over the completion tokens where mask_BT is set (bool or 0/1).

    Per token: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) with ratio = exp(lp - old),
    plus kl_coef * k3 KL to the reference when kl_coef > 0; aggregated per config.loss_agg. Values at
    masked positions never reach the result (not even as inf/NaN through the gradient), and a batch with
    no unmasked token gives a loss of 0 that still backpropagates (zero gradient).

    Stats (plain floats, averaged over unmasked tokens, 0 when there are none): loss, pg_objective (the
    clipped surrogate the update raises, before the KL term), clip_frac (tokens whose clip is active, so they
    get no gradient), clip_frac_low, clip_frac_high, ratio_mean, kl (mean k3; 0 without reference logprobs),
    entropy (mean -logprob of the sampled tokens: an estimate of the policy's per-token entropy when the
    tokens were sampled from it at temperature 1), n_tokens.
    """
    if logprobs_BT.ndim != 2:
        raise ValueError(f"logprobs_BT must be [rows, tokens], got shape {tuple(logprobs_BT.shape)}")
    B, T = logprobs_BT.shape
    for name, t in (("old_logprobs_BT", old_logprobs_BT), ("mask_BT", mask_BT)):
        if t.shape != logprobs_BT.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs_BT has {(B, T)}")
    if ref_logprobs_BT is not None and ref_logprobs_BT.shape != logprobs_BT.shape:
        raise ValueError(
            f"ref_logprobs_BT has shape {tuple(ref_logprobs_BT.shape)}, logprobs_BT has {(B, T)}"
        )
    if advantages_B.shape != (B,):
        raise ValueError(f"advantages_B has shape {tuple(advantages_B.shape)}, expected ({B},)")
    if config.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError(f"kl_coef is {config.kl_coef} but no ref_logprobs_BT were given")

    m_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(logprobs_BT)
    # torch.where before exp: padded positions may hold -inf or garbage, and inf * 0 in backward is NaN
    log_ratio_BT = torch.where(m_BT, logprobs_BT - old_logprobs_BT.detach(), zeros_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    A_BT = torch.where(m_BT, advantages_B.detach()[:, None].to(logprobs_BT.dtype), zeros_BT)
    clipped_BT = ratio_BT.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    objective_BT = torch.minimum(ratio_BT * A_BT, clipped_BT * A_BT)
    loss_BT = -objective_BT

    kl_BT = None
    if ref_logprobs_BT is not None:
        kl_BT = k3_kl(
            torch.where(m_BT, logprobs_BT, zeros_BT), torch.where(m_BT, ref_logprobs_BT.detach(), zeros_BT)
        )
        if config.kl_coef > 0:
            loss_BT = loss_BT + config.kl_coef * kl_BT
    loss_BT = torch.where(m_BT, loss_BT, zeros_BT)

    tokens_B = m_BT.sum(dim=-1)
    n_tokens = int(tokens_B.sum())
    if config.loss_agg == "token_mean":
        loss = loss_BT.sum() / max(n_tokens, 1)
    else:
        row_B = loss_BT.sum(dim=-1)
        if config.loss_agg == "seq_mean_token_mean":
            row_B = row_B / tokens_B.clamp(min=1)
        loss = row_B.sum() / max(int((tokens_B > 0).sum()), 1)

    with torch.no_grad():
        denom = max(n_tokens, 1)
        high_BT = m_BT & (A_BT > 0) & (ratio_BT > 1.0 + config.eps_high)
        low_BT = m_BT & (A_BT < 0) & (ratio_BT < 1.0 - config.eps_low)
        stats = {
            "loss": float(loss.detach()),
            "pg_objective": float(torch.where(m_BT, objective_BT.detach(), zeros_BT).sum()) / denom,
            "clip_frac": float((high_BT | low_BT).sum()) / denom,
            "clip_frac_low": float(low_BT.sum()) / denom,
            "clip_frac_high": float(high_BT.sum()) / denom,
            "ratio_mean": float(torch.where(m_BT, ratio_BT, zeros_BT).sum()) / denom,
            "kl": 0.0 if kl_BT is None else float(torch.where(m_BT, kl_BT, zeros_BT).sum()) / denom,
            "entropy": -float(torch.where(m_BT, logprobs_BT.detach(), zeros_BT).sum()) / denom,
            "n_tokens": float(n_tokens),
        }
    return loss, stats
