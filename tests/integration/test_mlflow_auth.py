"""MLflow behind mint's auth app, its users and rights from the access file (`mint_app.services.mlflow_auth`):
no login gets 401; a viewer's alias move, and a reviewer's on a policy not theirs, get 403 and change neither the
alias nor serving; a reviewer moves an alias of their policy, serving follows, and `mint registry history` names
them. One stack (MLflow, mint serve, the webhook receiver, as `mint up` starts them) for the module."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from mint_core.registry.catalog import CHAMPION
from mint_testkit.waiting import wait_until
from tests.integration.alias_stack import Stack, add_users, alias_stack

pytestmark = pytest.mark.integration

ALIAS_API = "/api/2.0/mlflow/registered-models/alias"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with alias_stack(tmp_path_factory.mktemp("mlflow-auth")) as s:
        yield s


@pytest.fixture(scope="module")
def passwords(stack: Stack) -> dict[str, str]:
    return add_users(
        stack,
        {
            "vera": ("viewer", []),
            "rita": ("reviewer", [stack.policy]),
            "otto": ("reviewer", ["tenant-b/*", "other"]),
        },
    )


def move(stack: Stack, user: str | None, password: str | None, version: int) -> httpx.Response:
    auth = httpx.BasicAuth(user, password) if user and password else None
    body = {"name": stack.policy, "alias": CHAMPION, "version": str(version)}
    return httpx.post(stack.mlflow + ALIAS_API, json=body, auth=auth, timeout=30)


def champion(stack: Stack) -> int | None:
    return stack.ws.registry().reader.alias_version(stack.policy)


def test_no_login_gets_401_and_a_wrong_password_too(stack: Stack, passwords: dict[str, str]) -> None:
    got = httpx.get(f"{stack.mlflow}/api/2.0/mlflow/registered-models/get", params={"name": stack.policy})
    assert got.status_code == 401
    assert move(stack, None, None, max(stack.digests)).status_code == 401
    assert move(stack, "rita", passwords["rita"] + "x", max(stack.digests)).status_code == 401
    assert champion(stack) == min(stack.digests)


def test_a_viewer_reads_but_cannot_move_an_alias(stack: Stack, passwords: dict[str, str]) -> None:
    before, served = champion(stack), stack.served()
    auth = ("vera", passwords["vera"])
    got = httpx.get(
        f"{stack.mlflow}/api/2.0/mlflow/registered-models/get", params={"name": stack.policy}, auth=auth
    )
    assert got.status_code == 200 and got.json()["registered_model"]["name"] == stack.policy
    refused = move(stack, *auth, version=max(stack.digests))
    assert refused.status_code == 403, refused.text
    assert champion(stack) == before and stack.served() == served


def test_a_reviewer_on_a_policy_not_theirs_gets_403(stack: Stack, passwords: dict[str, str]) -> None:
    before, served = champion(stack), stack.served()
    refused = move(stack, "otto", passwords["otto"], max(stack.digests))
    assert refused.status_code == 403, refused.text
    assert champion(stack) == before and stack.served() == served


def test_a_reviewer_moves_their_policy_serving_follows_history_names_them(
    stack: Stack, passwords: dict[str, str]
) -> None:
    target = max(stack.digests)
    assert champion(stack) != target
    moved = move(stack, "rita", passwords["rita"], target)
    assert moved.status_code == 200, moved.text
    stack.wait_served(target)
    registry = stack.ws.registry()
    last = wait_until(
        lambda: next((m for m in registry.history(stack.policy, CHAMPION) if m.to_version == target), None),
        30,
        "the move in the catalog's history",
    )
    assert last is not None and last.actor == "rita", last


def test_a_model_created_later_is_granted_to_the_reviewers_it_matches(
    stack: Stack, passwords: dict[str, str]
) -> None:
    client = stack.ws.registry().client  # the service account
    client.create_registered_model("other")
    client.create_registered_model("not-otto")
    auth = ("otto", passwords["otto"])
    for name, want in (("other", True), ("not-otto", False)):
        got = httpx.get(
            f"{stack.mlflow}/api/2.0/mlflow/registered-models/get",
            params={"name": name},
            auth=auth,
            timeout=30,
        )
        assert got.status_code == 200  # every login reads
        tag = httpx.post(
            f"{stack.mlflow}/api/2.0/mlflow/registered-models/set-tag",
            json={"name": name, "key": "note", "value": "x"},
            auth=auth,
            timeout=30,
        )
        assert (tag.status_code == 200) is want, (name, tag.status_code, tag.text)
