"""Prometheus metrics of one server: requests, tokens, latency histograms, slots and cold loads.

mint's own metrics are named `mint_*`. What mint measures is also exposed under vLLM's names, types, labels and
bucket boundaries (`vllm:*`, as vLLM's PrometheusStatLogger in vllm/v1/metrics/loggers.py defines them), so a
dashboard or a gateway built for a vLLM deployment reads `mint serve` unchanged. Those carry vLLM's labels
`model_name` (the served base's name) and `engine` ("0": one engine per server); `vllm:lora_requests_info`
carries only its own three, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from mint_core.engine.engine import Engine
from mint_core.engine.loader import AdapterManager
from mint_core.engine.sequence import Sequence
from mint_core.serving.loop import EngineLoop

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so its dashboards' quantiles mean the same here
VLLM_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
VLLM_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
VLLM_E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
VLLM_LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's engine index: a mint server runs one engine
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, as its `finished_reason` label


class _WorkingSetCollector(Collector):
    """The gauges and counters read at scrape time, from the working set, the loader and the engine loop."""

    def __init__(self, engine: Engine, loop: EngineLoop, adapters: AdapterManager, model_name: str):
        self.engine, self.loop, self.adapters, self.model_name = engine, loop, adapters, model_name

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
        running, waiting = self.loop.in_flight()
        for name, value, doc in (
            ("mint_lora_slots_in_use", ws.slots_in_use(), "Device slots holding an adapter"),
            ("mint_lora_slots_total", ws.lora.num_slots, "Device slots"),
            ("mint_lora_host_cached", ws.host_size(), "Adapter revisions in host memory"),
            ("mint_lora_adapters_loaded", len(ws.names()), "Adapter names served"),
            ("mint_requests_running", len(running), "Sequences in the running batch"),
            ("mint_requests_waiting", len(waiting), "Sequences waiting for admission"),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self._vllm(running, waiting)

    def _vllm(self, running: list[Sequence], waiting: list[Sequence]) -> Iterator[GaugeMetricFamily]:
        for name, value, doc in (
            ("vllm:num_requests_running", len(running), "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", len(waiting), "Number of requests waiting to be processed."),
        ):
            g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            g.add_metric([self.model_name, ENGINE], value)
            yield g
        # vLLM sets this gauge to the time of its latest update, labelled with the adapters of the requests
        # running and waiting then; read at scrape time, the latest update is now. One series, not one per
        # combination of adapters ever seen: a reader takes the series with the largest value either way.
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        )
        info.add_metric(
            [str(self.engine.config.max_loras), _adapters(waiting), _adapters(running)], time.time()
        )
        yield info


def _adapters(seqs: list[Sequence]) -> str:
    """The adapter names of these sequences, each once, comma-separated (the bare base is none)."""
    return ",".join(sorted({s.request.adapter for s in seqs if s.request.adapter is not None}))


class Metrics:
    """The server's registry. Callers record through the methods below, which keep mint's metric and vLLM's
    of the same measurement in step."""

    def __init__(self, engine: Engine, loop: EngineLoop, adapters: AdapterManager, model_name: str):
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

        # vLLM's names; each is labelled once here, so every series exists (at 0) from the first scrape
        labels = (model_name, ENGINE)
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", VLLM_LABELS, registry=r
        ).labels(*labels)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", VLLM_LABELS, registry=r
        ).labels(*labels)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*VLLM_LABELS, "finished_reason"],
            registry=r,
        )
        self.vllm_success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_LABELS,
            buckets=VLLM_TTFT_BUCKETS,
            registry=r,
        ).labels(*labels)
        self.vllm_itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_LABELS,
            buckets=VLLM_ITL_BUCKETS,
            registry=r,
        ).labels(*labels)
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_LABELS,
            buckets=VLLM_E2E_BUCKETS,
            registry=r,
        ).labels(*labels)
        r.register(_WorkingSetCollector(engine, loop, adapters, model_name))

    # -- recording (the engine loop's thread for the per-token ones, the event loop's for the rest) ---------

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm_itl.observe(seconds)

    def sequence_finished(self, seconds: float, reason: str | None) -> None:
        """One sequence (a choice of a request) ended, `seconds` after it was submitted."""
        self.e2e.observe(seconds)
        self.vllm_e2e.observe(seconds)
        if reason in self.vllm_success:
            self.vllm_success[reason].inc()

    def answered(self, model: str, outcome: str, prompt_tokens: int, generation_tokens: int) -> None:
        """A completion request answered in full (`outcome` "200", or the status its stream ended with); the
        tokens are those its usage reports."""
        self.requests.labels(model=model, outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.vllm_prompt_tokens.inc(prompt_tokens)
        self.vllm_generation_tokens.inc(generation_tokens)

    def refused(self, model: str, status: int) -> None:
        """A completion request answered with an error status; `model` is already a name the server serves or
        "_unknown" (a client must not be able to mint label values)."""
        self.requests.labels(model=model, outcome=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
