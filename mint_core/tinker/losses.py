"""Tinker's built-in losses, as its SDK documents them, over the target tokens' logprobs of one datum.

For a datum of N input tokens every loss input is a 1-D array of N values aligned with the input: position i holds
what is predicted after input token i (`target_tokens[i]`), with its weight or advantage. With
`lp = log p(target_tokens)` under the trained model:

- `cross_entropy`      inputs target_tokens, weights (default 1):        loss = -sum(weights * lp)
- `importance_sampling` inputs target_tokens, logprobs (the sampler's), advantages:
                        loss = -sum(exp(lp - logprobs) * advantages)
- `ppo`                 the same inputs; loss = -sum(min(r * A, clip(r, low, high) * A)), r = exp(lp - logprobs),
                        low/high from loss_fn_config `clip_low_threshold`/`clip_high_threshold` (default 0.8/1.2),
                        or per token from loss inputs of those names.

Every datum's loss is a sum over its tokens, and a call's loss is the sum over its data (`loss:sum`); gradients
accumulate over calls until `optim_step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: tuple[str, ...] = ()


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens",), ("weights",)),
    "importance_sampling": LossSpec(("target_tokens", "logprobs", "advantages")),
    "ppo": LossSpec(
        ("target_tokens", "logprobs", "advantages"),
        ("clip_low_threshold", "clip_high_threshold"),
        ("clip_low_threshold", "clip_high_threshold"),
    ),
}
PPO_CLIP = (0.8, 1.2)


class LossInputError(ValueError):
    """Loss inputs that do not fit the loss or the datum; the message names the datum and the input."""


def check(
    loss_fn: str,
    config: dict[str, float | str],
    tokens: list[np.ndarray],
    inputs: list[dict[str, np.ndarray]],
    vocab: int,
) -> None:
    """Every problem of a call's loss, its config and its data's inputs, in one LossInputError (nothing is run)."""
    if loss_fn not in LOSSES:
        raise LossInputError(
            f"loss_fn {loss_fn!r} is not supported by this server; supported: {', '.join(LOSSES)}"
        )
    spec = LOSSES[loss_fn]
    problems: list[str] = []
    for k, v in config.items():
        if k not in spec.config:
            allowed = ", ".join(spec.config) or "none"
            problems.append(f"loss_fn_config key {k!r} is not a parameter of {loss_fn} (allowed: {allowed})")
        elif not isinstance(v, float) or not np.isfinite(v) or v < 0:
            problems.append(f"loss_fn_config[{k!r}] must be a finite number >= 0, got {v!r}")
    for i, (ids, ins) in enumerate(zip(tokens, inputs, strict=True)):
        n = len(ids)
        for name in spec.required:
            if name not in ins:
                problems.append(f"datum {i}: loss_fn_inputs has no {name!r}, which {loss_fn} needs")
        for name, arr in ins.items():
            if name not in spec.required + spec.optional:
                problems.append(
                    f"datum {i}: loss_fn_inputs[{name!r}] is not an input of {loss_fn} "
                    f"(inputs: {', '.join(spec.required + spec.optional)})"
                )
            elif arr.shape != (n,):
                problems.append(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; the model input has {n} "
                    f"tokens, so it must be [{n}]"
                )
            elif name == "target_tokens":
                if arr.dtype.kind != "i":
                    problems.append(f"datum {i}: target_tokens must be integers")
                elif n and (arr.min() < 0 or arr.max() >= vocab):
                    problems.append(f"datum {i}: target_tokens must be token ids in [0, {vocab})")
            elif not np.isfinite(arr).all():
                problems.append(f"datum {i}: loss_fn_inputs[{name!r}] has non-finite values")
        if len(problems) > 20:
            break
    if problems:
        raise LossInputError("; ".join(problems[:20]))


def datum_loss(loss_fn: str, config: dict[str, float | str], lp: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """The loss of one datum from its target tokens' logprobs `lp` [N] (float32, with grad) and its inputs."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -(lp * weights).sum() if weights is not None else -lp.sum()
    ratio = torch.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        low = inputs.get(
            "clip_low_threshold", torch.tensor(float(config.get("clip_low_threshold", PPO_CLIP[0])))
        )
        high = inputs.get(
            "clip_high_threshold", torch.tensor(float(config.get("clip_high_threshold", PPO_CLIP[1])))
        )
        clipped = torch.minimum(torch.maximum(ratio, low), high)
        return -torch.minimum(ratio * adv, clipped * adv).sum()
    raise LossInputError(
        f"loss_fn {loss_fn!r} is not supported by this server; supported: {', '.join(LOSSES)}"
    )
