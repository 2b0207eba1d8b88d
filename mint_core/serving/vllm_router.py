"""How mint starts `vllm-router` before a fleet of vLLM replicas: the command line, from one typed config.

The router is vLLM's own (vllm-project/router, the `vllm-router` wheel, pinned in scripts/bootstrap_vllm.sh and
installed into vLLM's environment). It stands between mint's front and the replicas, on loopback:

    public port -> mint's front (auth, validation, revision identity, canary) -> vllm-router -> N sealed replicas

It sees only requests the front has already authenticated and validated, and it passes them on with their
headers: the `Authorization` header that carries mint's routed key (which a replica's seal accepts for inference
only; loads go from the front to each replica with the full key, serving/fleet.py), and
`x-session-id`, which the front sets to the served name so that the `consistent_hash` policy keeps one adapter's
requests on one replica. It health-checks the replicas with a bare `GET /health` (a replica opens exactly that
route, `VLLMConfig.replica`), stops sending to one that fails, and retries elsewhere.

The router's own routes (`/add_worker`, `/remove_worker`, `/list_workers`) take no key: anyone on the host who can
reach its port can add a worker, which would then receive the front's requests and the routed key with them. It
listens on loopback only, as the replicas do; the front's `GET /v1/mint/replicas` (and so `mint status`) compares
the router's worker list with the replicas it was given and names any other worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

DEFAULT_ROUTER = Path(".venv-vllm/bin/vllm-router")
# the header vllm-router's consistent_hash policy keys on first (before the request's text)
SESSION_HEADER = "x-session-id"

RoutingPolicy = Literal["consistent_hash", "cache_aware", "power_of_two", "round_robin", "random"]


class RouterConfig(BaseModel):
    """One `vllm-router` before the replicas of one fleet."""

    program: Path = DEFAULT_ROUTER
    """The `vllm-router` console script in vLLM's environment."""
    host: str = "127.0.0.1"
    """Loopback: only mint's front talks to the router."""
    port: int = Field(8099, ge=1, le=65535)
    replicas: list[str] = Field(min_length=1)
    """The replicas' base URLs (`http://127.0.0.1:8100`, ...)."""
    policy: RoutingPolicy = "consistent_hash"
    """How a request picks its replica. `consistent_hash` (the default): on the served name (the front sends it
    as `x-session-id`), so one adapter's requests go to one replica, which holds it in its working set: a cold
    load happens once per adapter, not once per replica, and the adapter takes one replica's slot, not N.
    `cache_aware` routes on the prompt's prefix (a radix tree per replica) and falls back to the least loaded
    replica past its balance thresholds; it does not know the adapter, so one policy's requests spread over
    replicas when their prompts differ. The price of `consistent_hash` is balance: a hot adapter loads one
    replica while another idles. (docs/serving.md says what a measurement should compare.)"""
    prometheus_port: int = Field(8098, ge=1, le=65535)
    """The router's own Prometheus endpoint (it always opens one: 29000 unless told)."""
    health_check_interval_s: int = Field(5, ge=1)
    """Seconds between the router's health checks of each replica (its default is 60)."""
    startup_timeout_s: int = Field(600, ge=1)
    """How long the router waits for its replicas to answer /health before it gives up and exits."""
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    """`info` logs a line per routed request."""

    def command(self) -> list[str]:
        cmd = [str(self.program), "--host", self.host, "--port", str(self.port)]
        cmd += ["--worker-urls", *self.replicas, "--policy", self.policy]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port)]
        cmd += ["--worker-startup-check-interval", "1"]
        cmd += ["--worker-startup-timeout-secs", str(self.startup_timeout_s)]
        cmd += ["--health-check-interval-secs", str(self.health_check_interval_s)]
        return [*cmd, "--log-level", self.log_level]

    def env(self) -> dict[str, str]:
        """The environment it needs: its Rust log filter (`--log-level` leaves the consistent_hash policy logging
        three INFO lines per request; RUST_LOG silences them, checked with 0.1.17)."""
        return {"RUST_LOG": "warn" if self.log_level == "warning" else self.log_level}
