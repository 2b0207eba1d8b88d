"""Every arm's own answer to every row of a reward table, and a reference router that reads them.

The routers of `routing.py` decide from the prompt, before anything answers. This is the most a router can know
short of the reward itself: every arm answers the request (greedy, as in the table) and a model fitted on the
train half's rewards picks one answer from what the answers look like: how many arms gave the same answer, how sure
each arm was of its tokens (mean and lowest logprob), and each arm's own slope on those. Serving it would cost one
generation per arm for every request, so it is a reference (how far reading the answers goes), not a router mint
serves.

The answers are computed once from the table's exported adapters (`<cache>/adapters`, written when the table was
built) and kept beside the table (`answers.npz`); they must reproduce the table's rewards, else nothing is
reported (another machine's kernels can answer a few rows differently from the build's).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _reward_table import BASE_ARM, RewardTable, TableConfig, _rows, complete, progress

ANSWERS_FILE = "answers.npz"
ANSWER_RIDGE = 1.0
"""L2 penalty of the answer scorer's ridge fit (0.1 to 10 chose the same arms within 0.1 point)."""
REPRODUCED = 0.995
"""Share of the table's rewards the recomputed answers must give back exactly (to 1e-6) to be used."""


@dataclass
class ArmAnswers:
    """Rows x arms: each arm's greedy answer, its tokens' mean and lowest logprob."""

    texts: np.ndarray
    mean_lp: np.ndarray
    min_lp: np.ndarray
    reproduced: float
    """Share of the table's rewards (rows x arms) these answers score to again."""
    generate_s: float
    """Wall time to answer every row with every arm (batched), when computed in this run."""


def arm_answers(table: RewardTable, base: Path, device: str) -> ArmAnswers | None:
    """The table's arms' answers: read from beside the table, else computed from its exported adapters (seconds)
    and written there. None when the table has no adapters on disk or its rows are not a built table's."""
    folder = Path(str(table.meta.get("cache", "")))
    served = table.meta.get("served_as", {})
    cols = [str(served.get(a, a)) for a in table.arms]
    paths = {c: folder / "adapters" / c.replace("@", "_at_") for c in cols if c != BASE_ARM}
    if not table.meta.get("cache") or not all(
        (p / "adapter_model.safetensors").is_file() for p in paths.values()
    ):
        return None
    if (folder / ANSWERS_FILE).is_file():
        try:
            z = np.load(folder / ANSWERS_FILE)
            return ArmAnswers(
                z["texts"], z["mean_lp"], z["min_lp"], float(z["reproduced"]), float(z["generate_s"])
            )
        except (OSError, ValueError, KeyError) as e:  # cut short or of another layout: computed again
            progress(f"answers: {folder / ANSWERS_FILE} does not read back ({e}); computing them again")
    config = table.meta.get("config", {})
    cfg = TableConfig(heldout=int(config.get("heldout", TableConfig.heldout)))
    examples, _, _ = _rows(cfg, list(dict.fromkeys(table.tasks)))
    from mint_core.data.spec import prompt_text

    if [prompt_text(ex.prompt) for ex in examples] != table.prompts:
        progress("answers: the table's rows are not the registered tasks' held-out rows; left out")
        return None
    from mint_core.data.rewards import Rewarder
    from mint_core.engine.base import load_base
    from mint_core.engine.engine import Engine, EngineConfig

    progress(f"answers: every row with each of {len(cols)} arms (once; kept as {folder / ANSWERS_FILE})")
    rank = max(json.loads((p / "adapter_config.json").read_text())["r"] for p in paths.values())
    engine = Engine(load_base(base, device=device), EngineConfig(max_loras=len(paths), max_lora_rank=rank))
    for c, p in paths.items():
        engine.load_adapter(c, p)
    n, k = len(examples), len(cols)
    texts = np.empty((n, k), dtype=object)
    mean_lp, min_lp, scored = np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k))
    t0 = time.perf_counter()
    with Rewarder() as rewarder:
        for j, col in enumerate(cols):
            done = complete(engine, None if col == BASE_ARM else col, examples, logprobs=True)
            texts[:, j] = [c.text for c in done]
            mean_lp[:, j] = [np.mean(c.logprobs) if c.logprobs else -100.0 for c in done]
            min_lp[:, j] = [np.min(c.logprobs) if c.logprobs else -100.0 for c in done]
            scored[:, j] = rewarder.score(examples, list(texts[:, j]))
    generate_s = time.perf_counter() - t0
    reproduced = float((np.abs(scored - table.rewards[:, :k]) < 1e-6).mean())
    out = ArmAnswers(texts.astype(str), mean_lp, min_lp, reproduced, generate_s)
    np.savez(
        folder / ANSWERS_FILE,
        texts=out.texts,
        mean_lp=mean_lp,
        min_lp=min_lp,
        reproduced=reproduced,
        generate_s=generate_s,
    )
    progress(
        f"answers: {n} rows x {k} arms in {generate_s:.0f} s, {100 * reproduced:.2f}% of the rewards reproduced"
    )
    return out


def answer_features(ans: ArmAnswers, rows: np.ndarray) -> np.ndarray:
    """rows x arms x features: a constant, the share of arms that gave this arm's answer, its tokens' mean and
    lowest logprob, its mean logprob and its share less the row's highest, and whether it is the surest arm's
    answer; then the same again in the arm's own block (a slope per arm)."""
    texts = np.char.strip(ans.texts[rows].astype(str))
    n, k = texts.shape
    share = (texts[:, :, None] == texts[:, None, :]).sum(axis=2) / k
    lp, low = ans.mean_lp[rows], ans.min_lp[rows]
    surest = texts == texts[np.arange(n), lp.argmax(axis=1)][:, None]
    shared = np.stack(
        [np.ones((n, k)), share, lp, low, lp - lp.max(axis=1, keepdims=True), share - share.max(axis=1, keepdims=True),
         surest.astype(float)],
        axis=2,
    )  # fmt: skip
    own = np.einsum("rkf,kj->rkjf", shared, np.eye(k)).reshape(n, k, -1)
    return np.concatenate([shared, own], axis=2)


def answer_choices(
    ans: ArmAnswers, rewards: np.ndarray, train: np.ndarray, rows: np.ndarray
) -> np.ndarray | None:
    """Per row of `rows`, the arm whose answer a ridge fit of the train rows' rewards (every arm's) on
    `answer_features` scores highest. None when the answers do not reproduce the table (REPRODUCED)."""
    if ans.reproduced < REPRODUCED:
        return None
    k = ans.texts.shape[1]
    F = answer_features(ans, train)
    X = F.reshape(-1, F.shape[2])
    y = rewards[train][:, :k].reshape(-1)
    w = np.linalg.solve(X.T @ X + ANSWER_RIDGE * np.eye(X.shape[1]), X.T @ y)
    return (answer_features(ans, rows) @ w).argmax(axis=1)
