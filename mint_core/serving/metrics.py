"""Prometheus metrics of one server: requests, tokens, latency histograms, slots and cold loads."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from mint_core.engine.engine import Engine
from mint_core.engine.loader import AdapterManager
from mint_core.serving.loop import EngineLoop

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _WorkingSetCollector(Collector):
    def __init__(self, engine: Engine, loop: EngineLoop, adapters: AdapterManager):
        self.engine, self.loop, self.adapters = engine, loop, adapters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        ws = self.engine.working_set
        st = ws.stats
        for name, value, doc in (
            ("mint_lora_slot_hits", st.hits, "Requests whose adapter was already in a device slot"),
            ("mint_lora_slot_misses", st.misses, "Requests whose adapter had to be written into a slot"),
            ("mint_lora_evictions", st.evictions, "Adapters evicted from a device slot"),
            (
                "mint_lora_cold_loads",
                st.cold_loads,
                "Adapters read back from storage after leaving host memory",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if self.adapters.catalog is not None:  # on-demand loads happen only with a catalog
            ls = self.adapters.stats
            counters: tuple[tuple[str, float, str], ...] = (
                ("mint_catalog_requests", ls.requests, "Catalog addresses asked of the loader"),
                ("mint_catalog_hits", ls.hits, "Catalog addresses already loaded when asked"),
                (
                    "mint_catalog_cold_loads",
                    ls.cold_loads,
                    "Catalog addresses loaded on demand or by prefetch",
                ),
                ("mint_catalog_load_failures", ls.failures, "Catalog loads that failed"),
                ("mint_catalog_prefetches", ls.prefetches, "Addresses asked for by prefetch"),
                ("mint_catalog_cold_load_seconds", sum(ls.cold_load_s), "Time spent in cold loads"),
            )
            for cname, cvalue, cdoc in counters:
                yield CounterMetricFamily(cname, cdoc, value=cvalue)
        running, waiting = self.loop.queue_depth()
        for name, value, doc in (
            ("mint_lora_slots_in_use", ws.slots_in_use(), "Device slots holding an adapter"),
            ("mint_lora_slots_total", ws.lora.num_slots, "Device slots"),
            ("mint_lora_host_cached", ws.host_size(), "Adapter revisions in host memory"),
            ("mint_lora_adapters_loaded", len(ws.names()), "Adapter names served"),
            ("mint_requests_running", running, "Sequences in the running batch"),
            ("mint_requests_waiting", waiting, "Sequences waiting for admission"),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, engine: Engine, loop: EngineLoop, adapters: AdapterManager):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mint_requests", "Completion requests by model and outcome", ["model", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("mint_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("mint_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "mint_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "mint_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(
            "mint_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY, registry=r
        )
        r.register(_WorkingSetCollector(engine, loop, adapters))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
