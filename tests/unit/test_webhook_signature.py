"""The signature of MLflow's webhook deliveries, as the receiver checks it: MLflow's own signer is the reference."""

from __future__ import annotations

import pytest
from mlflow.webhooks.delivery import _generate_hmac_signature

from mint_core.registry.webhooks import BadSignature, sign, verify

SECRET = "s3cret"
BODY = b'{"entity": "model_version_alias", "action": "created", "data": {"name": "add", "alias": "champion"}}'
NOW = 1_800_000_000.0


def test_sign_matches_mlflow_s_signer() -> None:
    assert sign(SECRET, "d1", "1800000000", BODY) == _generate_hmac_signature(
        SECRET, "d1", "1800000000", BODY.decode()
    )


def test_a_good_delivery_passes() -> None:
    verify(SECRET, sign(SECRET, "d1", str(int(NOW)), BODY), "d1", str(int(NOW)), BODY, now=NOW)
    # several signatures (a rotated secret): one matching is enough
    both = f"v1,AAAA {sign(SECRET, 'd1', str(int(NOW)), BODY)}"
    verify(SECRET, both, "d1", str(int(NOW)), BODY, now=NOW)


GOOD = {
    "signature": sign(SECRET, "d1", str(int(NOW)), BODY),
    "delivery": "d1",
    "ts": str(int(NOW)),
    "body": BODY,
}


@pytest.mark.parametrize(
    ("case", "change", "expected"),
    [
        ("no signature", {"signature": None}, "missing"),
        ("no delivery id", {"delivery": None}, "missing"),
        ("no timestamp", {"ts": None}, "missing"),
        ("another secret", {"signature": sign("other", "d1", str(int(NOW)), BODY)}, "does not match"),
        ("another delivery id", {"delivery": "d2"}, "does not match"),
        ("body changed", {"body": BODY.replace(b"add", b"sort")}, "does not match"),
        ("another scheme", {"signature": "v2," + GOOD["signature"][3:]}, "does not match"),  # type: ignore[index]
        ("ten minutes old", {"ts": str(int(NOW) - 600)}, "from now"),
        ("ten minutes ahead", {"ts": str(int(NOW) + 600)}, "from now"),
        ("not a number", {"ts": "now"}, "not a Unix time"),
    ],
)
def test_bad_deliveries_are_refused(case: str, change: dict[str, object], expected: str) -> None:
    args = {**GOOD, **change}
    with pytest.raises(BadSignature, match=expected):
        verify(SECRET, args["signature"], args["delivery"], args["ts"], args["body"], now=NOW)  # type: ignore[arg-type]
