"""Canary splits on both backends (serving/canary.py): a deterministic share of a policy's request keys answered by
the candidate, every response naming its revision, task answers scored by the server, feedback for the rest."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import pytest

from mint_core.lora.adapter import digest_dir
from tests.integration.conftest import Endpoint

pytestmark = pytest.mark.integration

SHARE = 0.3


@pytest.fixture(scope="module")
def pair(endpoint: Endpoint) -> dict[str, str]:
    """`pol` (the champion) and `pol@canary` (the candidate) loaded: served name -> digest."""
    out = {}
    with endpoint.client() as c:
        for name, seed in (("pol", 11), ("pol@canary", 12)):
            path = endpoint.make_adapter(name.replace("@", "-"), seed)
            c.load_adapter(name, path.name, inplace=True)
            out[name] = digest_dir(path)
    yield out
    with endpoint.client() as c:
        c.clear_canary("pol")
        for name in out:
            c.unload_adapter(name)


def ask(http: httpx.Client, user: str | None, prompt: str = "add: 12+30 =", **kw: Any) -> httpx.Response:
    body = {"model": "pol", "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    if user is not None:
        body["user"] = user
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def http(endpoint: Endpoint) -> httpx.Client:
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    with httpx.Client(base_url=endpoint.url, timeout=120, headers=headers) as c:
        yield c


def test_split_is_deterministic_per_key_and_names_the_revision(
    endpoint: Endpoint, pair: dict[str, str], http: httpx.Client
) -> None:
    with endpoint.client() as c:
        c.put_canary("pol", "pol@canary", "pol", SHARE)
        start = c.canary("pol")["next"]
    n = 160
    arms = {}
    for i in range(n):
        r = ask(http, f"user-{i}")
        doc = r.json()
        arm = r.headers["x-mint-arm"]
        served = "pol@canary" if arm == "canary" else "pol"
        assert doc["model"] == served
        assert doc["system_fingerprint"].removeprefix("sha256:") == pair[served]
        arms[i] = arm
    k = sum(a == "canary" for a in arms.values())
    sd = math.sqrt(n * SHARE * (1 - SHARE))
    assert abs(k - n * SHARE) < 4 * sd, k
    for i in range(0, n, 16):  # the same key lands on the same arm, whole or streamed
        assert ask(http, f"user-{i}").headers["x-mint-arm"] == arms[i]
        body = {"model": "pol", "prompt": "add: 1+2 =", "max_tokens": 3, "stream": True, "user": f"user-{i}"}
        with http.stream("POST", "/v1/completions", json=body) as s:
            assert s.headers["x-mint-arm"] == arms[i]
            s.read()
    # every answer to a task prompt was scored by the server with the task's reward (its spec's, in [0, 1])
    # scored off the event loop once the answer is out: the last ones may land a moment after their responses
    want = n + 2 * len(range(0, n, 16))
    deadline = time.monotonic() + 20
    with endpoint.client() as c:
        view = c.canary("pol", after=start)
        while len(view["events"]) < want and time.monotonic() < deadline:
            time.sleep(0.1)
            view = c.canary("pol", after=start)
    events = view["events"]
    assert len(events) == want
    assert {e["source"] for e in events} == {"task"}
    assert all(0.0 <= e["score"] <= 1.0 for e in events)
    assert {e["arm"] for e in events} == {"canary", "control"}
    assert view["arms"]["canary"]["requests"] + view["arms"]["control"]["requests"] >= len(events)


def test_header_key_and_feedback(endpoint: Endpoint, pair: dict[str, str], http: httpx.Client) -> None:
    with endpoint.client() as c:
        c.put_canary("pol", "pol@canary", "pol", SHARE)
        after = c.canary("pol")["next"]
    arms = {
        http.post(
            "/v1/completions",
            json={"model": "pol", "prompt": "tell me", "max_tokens": 2},
            headers={"X-Mint-Key": "same-user"},
        ).headers["x-mint-arm"]
        for _ in range(5)
    }
    assert len(arms) == 1
    r = ask(http, "fb-user", prompt="Once upon a time")  # not a task prompt: nothing scored until feedback
    rid = r.json()["id"]
    with endpoint.client() as c:
        assert c.canary("pol", after=after)["events"] == []
        got = c.feedback(rid, 0.7)
        assert got["score"] == 0.7 and got["source"] == "feedback" and got["arm"] == r.headers["x-mint-arm"]
        assert [e["score"] for e in c.canary("pol", after=after)["events"]] == [0.7]
    for body, status, param in (
        ({"id": rid, "score": 0.5}, 409, "id"),
        ({"id": "cmpl-nosuch", "score": 0.5}, 404, "id"),
        ({"id": rid, "score": 1.5}, 400, "score"),
        ({"id": rid, "score": "NaN"}, 400, "score"),
        ({"score": 0.5}, 400, "id"),
    ):
        r = http.post("/v1/feedback", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param or param in r.json()["error"]["message"], r.text


def test_split_needs_the_admin_token_and_ends(
    endpoint: Endpoint, pair: dict[str, str], http: httpx.Client
) -> None:
    body = {"canary": "pol@canary", "control": "pol", "share": 0.5}
    assert http.put("/v1/mint/canary/pol", json=body).status_code == 401
    admin = {"Authorization": f"Bearer {endpoint.admin_token}"}
    for bad, param in (({**body, "share": 1.0}, "share"), ({**body, "canary": "pol"}, "canary")):
        r = http.put("/v1/mint/canary/pol", json=bad, headers=admin)
        assert r.status_code == 400 and param in r.text, r.text
    assert http.put("/v1/mint/canary/pol", json=body, headers=admin).status_code == 200
    assert http.delete("/v1/mint/canary/pol", headers=admin).status_code == 200
    assert http.delete("/v1/mint/canary/pol", headers=admin).status_code == 404
    r = ask(http, "user-1")
    assert "x-mint-arm" not in r.headers and r.json()["model"] == "pol"
