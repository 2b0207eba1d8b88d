"""A policy's training curves as a matplotlib figure for its MLflow run."""

from __future__ import annotations

from typing import Any

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")  # curves are drawn to files for MLflow, never shown


CURVE_PANELS = (
    ("reward", "mean rollout reward (band: ± its std)"),
    ("kl", "KL to the base (k3)"),
    ("entropy", "entropy (mean -logprob of samples)"),
    ("grad_norm", "gradient norm (before clipping)"),
)


def curve_figure(policy: str, curve: list[dict[str, float]]) -> Any:
    """One policy's training as a matplotlib figure for its MLflow run: its reward (with its spread), its KL to
    the base, its entropy and its gradient norm, per GRPO step."""
    fig, axes = plt.subplots(2, 2, figsize=(8, 5), sharex=True)
    steps = list(range(1, len(curve) + 1))
    for ax, (key, title) in zip(axes.flat, CURVE_PANELS, strict=True):
        ys = [float("nan") if p.get(key) is None else p[key] for p in curve]
        ax.plot(steps, ys, marker="o", markersize=2)
        if key == "reward" and any(p.get("reward_std") is not None for p in curve):
            sd = [p.get("reward_std") or 0.0 for p in curve]
            ax.fill_between(
                steps,
                [y - d for y, d in zip(ys, sd, strict=True)],
                [y + d for y, d in zip(ys, sd, strict=True)],
                alpha=0.2,
            )
        ax.set_title(title, fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("GRPO step")
    fig.suptitle(policy)
    fig.tight_layout()
    plt.close(fig)
    return fig
