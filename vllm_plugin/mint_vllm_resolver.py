"""mint's LoRA resolver for vLLM: a model name vLLM has not loaded is looked up in mint's catalog.

vLLM asks its registered `LoRAResolver`s about a `model` it does not know before it answers 404. This one asks
mint's serving front (the gateway vLLM sits behind) over loopback: `POST <MINT_RESOLVER_URL>/v1/mint/resolve
{"address": <name>}` with the resolver token. The front resolves the address in the catalog (a policy name is its
champion, `policy@alias`, `policy/vN`, `sha256:<hex>`), validates the revision with mint's own checks (finite,
shapes, rank, base fingerprint) and answers with the directory of the verified revision in the adapter store. Only
then does vLLM load it. Anything else (unknown address, bad adapter, mint unreachable) resolves to nothing, so vLLM
answers 404 and loads nothing: the plugin fails closed.

It imports nothing of mint (vLLM's environment has its own transformers and fastapi pins): the contract between
the two is that one HTTP call. Enabled when vLLM is started with MINT_RESOLVER_URL (and MINT_RESOLVER_TOKEN) in
its environment; `mint up --serving vllm` sets both.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.request

from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

logger = logging.getLogger(__name__)
NAME = "mint_catalog"
TIMEOUT_S = 60.0  # a cold revision is read from the blob store and validated before the answer


class MintCatalogResolver(LoRAResolver):
    """Resolves names through mint's `/v1/mint/resolve`; None (vLLM: 404) for anything mint does not vouch for."""

    def __init__(self, url: str, token: str, timeout_s: float = TIMEOUT_S):
        self.url = url.rstrip("/") + "/v1/mint/resolve"
        self.token = token
        self.timeout_s = timeout_s

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        # urllib blocks: off vLLM's event loop, which keeps serving other requests meanwhile
        found = await asyncio.to_thread(self._ask, base_model_name, lora_name)
        if found is None:
            return None
        # vLLM replaces lora_int_id with its own counter before it loads the adapter
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=found["lora_path"])

    def _ask(self, base_model_name: str, lora_name: str) -> dict[str, str] | None:
        body = json.dumps({"address": lora_name, "base": base_model_name}).encode()
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                found = json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 404:
                logger.warning("mint resolver: %s for %r: %s", e.code, lora_name, e.read()[:300])
            return None
        except (OSError, ValueError) as e:
            logger.warning(
                "mint resolver: %s unreachable or answered badly for %r: %s", self.url, lora_name, e
            )
            return None
        if not isinstance(found, dict) or not isinstance(found.get("lora_path"), str):
            logger.warning("mint resolver: no lora_path in the answer for %r: %r", lora_name, found)
            return None
        logger.info("mint resolver: %r -> %s", lora_name, found.get("digest"))
        return found


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point (it may run once per process: registering again replaces)."""
    url = os.environ.get("MINT_RESOLVER_URL")
    if not url:
        return
    token = os.environ.get("MINT_RESOLVER_TOKEN", "")
    if NAME not in LoRAResolverRegistry.get_supported_resolvers():
        LoRAResolverRegistry.register_resolver(NAME, MintCatalogResolver(url, token))
