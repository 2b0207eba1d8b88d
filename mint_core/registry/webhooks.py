"""MLflow's webhook for alias events, pointed at mint's receiver (`mint_app.services.webhooks`), and its signature.

MLflow (SQL store only) posts `model_version_alias.created` / `.deleted` to a webhook's URL, signed the Standard
Webhooks way: `X-MLflow-Signature: v1,<base64 HMAC-SHA256 of "{delivery_id}.{timestamp}.{payload}">` with the
`X-MLflow-Delivery-Id` and `X-MLflow-Timestamp` headers (mlflow/webhooks/delivery.py). The server must allow http
and private addresses for a receiver on the same machine (`MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https`,
`MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true`), and keep one `MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY` across restarts and
workers (it encrypts the stored secret); `mint up` sets all three.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from mint_core.registry.reader import RegistryError

ALIAS_EVENTS = ("model_version_alias.created", "model_version_alias.deleted")
WEBHOOK_NAME = "mint-serving"
"""One webhook of this name per MLflow server: `ensure_alias_webhook` updates it in place."""
SIGNATURE_HEADER = "X-MLflow-Signature"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"


class BadSignature(RegistryError):
    """A webhook delivery whose signature is missing, malformed, wrong or too old."""


def ensure_alias_webhook(tracking_uri: str, url: str, secret: str, name: str = WEBHOOK_NAME) -> str:
    """Make MLflow post alias events to `url`, signed with `secret`: create the webhook `name`, or bring an
    existing one up to date (url, secret, events, active). Idempotent; returns the webhook id."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    events: list[str] = list(ALIAS_EVENTS)
    try:
        found, token = None, None
        while found is None:
            page = client.list_webhooks(max_results=100, page_token=token)
            found = next((w for w in page if w.name == name), None)
            token = page.token
            if not token:
                break
        if found is None:
            hook = client.create_webhook(
                name,
                url,
                events,  # type: ignore[arg-type]  # MLflow's Literal of event strings
                description="mint: serving follows the champion aliases (mint_app.services.webhooks)",
                secret=secret,
            )
        else:
            hook = client.update_webhook(
                found.webhook_id,
                url=url,
                events=events,  # type: ignore[arg-type]
                secret=secret,
                status="ACTIVE",
            )
    except MlflowException as e:
        raise RegistryError(
            f"could not register MLflow's alias webhook at {tracking_uri}: {e.message}"
        ) from e
    return str(hook.webhook_id)


def sign(secret: str, delivery_id: str, timestamp: str, payload: bytes) -> str:
    """The `X-MLflow-Signature` value MLflow sends for this delivery."""
    content = f"{delivery_id}.{timestamp}.".encode() + payload
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(
    secret: str,
    signature: str | None,
    delivery_id: str | None,
    timestamp: str | None,
    payload: bytes,
    max_age_s: float = 300.0,
    now: float | None = None,
) -> None:
    """Check a delivery's signature (constant-time) and that its timestamp is within `max_age_s` of now (a
    replayed old delivery is refused); `BadSignature` saying which check failed."""
    if not signature or not delivery_id or not timestamp:
        raise BadSignature(f"missing {SIGNATURE_HEADER}, {DELIVERY_ID_HEADER} or {TIMESTAMP_HEADER}")
    try:
        sent = int(timestamp)
    except ValueError:
        raise BadSignature(f"{TIMESTAMP_HEADER} is not a Unix time: {timestamp[:40]!r}") from None
    age = (time.time() if now is None else now) - sent
    if abs(age) > max_age_s:
        raise BadSignature(f"timestamp {sent} is {age:+.0f} s from now (at most {max_age_s:.0f} s allowed)")
    want = sign(secret, delivery_id, timestamp, payload)
    # a header may carry several space-separated signatures (secret rotation); any one matching is enough
    if not any(hmac.compare_digest(want.encode(), s.encode()) for s in signature.split()):
        raise BadSignature("signature does not match")
