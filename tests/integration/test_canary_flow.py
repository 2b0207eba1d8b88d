"""The canary flow against real servers (MLflow, Prefect, mint serve, and in the slow tier vLLM behind its front):
users rate the answers (POST /v1/feedback), the always-valid test promotes a candidate they prefer and rolls back
one they do not, and no request fails on the way."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.canary import canary_flow
from mint_core.lifecycle.smoke import served_revision
from mint_core.lifecycle.workspace import Workspace
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.registry.store import AdapterStore
from tasks.canary import CANARY, CANARY_TAG, CanaryConfig
from tasks.common import artifact_key
from tests.integration.conftest import Endpoint

pytestmark = pytest.mark.integration


class RatingUsers:
    """Users asking a non-task prompt (so nothing is scored by the server) and rating each answer by the arm
    that gave it: 1 with probability p[arm], else 0."""

    def __init__(self, endpoint: Endpoint, policy: str, p: dict[str, float], workers: int = 4):
        self.endpoint, self.policy, self.p = endpoint, policy, p
        self.outcomes: dict[str, int] = {}
        self.arms: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.endpoint.url, timeout=60) as http:
            while not self._stop.is_set():
                body = {
                    "model": self.policy,
                    "prompt": "Rate me",
                    "max_tokens": 2,
                    "user": f"u{rng.randrange(10**6)}",
                }
                try:
                    r = http.post("/v1/completions", json=body)
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.outcomes[status] = self.outcomes.get(status, 0) + 1
                if status != "200":
                    time.sleep(0.05)
                    continue
                arm = r.headers.get("x-mint-arm", "none")
                self.arms[arm] = self.arms.get(arm, 0) + 1
                if arm in self.p:
                    score = float(rng.random() < self.p[arm])
                    http.post("/v1/feedback", json={"id": r.json()["id"], "score": score}).raise_for_status()

    def __enter__(self) -> RatingUsers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


@pytest.fixture
def policy(
    endpoint: Endpoint,
    mlflow_server: str,
    prefect_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Workspace, str, dict[int, str]]]:
    """A policy with three revisions, v1 its champion and served."""
    monkeypatch.setenv("MINT_SERVE_ADMIN_TOKEN", endpoint.admin_token)
    ws = Workspace(
        tracking_uri=mlflow_server,
        store=str(endpoint.store),
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        serving_url=endpoint.url,
        admin_token_file=None,
        work_dir=tmp_path / "lifecycle",
    )
    reg = ws.registry()
    store = AdapterStore(endpoint.store)
    name = f"c-{uuid.uuid4().hex[:6]}"
    digests = {}
    for i in range(3):
        w = random_adapter(
            endpoint.sites,
            ["q_proj", "v_proj"],
            4,
            seed=40 + i,
            std=0.3,
            base_fingerprint=endpoint.base.fingerprint,
        )
        save_adapter(w, tmp_path / f"a{i}", endpoint.sites)
        rev = reg.create_revision(
            name, store.put_dir(tmp_path / f"a{i}"), base=endpoint.base.fingerprint, rank=4
        )
        digests[rev.version] = rev.digest
    reg.promote(name, 1, "test start")
    with ws.client() as c:
        c.load_adapter(name, ws.lora_path(digests[1]), inplace=True)
    yield ws, name, digests
    with ws.client() as c:
        c.clear_canary(name)
        for n in (name, f"{name}@canary"):
            with contextlib.suppress(Exception):
                c.unload_adapter(n)


CONFIG = CanaryConfig(share=0.5, poll_s=0.5, min_per_arm=20, max_requests=5000, max_minutes=2)


# on vLLM in the slow tier (25-35 s): the flow's logic is the same on both backends, and the vLLM front's split,
# feedback and promotion under load run by default in test_canary_serving.py, test_hot_swap.py, test_vllm_replicas.py
@pytest.mark.parametrize(
    "endpoint", ["mint", pytest.param("vllm", marks=pytest.mark.slow)], indirect=True, scope="module"
)
def test_a_preferred_canary_is_promoted_and_a_worse_one_rolled_back(
    endpoint: Endpoint, policy: tuple[Workspace, str, dict[int, str]]
) -> None:
    ws, name, digests = policy
    reg = ws.registry()
    with RatingUsers(endpoint, name, {"canary": 0.85, "control": 0.45}) as users:
        good = canary_flow(policy=name, version=2, canary=CONFIG, workspace=ws)
    assert good.decision == "promoted", good.reason
    assert good.lo is not None and good.lo > 0 and good.scored >= 2 * CONFIG.min_per_arm
    assert reg.alias_version(name, "champion") == 2 and reg.alias_version(name, CANARY) is None
    with ws.client() as c:
        assert served_revision(c, name) == f"sha256:{digests[2]}"
        assert c.canary(name)["split"] is None
        assert f"{name}@canary" not in {m["id"] for m in c.models()}
    tag = json.loads(reg.revision(name, 2).tags[CANARY_TAG])
    assert tag["decision"] == "promoted" and tag["n"] == good.scored and tag["lo"] > 0
    history = MlflowClient(ws.tracking_uri).get_metric_history(tag["run_id"], "online/diff")
    # one point per poll that had an estimate; fast traffic can bring the whole decision in the first such poll
    assert len(history) >= 1 and history[-1].step == good.scored
    assert set(users.outcomes) == {"200"}, users.outcomes  # no request failed across the canary and the swap
    # the flow's artifact shows the running estimate and the decision
    with get_client(sync_client=True) as client:
        shown = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key("canary", name)]))
        )
    assert shown and any("**promote**" in str(a.data) and "| scored |" in str(a.data) for a in shown)

    with RatingUsers(endpoint, name, {"canary": 0.2, "control": 0.7}) as users:
        bad = canary_flow(policy=name, version=3, canary=CONFIG, workspace=ws)
    assert bad.decision == "rolled back", bad.reason
    assert bad.hi is not None and bad.hi < 0
    assert reg.alias_version(name, "champion") == 2 and reg.alias_version(name, CANARY) is None
    assert json.loads(reg.revision(name, 3).tags[CANARY_TAG])["decision"] == "rolled back"
    assert set(users.outcomes) == {"200"}, users.outcomes
    with ws.client() as c:
        out = c.complete(name, "Rate me", max_tokens=2, user="anyone")
        assert out["system_fingerprint"].removeprefix("sha256:") == digests[2]


# the flow's own logic, the same whichever backend serves: checked on mint serve (the promote/rollback test above
# runs on vLLM too)
MINT_ONLY = pytest.mark.parametrize("endpoint", ["mint"], indirect=True, scope="module")


@MINT_ONLY
def test_a_first_revision_canaried_against_the_base_is_promoted(
    endpoint: Endpoint, policy: tuple[Workspace, str, dict[int, str]]
) -> None:
    """With no champion the control arm is the bare base; the promotion's smoke check of the name goes past the
    split (it would otherwise be answered by the base)."""
    ws, name, digests = policy
    reg = ws.registry()
    reg.set_alias(name, "champion", None, "test: no champion yet", expect=1)
    with ws.client() as c:
        c.unload_adapter(name)
    with RatingUsers(endpoint, name, {"canary": 0.9, "control": 0.3}) as users:
        out = canary_flow(policy=name, version=2, canary=CONFIG, workspace=ws)
    assert out.decision == "promoted" and out.champion_before is None, out.reason
    assert reg.alias_version(name, "champion") == 2
    assert users.arms.get("control", 0) > 0 and set(users.outcomes) <= {"200", "404"}, users.outcomes
    with ws.client() as c:
        assert served_revision(c, name) == f"sha256:{digests[2]}"


@MINT_ONLY
def test_a_canary_of_the_champion_or_an_unknown_version_changes_nothing(
    endpoint: Endpoint, policy: tuple[Workspace, str, dict[int, str]]
) -> None:
    ws, name, _ = policy
    reg = ws.registry()
    for version, says in ((1, "already"), (9, "9")):
        with pytest.raises(Exception, match=says):
            canary_flow(policy=name, version=version, canary=CONFIG, workspace=ws)
        assert reg.alias_version(name, CANARY) is None and reg.alias_version(name, "champion") == 1
        with ws.client() as c:
            assert c.canary(name)["split"] is None
