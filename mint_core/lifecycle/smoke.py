"""The served smoke check: the revision a server holds under a name, and one greedy answer that must come from
the revision it was just given."""

from __future__ import annotations

import logging
import time

from mint_core.data.generators import Prompt
from mint_core.data.spec import SpecError
from mint_core.data.spec import registry as task_registry
from mint_core.lifecycle.errors import LifecycleError
from mint_core.serving.client import ServingClient, ServingError

logger = logging.getLogger(__name__)


class SmokeCheckFailed(LifecycleError):
    """The server does not answer with the revision it was just given under the policy's name."""


def served_revision(client: ServingClient, name: str) -> str | None:
    """The revision (`sha256:<hex>`) the server holds under `name`, or None when it holds none."""
    card = next((m for m in client.models() if m.get("id") == name), None)
    return None if card is None else card.get("revision")


SMOKE_FALLBACK = "Hello"
"""What a smoke check asks a revision no registered task made (a Tinker client's saved weights): any answer
from the right revision will do."""


def smoke_prompt(task: str | None) -> Prompt:
    """What a smoke check asks a revision of `task` (its `mint.task` tag): the task's first held-out row, as its
    callers ask it (text, or chat messages); `SMOKE_FALLBACK` for no task or one not registered here."""
    reg = task_registry()
    if task is None or task not in reg:
        return SMOKE_FALLBACK
    try:
        return reg.get(task).heldout_rows()[0].prompt
    except SpecError as e:
        logger.info("smoke check of a %s revision asks %r: %s", task, SMOKE_FALLBACK, e)
        return SMOKE_FALLBACK


def smoke_check(client: ServingClient, name: str, digest: str, prompt: Prompt = SMOKE_FALLBACK) -> float:
    """One greedy answer to `prompt` (`smoke_prompt`: a held-out prompt of the revision's own task) under `name`;
    it must be answered by revision `digest`. Returns its latency in s."""
    want = f"sha256:{digest}"
    listed = served_revision(client, name)
    if listed != want:
        raise SmokeCheckFailed(f"{client.base_url} lists {name!r} as {listed}, expected {want}")
    t0 = time.perf_counter()
    try:
        _, fingerprint = client.ask(name, prompt, direct=True, max_tokens=4, temperature=0.0)
    except ServingError as e:
        raise SmokeCheckFailed(f"{client.base_url}: a completion under {name!r} failed: {e}") from e
    got = str(fingerprint)
    if got.removeprefix("sha256:") != digest:  # mint serve names the revision by its bare hex digest
        raise SmokeCheckFailed(f"{client.base_url} answered {name!r} with revision {got}, expected {want}")
    return time.perf_counter() - t0
