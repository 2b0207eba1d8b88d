"""Catalog addresses cold-loaded ahead of need, through mint's extension route of the server."""

from __future__ import annotations

from typing import Any

import httpx

from mint_core.serving.client import ServingClient, ServingError


def prefetch_route(client: ServingClient) -> bool:
    """Whether the server has mint's `POST /v1/mint/prefetch` (and a catalog behind it)."""
    try:
        r = httpx.get(client.base_url + "/openapi.json", timeout=5)
        return r.status_code == 200 and "/v1/mint/prefetch" in r.json().get("paths", {})
    except (httpx.HTTPError, ValueError):
        return False


def prefetch(client: ServingClient, addresses: list[str], wait: bool = True) -> dict[str, Any]:
    """Ask the server to cold-load catalog addresses ahead of need (mint's extension route)."""
    headers = {"Authorization": f"Bearer {client.admin_token}"} if client.admin_token else {}
    r = httpx.post(
        client.base_url + "/v1/mint/prefetch",
        json={"addresses": addresses, "wait": wait},
        headers=headers,
        timeout=300,
    )
    if r.status_code >= 400:
        raise ServingError(
            r.status_code, "PrefetchError", r.text[:500], client.base_url + "/v1/mint/prefetch"
        )
    return dict(r.json())
