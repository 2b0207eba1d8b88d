"""`model: "auto"`: does the router pick the adapter that answers best, from the prompt alone, and follow revisions?

Replays routers against a reward table (`_reward_table.py`): every held-out prompt of the registered tasks and a
paraphrase of each (a wording no task's data uses), answered greedily by every served arm (the bare base, each
task's policy, older weaker revisions `<task>-v1`, decoys named like policies: `<task>-expert` trained on another
task, `<task>-pro` a random LoRA), scored by each task's own rewards. Built once (minutes: the arms are trained
with mint's GRPO recipe on the built-in base) and cached under `--cache` by a digest of its inputs.

Per seed (`--seeds`, default 0,1,2: the split of prompts, the stream, the routers' own draws):
- offline: fit on the train half of the held-out prompts (every arm's reward of each: a batch fit), evaluate on
  the other half and on the paraphrases of that half (never seen);
- online: `--requests` requests drawn from the evaluation rows; each router sees only the reward of what it
  picked. Mint's router starts cold (warm-started from the train half's prompts of the task each arm is named for,
  `warm_start_tasks`, as a server does); at request N/4 one policy's champion moves to a better revision (its
  `-v1` rewards before, its champion's after) and at N/2 another's moves to a revision that regresses (its
  champion's rewards with noise in the adapter). Mint's router is told each arm's revision from the start and at
  each change, with the arm's cold start, as a server tells it (`set_revision`).

Routers: mint's `Router` with each featurizer (`char` n-grams, `word` n-grams), with the char n-grams followed by
each prompt's soft assignment to the tasks' centroids (`char+anchors`, `TaskAnchors`), and with the resident base's
hidden state in their place (`base-hidden`: a forward of the base per prompt; `--no-hidden` leaves it out), context-free
epsilon-greedy and
Thompson sampling (`mint_core.routing.baselines`), the best single arm (by the train half; online: in hindsight
over the stream), random, and three references: `task known` (told each prompt's task, it serves the arm with the
best mean reward on that task's train half), the task oracle (each task's best arm in hindsight, on the rows
scored) and the oracle (each request's best arm); offline also Arrow's zero-shot routing from the adapters'
weights (`arrow_choices`, with `base-hidden`: it runs the base) and `answers`, which sees every arm's own answer to
the request before it picks one (`_arm_answers.py`: the most a router can know short of the reward, at one
generation per arm a request; with `base-hidden`). Reports % of the oracle's reward and of the task oracle's (the
goals are judged against the oracle), top-1 accuracy
(ties count), the share of the gap between the best single arm and the oracle recovered, cumulative regret,
% of oracle over the last quarter of the stream (requests 1,500-2,000 of 2,000), requests of a task until 80% of
its traffic follows a revision change, the decision overhead p50/p95 with the table's arms and with a catalog of
`--catalog` names, and a pass/fail line per goal of issue 44. `--e2e`: end-to-end latency with and without
`model: "auto"` through mint serve, and through vLLM behind mint's front when `.venv-vllm` is there
(`_routing_e2e.py`).

    python benchmarks/routing.py [--seeds 0,1,2] [--requests 2000] [--cache runs/routing] [--steps 300]
        [--learning-rate 2e-3] [--rank R] [--old-steps 30] [--heldout 200] [--catalog 100000] [--e2e]
        [--no-hidden] [--e2e-requests 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see mint_app/cli/app.py train
os.environ.setdefault(
    "OPENBLAS_NUM_THREADS", "1"
)  # the router's inverses: one thread beats many on a busy box

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arm_answers import answer_choices, arm_answers
from _common import add_device, checked_device, load_avg, report, stop_servers_on_kill
from _reward_table import BASE_ARM, RewardTable, TableConfig, reward_table

from mint_core.routing import (
    Claim,
    ContextFreeThompson,
    EpsilonGreedy,
    Featurizer,
    Router,
    decision_latency,
    warm_start_tasks,
)
from mint_core.routing import router as router_module
from mint_core.routing.features import Kind, prompt_text

FEATURIZERS: tuple[str, ...] = ("char", "word", "char+anchors", "base-hidden")
"""The features mint's router is measured with: its featurizer's kinds (`Featurizer(kind=...)`, the first is the
default), and two alternatives that are not featurizers of mint's: `char+anchors` (`TaskAnchors`) and
`base-hidden`, the resident base's last hidden state, mean-pooled over the prompt's tokens (`HiddenStates`)."""
ANCHORED = "char+anchors"
ANCHOR_TEMPERATURE = 0.05
"""Softmax temperature over a prompt's cosines to the task centroids (`TaskAnchors`): char n-gram cosines of a
task's prompts to its own centroid are about 0.5-0.8, to another task's about 0.05-0.3."""
ANCHOR_WEIGHT = 3.0
"""What the anchors' part weighs beside the unit n-gram part before the whole is normalized."""
HIDDEN = "base-hidden"
CENTER_PROMPTS = 64
"""Train prompts of each task whose mean hidden state `HiddenStates` subtracts (never an evaluated row)."""

GOALS = {
    "offline_pct_oracle": 95.0,
    "offline_gap_recovered": 90.0,
    "online_pct_oracle_last": 90.0,
    "regret_vs_egreedy": 0.5,
    "follow_requests": 200,
    "decide_p95_ms_arms": 2.0,
    "decide_p95_ms_catalog": 20.0,
    "e2e_p95_overhead_pct": 5.0,
}
"""Issue 44's "Done when", one number each."""

ARROW = "arrow (from weights)"
ANSWERS = "answers (every arm answers)"
LENGTH_ORACLE = "task+length oracle"
REFERENCES = ("best single", "task known", "random", "oracle", "task oracle", LENGTH_ORACLE, ARROW, ANSWERS)
"""Rows of the report that are references, not learning routers: `task known` is told each prompt's task (the
best arm per task by the fit half), `task oracle` picks each task's best arm in hindsight on the rows scored,
`task+length oracle` (offline) the same per task, wording and prompt length (how long an item is being what an
arm's accuracy on it most plausibly depends on), `oracle` each request's best arm, `answers` sees every arm's
answer before it picks one (`_arm_answers.py`)."""

COLUMNS = {
    "pct_oracle": "% oracle",
    "pct_task_oracle": "% task oracle",
    "top1": "top-1 %",
    "gap_recovered": "% gap recovered",
    "pct_oracle_last": "% oracle, last 1/4",
    "regret": "regret",
    "regret_task_oracle": "regret vs task oracle",
}
"""The report's column headers: % of the per-request oracle's reward (what the goals are judged against) and %
of the task oracle's."""

FOLLOW_SHARE = 0.8
FOLLOW_WINDOW = 20
"""Traffic follows a change when FOLLOW_SHARE of the task's last FOLLOW_WINDOW requests go where they should."""


@dataclass
class Split:
    """Rows of the table a seed fits on and evaluates on."""

    train: np.ndarray
    eval: np.ndarray


def split(table: RewardTable, seed: int) -> Split:
    """Half the held-out prompts of each task to fit on (by a seeded digest of the prompt), the other half and
    their paraphrases to evaluate on; paraphrases of the fitted half are left out (their arguments were seen)."""

    def fit_half(i: int) -> bool:
        return hashlib.sha256(f"{seed}:{table.prompts[i]}".encode()).digest()[0] < 128

    held = [i for i, w in enumerate(table.wording) if w == "heldout"]
    train = {i for i in held if fit_half(i)}
    ev = [i for i in range(len(table.prompts)) if table.source[i] not in train]
    return Split(np.array(sorted(train)), np.array(ev))


class HiddenStates(Featurizer):
    """A prompt's features from the resident base: its last hidden state mean-pooled over the prompt's tokens, less
    the mean over `CENTER_PROMPTS` train prompts of each registered task of the table (else every prompt's vector
    shares one large common direction), L2-normalized. Computed once per distinct prompt (a forward of the base, timed in `seconds`)."""

    def __init__(self, base: Path, tasks: list[str]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from mint_core.data.spec import read_rows, registry

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(base))
        super().__init__(dim=int(self.model.config.hidden_size))
        self.seconds: list[float] = []
        self._center = np.zeros(self.dim, dtype=np.float32)
        reg = registry()
        train = [r.prompt for t in tasks if t in reg for r in read_rows(reg.get(t), "train")[:CENTER_PROMPTS]]
        if train:  # else (no task of the table registered) uncentered
            self._center = np.mean([self._pooled(prompt_text(p)) for p in train], axis=0)
        self.seconds.clear()
        self._seen: dict[str, np.ndarray] = {}

    def _pooled(self, prompt: str) -> np.ndarray:
        t0 = time.perf_counter()
        with self._torch.no_grad():
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            h = self.model(ids, output_hidden_states=True).hidden_states[-1][0]
            out = h.mean(dim=0).numpy()
        self.seconds.append(time.perf_counter() - t0)
        return out

    def transform(self, prompt: str | list[dict[str, str]]) -> np.ndarray:
        text = prompt_text(prompt)
        got = self._seen.get(text)
        if got is None:
            v = self._pooled(text) - self._center
            got = self._seen[text] = (v / max(float(np.linalg.norm(v)), 1e-9)).astype(np.float32)
        return got


class TaskAnchors(Featurizer):
    """The char n-grams (mint's default featurizer), then the prompt's soft assignment to each task's centroid: a
    softmax over the cosines between the prompt's n-gram vector and each task's mean (of `prompts`, the fit half's:
    never an evaluated row) at ANCHOR_TEMPERATURE, times ANCHOR_WEIGHT; the whole L2-normalized. A few dimensions
    that say which task a prompt is in any wording, beside the n-grams the arms' linear models also fit the
    arguments with. The centroids depend on the registered tasks, so a router of these features would need them
    fixed per router revision (fitted by the route flow, saved with the router)."""

    def __init__(self, prompts: dict[str, list[str]]) -> None:
        super().__init__()
        self.grams = Featurizer()
        means = np.stack(
            [self.grams.transform_many(list[Any](ps)).mean(axis=0) for _, ps in sorted(prompts.items()) if ps]
        )
        self.anchors = means / np.linalg.norm(means, axis=1, keepdims=True)
        self.dim = self.grams.dim + len(self.anchors)

    def transform(self, prompt: str | list[dict[str, str]]) -> np.ndarray:
        x = self.grams.transform(prompt)
        s = self.anchors @ x.astype(np.float64) / ANCHOR_TEMPERATURE
        e = np.exp(s - s.max())
        v = np.concatenate([x, ANCHOR_WEIGHT * e / e.sum()])
        return (v / np.linalg.norm(v)).astype(np.float32)


def arrow_choices(table: RewardTable, hidden: HiddenStates) -> np.ndarray | None:
    """Per row of the table, the arm Arrow's routing from adapter weights picks (Ostapenko et al., 2024; zero-shot:
    no reward, no prompt of any task): each adapter's prototype per LoRA module is the top right singular vector of
    its B A; each token's input to that module gives every adapter the logit |<prototype, input>|, a softmax over
    the adapters, averaged over the prompt's tokens and the modules; the highest average is served. The base has no
    weights to score and is never picked. None when the table's adapters are not on disk."""
    from safetensors.numpy import load_file

    folder = Path(str(table.meta.get("cache", ""))) / "adapters"
    served = table.meta.get("served_as", {})
    arms = [a for a in table.arms if a != BASE_ARM]
    paths = {
        a: folder / str(served.get(a, a)).replace("@", "_at_") / "adapter_model.safetensors" for a in arms
    }
    if not table.meta.get("cache") or not all(p.is_file() for p in paths.values()):
        return None
    protos: dict[str, dict[str, np.ndarray]] = {}
    for a, path in paths.items():
        w = load_file(str(path))
        protos[a] = {}
        for key in sorted(k.rsplit(".lora_", 1)[0] for k in w if k.endswith(".lora_A.weight")):
            delta = w[f"{key}.lora_B.weight"].astype(np.float64) @ w[f"{key}.lora_A.weight"].astype(
                np.float64
            )
            if np.abs(delta).sum() > 0:
                protos[a][key.removeprefix("base_model.model.")] = np.linalg.svd(delta, full_matrices=False)[
                    2
                ][0]
    modules = sorted(set().union(*(set(p) for p in protos.values())))
    V = {
        m: np.stack([protos[a].get(m, np.zeros_like(next(iter(protos[a].values())))) for a in arms])
        for m in modules
    }
    seen: dict[str, np.ndarray] = {}
    handles = [
        mod.register_forward_hook(lambda _m, args, _o, name=name: seen.__setitem__(name, args[0][0].numpy()))
        for name, mod in hidden.model.named_modules()
        if name in V
    ]
    out = np.zeros(len(table.prompts), dtype=np.int64)
    try:
        with hidden._torch.no_grad():
            for r, prompt in enumerate(table.prompts):
                seen.clear()
                hidden.model(hidden.tokenizer(prompt, return_tensors="pt").input_ids)
                score = np.zeros(len(arms))
                for m in modules:
                    logits = np.abs(seen[m].astype(np.float64) @ V[m].T)  # tokens x adapters
                    e = np.exp(logits - logits.max(axis=1, keepdims=True))
                    score += (e / e.sum(axis=1, keepdims=True)).mean(axis=0)
                out[r] = table.arms.index(arms[int(np.argmax(score))])
    finally:
        for h in handles:
            h.remove()
    return out


def featurizer(
    kind: str, hidden: HiddenStates | None = None, table: RewardTable | None = None, sp: Split | None = None
) -> Featurizer:
    """The featurizer a router of `kind` (a name of FEATURIZERS) is built with; `char+anchors` takes its tasks'
    centroids from the train rows of `sp`."""
    if kind == HIDDEN:
        assert hidden is not None
        return hidden
    if kind == ANCHORED:
        assert table is not None and sp is not None
        by_task: dict[str, list[str]] = {}
        for i in sp.train:
            by_task.setdefault(table.tasks[i], []).append(table.prompts[i])
        return TaskAnchors(by_task)
    return Featurizer(kind=cast(Kind, kind))


def seed_features(
    table: RewardTable, X: dict[str, np.ndarray], kinds: list[str], sp: Split, hidden: HiddenStates | None
) -> tuple[dict[str, Featurizer], dict[str, np.ndarray]]:
    """Each kind's featurizer for a seed and every row's features: those of `X` (the same for every seed) and, for a
    kind whose featurizer depends on the split (`char+anchors`), computed for this one."""
    feats = {k: featurizer(k, hidden, table, sp) for k in kinds}
    rows = dict(X)
    for k in kinds:
        if k not in rows:
            rows[k] = feats[k].transform_many(list[Any](table.prompts))
    return feats, rows


def cold_start(table: RewardTable, rows: np.ndarray) -> dict[str, list[str]]:
    """{arm: the prompts of `rows` of the task it is named for}: what a server warm-starts arms with."""
    out: dict[str, list[str]] = {}
    for arm, task in table.claims.items():
        if task is not None:
            out[arm] = [table.prompts[i] for i in rows if table.tasks[i] == task]
    return out


# ---- offline ----------------------------------------------------------------------------------------------------


def offline(
    table: RewardTable,
    X: dict[str, np.ndarray],
    sp: Split,
    seed: int,
    feats: dict[str, Featurizer],
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Every router's choices on the evaluation rows after a batch fit on the train rows (`feats`: each kind of `X`'s
    featurizer), and the references of `extra` (their choices on the evaluation rows)."""
    arms = table.arms
    R = table.rewards[:, : len(arms)]
    rng = np.random.default_rng(seed)
    choices: dict[str, np.ndarray] = {}
    for kind in X:
        router = Router(feats[kind], decay=1.0, seed=seed)  # a batch fit: nothing to forget
        warm_start_tasks(router, cold_start(table, sp.train))
        order = rng.permutation(sp.train)
        for i in order:
            for j, a in enumerate(arms):
                router.update(a, X[kind][i], float(R[i, j]))
        served = [arms.index(router.choose(X[kind][i], arms, rng=rng).arm) for i in sp.eval]
        greedy = [int(np.argmax(router.predict(X[kind][i], arms))) for i in sp.eval]
        choices[f"router:{kind}"] = np.array(served)
        choices[f"router:{kind} (greedy)"] = np.array(greedy)
    choices |= extra or {}
    best = int(np.argmax(R[sp.train].mean(axis=0)))
    choices["best single"] = np.full(len(sp.eval), best)
    choices["task known"] = task_known(table, sp.train, sp.eval)
    choices["random"] = rng.integers(len(arms), size=len(sp.eval))
    choices["oracle"] = R[sp.eval].argmax(axis=1)
    groups = [(table.tasks[i], table.wording[i]) for i in sp.eval]
    choices["task oracle"] = task_oracle(R[sp.eval], groups)
    by_length = [(*g, len(table.prompts[i])) for g, i in zip(groups, sp.eval, strict=True)]
    choices[LENGTH_ORACLE] = task_oracle(R[sp.eval], by_length)
    return {"choices": choices, "best_single_arm": arms[best]}


def task_known(table: RewardTable, fit: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per row of `rows`, the arm with the best mean reward on the `fit` rows of its task (the table's columns,
    champions): a reference router that is told each prompt's task and tells no item of a task from another, the
    most a router that recognises tasks perfectly can reach from the fit half."""
    R = table.rewards[:, : len(table.arms)]
    best = {}
    for task in set(table.tasks):
        mine = [i for i in fit if table.tasks[i] == task]
        best[task] = int(np.argmax(R[mine].mean(axis=0))) if mine else 0
    return np.array([best[table.tasks[i]] for i in rows], dtype=np.int64)


def task_oracle(R: np.ndarray, groups: list[Any]) -> np.ndarray:
    """Per row, the arm with the best mean reward over the rows of its group (a task and wording, and online the
    stretch between revision changes), in hindsight: the best a router can do that tells tasks apart perfectly
    but not items of one task (what the per-row oracle adds is which item each arm happens to get right)."""
    out = np.zeros(len(R), dtype=np.int64)
    for g in set(groups):
        rows = np.array([k for k, h in enumerate(groups) if h == g])
        out[rows] = int(np.argmax(R[rows].mean(axis=0)))
    return out


def scores(
    R: np.ndarray, choices: dict[str, np.ndarray], ref: str = "best single"
) -> dict[str, dict[str, float]]:
    """% of oracle reward (the per-request oracle, and the task oracle: `choices["task oracle"]`), top-1 accuracy
    (any arm tied with the best counts) and the share of the gap between `ref` and the oracle recovered, per
    router, over the rows of `R` (rows x arms)."""
    picked = {k: R[np.arange(len(R)), c] for k, c in choices.items()}
    oracle = R.max(axis=1)
    by_task = picked["task oracle"].sum()
    base = picked[ref].sum()
    out = {}
    for k, got in picked.items():
        gap = oracle.sum() - base
        out[k] = {
            "reward": float(got.mean()),
            "pct_oracle": float(100 * got.sum() / oracle.sum()),
            "pct_task_oracle": float(100 * got.sum() / by_task) if by_task > 0 else float("nan"),
            "top1": float(100 * (got >= oracle - 1e-9).mean()),
            "gap_recovered": float(100 * (got.sum() - base) / gap) if gap > 0 else float("nan"),
        }
    return out


# ---- online -----------------------------------------------------------------------------------------------------


@dataclass
class Events:
    """The revision changes of the stream: `better` serves its `-v1` rewards until `at_better`, its champion's
    after; `worse` serves its champion's until `at_worse`, its regressed revision's after."""

    better: str
    at_better: int
    worse: str
    at_worse: int


def events(table: RewardTable, rows: np.ndarray, n: int) -> Events:
    """The policies whose change is largest on their own task's rows: the most improved over its older revision
    (at N/4), and among the others the one its regressed revision hurts most (at N/2)."""

    def gain(task: str, a: str, b: str) -> float:
        own = [i for i in rows if table.tasks[i] == task]
        return float(table.column(a)[own].mean() - table.column(b)[own].mean())

    cands = sorted(table.revisions)
    better = max(cands, key=lambda t: gain(t, t, table.revisions[t]["v1"]))
    worse = max((t for t in cands if t != better), key=lambda t: gain(t, t, table.revisions[t]["regressed"]))
    return Events(better, n // 4, worse, n // 2)


def stream_rewards(table: RewardTable, ev: Events, stream: np.ndarray) -> np.ndarray:
    """Rewards (requests x arms) each arm would earn on each request of the stream, the revision changes in."""
    arms = table.arms
    R = table.rewards[stream][:, : len(arms)].copy()
    b, w = arms.index(ev.better), arms.index(ev.worse)
    R[: ev.at_better, b] = table.column(table.revisions[ev.better]["v1"])[stream[: ev.at_better]]
    R[ev.at_worse :, w] = table.column(table.revisions[ev.worse]["regressed"])[stream[ev.at_worse :]]
    return R


def _online_router(
    name: str, table: RewardTable, sp: Split, seed: int, feats: dict[str, Featurizer]
) -> tuple[Any, dict[str, list[Claim]]]:
    """A router of the online replay, and each arm's cold start (what a new revision starts from again)."""
    if name.startswith("router:"):
        router = Router(feats[name.split(":", 1)[1]], seed=seed)
        return router, warm_start_tasks(router, cold_start(table, sp.train))
    if name == "epsilon-greedy":
        return EpsilonGreedy(seed=seed), {}
    return ContextFreeThompson(seed=seed), {}


def online(
    table: RewardTable,
    X: dict[str, np.ndarray],
    sp: Split,
    seed: int,
    n: int,
    feats: dict[str, Featurizer],
) -> dict[str, Any]:
    """Each learning router over the same stream of `n` requests, seeing only the reward of its own choice. Mint's
    routers are told each arm's revision before the first request (a server learns it from the arm's first
    answer) and at each change, with the arm's cold start (`set_revision`), as serving tells them."""
    arms = table.arms
    rng = np.random.default_rng(seed + 1000)
    stream = rng.choice(sp.eval, size=n)
    ev = events(table, sp.train, n)
    R = stream_rewards(table, ev, stream)
    choices: dict[str, np.ndarray] = {}
    for name in [*(f"router:{k}" for k in X), "epsilon-greedy", "Thompson (context-free)"]:
        router, claims = _online_router(name, table, sp, seed, feats)
        xs = X[name.split(":", 1)[1] if name.startswith("router:") else FEATURIZERS[0]]
        r_rng = np.random.default_rng(seed)
        picked = np.zeros(n, dtype=np.int64)
        told = isinstance(router, Router)
        for a in arms if told else ():
            router.set_revision(a, "v1")
        for t, row in enumerate(stream):
            if t == ev.at_better and told:
                router.set_revision(ev.better, "v2", claims.get(ev.better, ()))
            if t == ev.at_worse and told:
                router.set_revision(ev.worse, "v3", claims.get(ev.worse, ()))
            x = xs[row]
            j = arms.index(router.choose(x, arms, rng=r_rng).arm)
            picked[t] = j
            router.update(arms[j], x, float(R[t, j]))
        choices[name] = picked
    choices["best single"] = np.full(n, int(np.argmax(R.sum(axis=0))))
    choices["task known"] = task_known(table, sp.train, stream)
    choices["random"] = rng.integers(len(arms), size=n)
    choices["oracle"] = R.argmax(axis=1)
    phase = np.searchsorted([ev.at_better, ev.at_worse], np.arange(n), side="right")
    groups = [(table.tasks[i], table.wording[i], int(p)) for i, p in zip(stream, phase, strict=True)]
    choices["task oracle"] = task_oracle(R, groups)
    return {"R": R, "stream": stream, "events": ev, "choices": choices}


def follow(table: RewardTable, run: dict[str, Any], name: str) -> dict[str, int | None]:
    """Requests of the changed task, after each change, until FOLLOW_SHARE of its last FOLLOW_WINDOW go to the
    better revision: the improved policy after `better`; anything but the regressed one after `worse`."""
    ev: Events = run["events"]
    arms, picked, stream = table.arms, run["choices"][name], run["stream"]
    out: dict[str, int | None] = {}
    for label, task, at, arm, toward in (
        ("better", ev.better, ev.at_better, ev.better, True),
        ("worse", ev.worse, ev.at_worse, ev.worse, False),
    ):
        mine = [t for t in range(at, len(stream)) if table.tasks[stream[t]] == task]
        ok = np.array([(arms[picked[t]] == arm) == toward for t in mine], dtype=float)
        out[label] = None
        for k in range(FOLLOW_WINDOW, len(ok) + 1):
            if ok[k - FOLLOW_WINDOW : k].mean() >= FOLLOW_SHARE:
                out[label] = k
                break
    return out


def online_scores(table: RewardTable, run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per router: % of oracle over the whole stream and its last quarter, top-1, cumulative regret (against
    the oracle), requests until traffic follows each change (learning routers only)."""
    R, n = run["R"], len(run["stream"])
    oracle = R.max(axis=1)
    by_task = R[np.arange(n), run["choices"]["task oracle"]]
    last = slice(3 * n // 4, n)
    out: dict[str, dict[str, Any]] = {}
    for k, c in run["choices"].items():
        got = R[np.arange(n), c]
        row: dict[str, Any] = {
            "pct_oracle": float(100 * got.sum() / oracle.sum()),
            "pct_task_oracle": float(100 * got.sum() / by_task.sum()),
            "pct_oracle_last": float(100 * got[last].sum() / oracle[last].sum()),
            "top1": float(100 * (got >= oracle - 1e-9).mean()),
            "regret": float((oracle - got).sum()),
            "regret_task_oracle": float((by_task - got).sum()),
        }
        if k not in REFERENCES:
            row["follow"] = follow(table, run, k)
        out[k] = row
    return out


# ---- overhead ---------------------------------------------------------------------------------------------------


def cpu_latency(
    router: Any, xs: list[np.ndarray], candidates: list[str], rng: np.random.Generator
) -> dict[str, float]:
    """p50/p95 of `choose`'s own CPU time (ms, this thread's clock): what a decision costs when the process is
    not preempted, beside the wall-clock figure a busy shared machine inflates at the tail."""
    ms = []
    for x in xs:
        t0 = time.thread_time()
        router.choose(x, candidates, rng=rng)
        ms.append((time.thread_time() - t0) * 1e3)
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def _evict_bytes() -> int:
    """A buffer size that pushes a decision's state out of every cache: four times the last-level cache this
    machine reports (at least 64 MiB, at most 512 MiB)."""
    try:
        llc = int(os.sysconf("SC_LEVEL3_CACHE_SIZE"))
    except (ValueError, OSError):
        llc = 0
    return int(min(max(4 * llc, 64 << 20), 512 << 20))


@contextmanager
def _float64_widths(router: Router) -> Iterator[None]:
    """Within it, `router` computes each arm's confidence width as mint did before `_width`: the float64
    quadratic form over every row of P (the same-run baseline of the cold decision)."""
    full = {id(st.P32): st.P for st in router._state.values()}

    def width(P32: np.ndarray, x32: np.ndarray, rows: np.ndarray | None) -> float:
        xa = x32.astype(np.float64)
        return float(np.sqrt(max(float(xa @ full[id(P32)] @ xa), 0.0)))

    saved = router_module._width
    router_module._width = width
    try:
        yield
    finally:
        router_module._width = saved


def cold_latency(
    router: Router, xs: list[np.ndarray], candidates: list[str], rng: np.random.Generator
) -> dict[str, dict[str, float]]:
    """`choose`'s decide time (ms) when a buffer larger than the last-level cache was written just before each
    decision, as a server's generation and HTTP handling do between two requests: what a decision costs in a
    server, where it reads every arm's state from memory. Beside it, in the same run on the same prompts, the
    float64 widths over every row (`_float64_widths`), and the ratio."""
    junk = np.zeros(_evict_bytes() // 8)

    def timed() -> list[float]:
        ms = []
        for x in xs:
            junk[:] += 1.0
            ms.append(router.choose(x, candidates, rng=rng).decide_s * 1e3)
        return ms

    now = timed()
    with _float64_widths(router):
        before = timed()
    out = {
        label: {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}
        for label, ms in (("float32_rows", now), ("float64_full", before))
    }
    out["ratio_p50"] = {
        "float32_rows / float64_full": out["float32_rows"]["p50_ms"] / out["float64_full"]["p50_ms"]
    }
    return out


def overhead(
    table: RewardTable, X: dict[str, np.ndarray], sp: Split, catalog: int, seed: int
) -> dict[str, Any]:
    """Decision time p50/p95 (ms, `Router.choose` alone and with the prompt's features) with the table's arms
    (a router warm-started and fed a few hundred rewards), the same from a cold cache (`cold_latency`), and with
    `catalog` candidate names, `catalog // 100` of them holding evidence of random weights (the rest on the prior,
    as a catalog's unrouted names are)."""
    rng = np.random.default_rng(seed)
    kind = FEATURIZERS[0]
    feat = featurizer(kind, None)
    router = Router(feat, seed=seed)
    warm_start_tasks(router, cold_start(table, sp.train))
    R = table.rewards[:, : len(table.arms)]
    for i in rng.choice(sp.train, size=300):
        j = int(rng.integers(len(table.arms)))
        router.update(table.arms[j], X[kind][i], float(R[i, j]))
    xs = [X[kind][i] for i in rng.choice(sp.eval, size=500)]
    out: dict[str, Any] = {"arms": len(table.arms), "catalog": catalog}
    out["arms_ms"] = decision_latency(router, xs, table.arms, rng=rng)
    out["arms_cpu_ms"] = cpu_latency(router, xs, table.arms, rng)
    out["arms_cold_ms"] = cold_latency(router, xs[:200], table.arms, rng)
    texts = [table.prompts[i] for i in rng.choice(sp.eval, size=500)]
    ms = []
    for p in texts:
        t0 = time.perf_counter()
        router.choose(feat.transform(p), table.arms, rng=rng)
        ms.append((time.perf_counter() - t0) * 1e3)
    out["arms_with_features_ms"] = {
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
    }
    big = Router(feat, seed=seed)
    names = [f"policy-{k:06d}" for k in range(catalog)]
    for name in names:
        big.add_arm(name)
    for name in rng.choice(names, size=max(1, catalog // 100), replace=False):
        pts = rng.normal(size=(4, feat.dim)).astype(np.float32)
        big.warm_start(str(name), pts / np.linalg.norm(pts, axis=1, keepdims=True), float(rng.random()))
    big.choose(xs[0], names, rng=rng)  # the candidate list's index is built once per list, not per request
    out["catalog_ms"] = decision_latency(big, xs[:200], names, rng=rng)
    out["catalog_cpu_ms"] = cpu_latency(big, xs[:200], names, rng)
    return out


# ---- the report -------------------------------------------------------------------------------------------------


def _mean_min(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    vals = [float(r[key]) for r in rows]
    return float(np.mean(vals)), float(np.min(vals))


def _print_table(title: str, per_seed: list[dict[str, dict[str, Any]]], keys: list[str]) -> None:
    print(f"\n{title} (mean over seeds; min in brackets)")
    print(f"{'router':28s}" + "".join(f"{COLUMNS.get(k, k):>22s}" for k in keys))
    for name in per_seed[0]:
        cells = []
        for k in keys:
            m, lo = _mean_min([s[name] for s in per_seed], k)
            cells.append(f"{m:>14.2f} [{lo:>5.1f}]" if np.isfinite(m) else f"{'-':>22s}")
        print(f"{name:28s}" + "".join(cells))


def _follow_max(per_seed: list[dict[str, dict[str, Any]]], name: str, label: str) -> int | None:
    got = [s[name]["follow"][label] for s in per_seed]
    return None if any(g is None for g in got) else max(got)


def _e2e(table: RewardTable, base: Path, n: int, device: str) -> dict[str, Any]:
    from _routing_e2e import e2e  # deferred: starts servers, imports the serving stack

    return e2e(table, base, n, device)


def verdicts(
    off: list[dict[str, Any]], on: list[dict[str, Any]], oh: dict[str, Any], e2e: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One line per goal of issue 44 (the worst seed counts), for mint's router with the default featurizer."""
    r = f"router:{FEATURIZERS[0]}"
    g = GOALS
    worst_ratio = max(s[r]["regret"] / s["epsilon-greedy"]["regret"] for s in on)
    follows = [_follow_max(on, r, label) for label in ("better", "worse")]
    follow_worst = None if any(f is None for f in follows) else max(f for f in follows if f is not None)
    rows = [
        ("offline % of oracle", _mean_min([s[r] for s in off], "pct_oracle")[1], ">=", g["offline_pct_oracle"]),
        ("offline % of gap recovered", _mean_min([s[r] for s in off], "gap_recovered")[1], ">=",
         g["offline_gap_recovered"]),
        ("online % of oracle, last quarter", _mean_min([s[r] for s in on], "pct_oracle_last")[1], ">=",
         g["online_pct_oracle_last"]),
        ("online regret / epsilon-greedy's", worst_ratio, "<=", g["regret_vs_egreedy"]),
        ("requests until traffic follows", follow_worst, "<=", g["follow_requests"]),
        ("decide p95 ms, table's arms", oh["arms_ms"]["p95_ms"], "<=", g["decide_p95_ms_arms"]),
        ("decide p95 ms, catalog", oh["catalog_ms"]["p95_ms"], "<=", g["decide_p95_ms_catalog"]),
    ]  # fmt: skip
    for backend, got in (e2e or {}).items():
        if isinstance(got, dict):
            rows.append((f"end-to-end p95 overhead %, {backend}", got["p95_overhead_pct"], "<=",
                         g["e2e_p95_overhead_pct"]))  # fmt: skip
    out = []
    for name, value, op, goal in rows:
        ok = value is not None and (value >= goal if op == ">=" else value <= goal)
        out.append({"goal": name, "value": value, "op": op, "target": goal, "pass": bool(ok)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TableConfig()
    ap.add_argument("--base", type=Path, default=defaults.base)
    ap.add_argument("--data", type=Path, default=defaults.data)
    ap.add_argument("--tasks", default="", help="registered tasks, comma-separated (default: every one)")
    ap.add_argument("--steps", type=int, default=defaults.steps, help="GRPO steps of each task's policy")
    ap.add_argument("--learning-rate", type=float, default=defaults.learning_rate, help="GRPO rate (rank 8)")
    ap.add_argument("--rank", type=int, help="LoRA rank of every policy (default: each task spec's)")
    ap.add_argument("--old-steps", type=int, default=defaults.old_steps, help="steps of the older revisions")
    ap.add_argument("--heldout", type=int, default=defaults.heldout, help="held-out prompts per task")
    ap.add_argument("--table-seed", type=int, default=defaults.seed, help="the training run's seed")
    ap.add_argument("--cache", type=Path, default=Path("runs/routing"), help="where reward tables are kept")
    ap.add_argument("--table", type=Path, help="replay this table folder (one the cache holds) as it is")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--requests", type=int, default=2000, help="requests of the online stream")
    ap.add_argument("--catalog", type=int, default=100_000, help="candidate names of the overhead's catalog")
    ap.add_argument(
        "--no-hidden",
        action="store_true",
        help=f"leave out what runs the base per prompt: the {HIDDEN} features, Arrow and the answers reference",
    )
    ap.add_argument("--e2e", action="store_true", help="end-to-end latency with and without model auto")
    ap.add_argument("--e2e-requests", type=int, default=200, help="prompts sent each way per backend")
    add_device(ap)
    args = ap.parse_args()
    stop_servers_on_kill()
    device = checked_device(ap, args.device)
    if args.requests < 8:
        ap.error(f"--requests {args.requests}: at least 8")
    cfg = TableConfig(
        base=args.base,
        data=args.data,
        tasks=tuple(t for t in args.tasks.split(",") if t),
        steps=args.steps,
        learning_rate=args.learning_rate,
        rank=args.rank,
        old_steps=args.old_steps,
        heldout=args.heldout,
        seed=args.table_seed,
        device=device,
    )
    t0 = time.perf_counter()
    if args.table:
        if not (args.table / "table.json").is_file():
            ap.error(f"--table {args.table}: no reward table there (table.json); the cache holds them")
        table = RewardTable.load(args.table)
        table.meta["cache"] = str(args.table)
    else:
        table = reward_table(cfg, args.cache)
    if not args.no_hidden and not (args.base / "config.json").is_file():
        ap.error(
            f"--base {args.base}: no model directory there (config.json); --no-hidden leaves {HIDDEN} out"
        )
    kinds = [k for k in FEATURIZERS if k != HIDDEN or not args.no_hidden]
    hidden = None if args.no_hidden else HiddenStates(args.base, sorted(set(table.tasks)))
    X: dict[str, np.ndarray] = {  # the kinds whose features are the same for every seed
        k: featurizer(k, hidden).transform_many(list[Any](table.prompts)) for k in kinds if k != ANCHORED
    }
    arrow = None if hidden is None else arrow_choices(table, hidden)
    answers = None if hidden is None else arm_answers(table, args.base, device)
    hidden_ms = None
    if hidden is not None:
        ms = [1e3 * s for s in hidden.seconds]
        hidden_ms = {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    off, on, best = [], [], []
    for seed in seeds:
        sp = split(table, seed)
        feats, rows = seed_features(table, X, kinds, sp, hidden)
        extra = {} if arrow is None else {ARROW: arrow[sp.eval]}
        picked = None if answers is None else answer_choices(answers, table.rewards, sp.train, sp.eval)
        extra |= {} if picked is None else {ANSWERS: picked}
        o = offline(table, rows, sp, seed, feats, extra)
        off.append(scores(table.rewards[sp.eval][:, : len(table.arms)], o["choices"]))
        best.append(o["best_single_arm"])
        run = online(table, rows, sp, seed, args.requests, feats)
        on.append(online_scores(table, run))
        print(f"seed {seed}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    oh = overhead(table, X, split(table, seeds[0]), args.catalog, seeds[0])
    _print_table(
        "offline, held-out + paraphrased prompts",
        off,
        ["pct_oracle", "pct_task_oracle", "top1", "gap_recovered"],
    )
    _print_table(
        "online",
        on,
        ["pct_oracle", "pct_task_oracle", "pct_oracle_last", "top1", "regret", "regret_task_oracle"],
    )
    ev = events(table, split(table, seeds[0]).train, args.requests)
    for name in on[0]:
        if "follow" in on[0][name]:
            print(
                f"{name:28s} follows {ev.better}'s better revision in {_follow_max(on, name, 'better')}, "
                f"{ev.worse}'s regression in {_follow_max(on, name, 'worse')} of its requests (worst seed)"
            )
    print(f"decision overhead: {oh}")
    if hidden_ms is not None:
        print(f"{HIDDEN} features (a forward of the base per prompt, before any decision): {hidden_ms}")
    if answers is not None:
        print(
            f"answers: every arm's, {answers.generate_s:.0f} s for all rows x arms when computed; "
            f"{100 * answers.reproduced:.2f}% of the table's rewards reproduced"
        )
    e2e = _e2e(table, args.base, args.e2e_requests, device) if args.e2e else None
    checks = verdicts(off, on, oh, e2e)
    for c in checks:
        value = "none" if c["value"] is None else f"{c['value']:.3f}"
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['goal']}: {value} (goal {c['op']} {c['target']})")
    if e2e is None:
        print("NOT RUN  end-to-end p95 with model auto within 5% of naming the adapter (--e2e)")
    report(
        {
            "benchmark": "routing",
            "table": table.meta,
            "arms": table.arms,
            "rows": len(table.prompts),
            "seeds": seeds,
            "requests": args.requests,
            "best_single_arm": best,
            "events": {
                "better": ev.better,
                "at_better": ev.at_better,
                "worse": ev.worse,
                "at_worse": ev.at_worse,
            },
            "offline": off,
            "online": on,
            "overhead": oh,
            "hidden_features_ms": hidden_ms,
            "answers": None
            if answers is None
            else {"reproduced": answers.reproduced, "generate_s": round(answers.generate_s, 1)},
            "e2e": e2e,
            "goals": checks,
            "load_avg": load_avg(),
            "total_s": round(time.perf_counter() - t0, 1),
        }
    )


if __name__ == "__main__":
    main()
