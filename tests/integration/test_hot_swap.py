"""Hot swaps under load: in-place loads of a new adapter revision while requests stream against the name.

Every response must be served wholly by one revision (the one its `system_fingerprint` names, with exactly that
revision's greedy text), no request may fail, a request sent after a swap returned must see the new revision,
and the slots, host cache and memory of the server must come back to where they were once the swapping and
the load/unload cycles are over. All traffic goes to the test's own endpoint, in bounded loops.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mint_core.lora.adapter import digest_dir
from mint_core.serving.client import ServingClient
from tests.integration.conftest import Endpoint

pytestmark = pytest.mark.integration

PROMPT = "Hot swap: the adapter under this name changes while we talk."
MAX_TOKENS = 24
GAUGES = ("mint_lora_slots_in_use", "mint_lora_host_cached", "mint_lora_adapters_loaded")


@pytest.fixture(scope="module")
def _one_thread_server() -> Iterator[None]:
    """The embedded server this module starts gets one torch thread: on a small machine the client threads
    share its cores, and torch's OpenMP workers, preempted mid-step, can stall a decode step for seconds."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def endpoint(_one_thread_server: None, endpoint: Endpoint) -> Endpoint:
    """conftest's endpoint, started with the environment above."""
    return endpoint


@pytest.fixture(scope="module")
def ep(endpoint: Endpoint) -> Iterator[Endpoint]:
    """The endpoint, with the embedded server's log drained: a full stdout pipe would stall the server."""
    proc = endpoint.process
    if proc is not None and proc.stdout is not None:
        out = proc.stdout

        def drain() -> None:
            for _ in out:
                pass

        threading.Thread(target=drain, name="drain-server-log", daemon=True).start()
    yield endpoint


def adapter(ep: Endpoint, name: str, seed: int) -> Path:
    """An adapter in the store; one left by an earlier run against the same store is the same bytes."""
    path = ep.store / name
    return path if (path / "adapter_config.json").exists() else ep.make_adapter(name, seed=seed)


@pytest.fixture(scope="module")
def revisions(ep: Endpoint) -> dict[str, Any]:
    """Revisions v1 and v2 of adapter "p" in the store, their digests, and the greedy text of each."""
    paths = {v: adapter(ep, f"hot-swap-p-{v}", seed) for v, seed in (("v1", 11), ("v2", 22))}
    digests = {v: digest_dir(p) for v, p in paths.items()}
    assert digests["v1"] != digests["v2"]
    texts: dict[str, str] = {}
    with ep.client() as c:
        for v in ("v1", "v2"):
            # in place for v1 too: harmless on a fresh server, and a shared one may still have "p"
            c.load_adapter("p", paths[v].name, inplace=True)
            r = c.complete("p", PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            assert r["system_fingerprint"] == digests[v]
            texts[v] = r["choices"][0]["text"]
            again = c.complete("p", PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            assert again["choices"][0]["text"] == texts[v], "greedy decoding is not repeatable"
    assert texts["v1"] != texts["v2"], "the two revisions should answer differently"
    return {"paths": paths, "digests": digests, "texts": texts}


def gauges(ep: Endpoint) -> dict[str, float]:
    """mint's working-set gauges (empty on the vLLM backend, whose working set is vLLM's own)."""
    if ep.backend == "vllm":
        return {}
    text = httpx.get(f"{ep.url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in GAUGES:
            found[parts[0]] = float(parts[1])
    if set(found) != set(GAUGES):
        if os.environ.get("MINT_SERVING_URL"):
            pytest.skip("this endpoint does not export mint's working-set gauges")
        raise AssertionError(f"/metrics lacks {set(GAUGES) - set(found)}")
    return found


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


@dataclass
class Result:
    kind: str
    sent: float  # monotonic, before the request left
    done: float  # monotonic, after the whole answer arrived
    fingerprint: str
    text: str


class Load:
    """Six client threads asking `p` over the three client paths (mint's client, openai, openai streamed) until
    stopped or 40 s have passed; each answer is recorded with when it was sent and done, each failure as a
    finding (the other threads go on)."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results: list[Result] = []
        self.failures: list[str] = []
        self.deadline = time.monotonic() + 40
        self.threads = [threading.Thread(target=self.worker, args=(i,), name=f"load-{i}") for i in range(6)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def ask(self, kind: str, plain: ServingClient, oai: openai.OpenAI) -> tuple[str, str]:
        if kind == "plain":
            r = plain.complete("p", PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            return r["system_fingerprint"], r["choices"][0]["text"]
        if kind == "openai":
            c = oai.completions.create(model="p", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            return str(c.system_fingerprint), c.choices[0].text
        fps, parts = set(), []
        for chunk in oai.completions.create(
            model="p", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        ):
            fps.add(chunk.system_fingerprint)
            parts.extend(c.text for c in chunk.choices)
        assert len(fps) == 1, f"one stream carried several fingerprints: {fps}"
        return str(fps.pop()), "".join(parts)

    def worker(self, i: int) -> None:
        kind = ("plain", "openai-stream", "openai")[i % 3]
        ep = self.ep
        plain = ServingClient(ep.url, api_key=ep.api_key, timeout=60)
        oai = openai.OpenAI(base_url=f"{ep.url}/v1", api_key=ep.api_key or "none", max_retries=0, timeout=60)
        try:
            for _ in range(1000):  # bounded in count and in time
                if self.stop.is_set() or time.monotonic() > self.deadline:
                    return
                sent = time.monotonic()
                try:
                    fp, text = self.ask(kind, plain, oai)
                except Exception as e:  # a failure is a finding; the other threads go on
                    with self.lock:
                        self.failures.append(f"{kind}: {type(e).__name__}: {e}")
                    continue
                with self.lock:
                    self.results.append(Result(kind, sent, time.monotonic(), fp, text))
        finally:
            plain.close()
            oai.close()

    def wait_for_answers(self, after: float, n: int = 3, limit: float = 10.0) -> None:
        """Until `n` requests sent after `after` were answered (or `limit` seconds passed): swaps go at the
        pace of the server, each revision serves whole requests between swaps, and others straddle them."""
        end = min(time.monotonic() + limit, self.deadline)
        while time.monotonic() < end and not self.stop.is_set():
            with self.lock:
                if sum(r.sent > after for r in self.results) >= n or self.failures:
                    return
            time.sleep(0.005)


def test_in_place_swaps_under_load_serve_wholly_old_or_wholly_new(ep: Endpoint, revisions: dict[str, Any]):
    paths, digests, texts = revisions["paths"], revisions["digests"], revisions["texts"]
    by_digest = {d: v for v, d in digests.items()}
    with ep.client() as admin:
        admin.load_adapter("p", paths["v1"].name, inplace=True)

    swaps: list[tuple[float, float, str]] = [(0.0, time.monotonic(), "v1")]  # (sent, returned, revision)
    swap_errors: list[str] = []
    with Load(ep) as load, ep.client() as admin:
        for n in range(20):
            load.wait_for_answers(swaps[-1][1])
            v = "v2" if n % 2 == 0 else "v1"
            sent = time.monotonic()
            try:
                admin.load_adapter("p", paths[v].name, inplace=True)
            except Exception as e:
                swap_errors.append(f"swap {n} to {v}: {e}")
            swaps.append((sent, time.monotonic(), v))
        load.wait_for_answers(swaps[-1][1])
    threads, results, failures = load.threads, load.results, load.failures
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not swap_errors, swap_errors
    assert not failures, f"{len(failures)} requests failed, e.g. {failures[:3]}"
    assert len(results) >= 60, f"only {len(results)} requests completed"
    unknown = {r.fingerprint for r in results} - set(by_digest)
    assert not unknown, f"fingerprints of no known revision: {sorted(unknown)}"
    mixed = [
        (r.kind, by_digest[r.fingerprint], r.text)
        for r in results
        if r.text != texts[by_digest[r.fingerprint]]
    ]
    assert not mixed, f"{len(mixed)}/{len(results)} responses are not the named revision's text: {mixed[:3]}"
    assert {by_digest[r.fingerprint] for r in results} == {"v1", "v2"}
    assert {r.kind for r in results} == {"plain", "openai", "openai-stream"}
    # A request sent after a swap returned, and answered before the next one was sent, saw that revision.
    checked = 0
    for r in results:
        for (_, returned, v), (next_sent, _, _) in zip(
            swaps, [*swaps[1:], (float("inf"), 0.0, "")], strict=True
        ):
            if returned < r.sent and r.done < next_sent:
                assert by_digest[r.fingerprint] == v, (
                    f"a {r.kind} request between swaps was served by the old revision"
                )
                checked += 1
    assert checked >= 20, f"only {checked} requests ran wholly between two swaps"

    # The last swap was to v1 (20 swaps, alternating from v2). One more request holds its slot again; the
    # old revision's slot and host copy are gone once nothing runs on it.
    with ep.client() as c:
        r = c.complete("p", PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert (r["system_fingerprint"], r["choices"][0]["text"]) == (digests["v1"], texts["v1"])
    g = gauges(ep)
    if g:
        assert g["mint_lora_slots_in_use"] == 1, g
        assert g["mint_lora_host_cached"] == 1, g
        assert g["mint_lora_adapters_loaded"] == 1, g


def test_load_unload_cycles_return_to_the_start(ep: Endpoint, revisions: dict[str, Any]):
    for i in range(31):
        adapter(ep, f"hot-swap-tmp{i}", 1000 + i)
    proc = None if os.environ.get("MINT_SERVING_URL") else ep.process

    def cycle(c: ServingClient, i: int) -> None:
        name = f"tmp{i}"
        c.load_adapter(name, f"hot-swap-tmp{i}")
        r = c.complete(name, PROMPT, max_tokens=8, temperature=0)
        assert r["system_fingerprint"] == digest_dir(ep.store / f"hot-swap-tmp{i}")
        c.unload_adapter(name)

    with ep.client() as c:
        for m in c.models():  # what an interrupted earlier run against a shared server left
            if m["id"].startswith("tmp"):
                c.unload_adapter(m["id"])
        cycle(c, 30)  # warm-up: first-time allocations are not growth
        start = gauges(ep)
        rss0 = rss_kb(proc.pid) if proc is not None else 0
        for i in range(30):
            cycle(c, i)
        end = gauges(ep)
        assert end == start, f"working set did not return to its start: {start} -> {end}"
        names = {m["id"] for m in c.models()}
        assert not any(n.startswith("tmp") for n in names), names
    if proc is not None:
        grown = rss_kb(proc.pid) - rss0
        assert grown < 50 * 1024, f"server RSS grew by {grown / 1024:.1f} MB over 30 load/unload cycles"
