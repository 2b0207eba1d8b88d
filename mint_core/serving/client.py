"""One client for any server that speaks the serving contract: mint's embedded server or a vLLM deployment."""

from __future__ import annotations

from typing import Any

import httpx

from mint_core.errors import MintError

DIRECT_HEADER = "X-Mint-Route"
"""With the value `direct`, a request is answered by the name it asks for, past any canary split."""


class ServingError(MintError):
    """A non-2xx answer from a serving endpoint, with its status, error type and message."""

    def __init__(self, status: int, type: str, message: str, url: str):
        self.status, self.type, self.message, self.url = status, type, message, url
        super().__init__(f"{url}: {status} {type}: {message}")


class ServingClient:
    """Admin and inference calls against `base_url` (e.g. http://127.0.0.1:8000): admin ones with `admin_token`,
    the rest with `api_key` (a serving key), or the admin token when none is given (mint's own components)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        admin_token: str | None = None,
        timeout: float = 120.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.admin_token = admin_token
        # idle connections are dropped before the servers' own 5 s keep-alive (uvicorn's, vLLM's) ends, so a
        # request is never sent on a connection the server is closing at that moment
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, limits=httpx.Limits(keepalive_expiry=2.0)
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _headers(self, admin: bool) -> dict[str, str]:
        # inference without a key of its own goes with the admin token: mint's components call every policy
        token = self.admin_token if admin else (self.api_key or self.admin_token)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _call(self, method: str, path: str, admin: bool = False, **kw: Any) -> httpx.Response:
        try:
            headers = {**self._headers(admin), **(kw.pop("headers", None) or {})}
            r = self._http.request(method, path, headers=headers, **kw)
        except httpx.HTTPError as e:
            raise ServingError(0, "ConnectionError", str(e) or type(e).__name__, self.base_url + path) from e
        if r.status_code >= 400:
            try:
                err = r.json().get("error", {})
                typ, msg = (
                    (err.get("type", "Error"), err.get("message", r.text))
                    if isinstance(err, dict)
                    else ("Error", str(err))
                )
            except ValueError:
                typ, msg = "Error", r.text
            raise ServingError(r.status_code, typ, msg, self.base_url + path)
        return r

    # ---- admin ----------------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str, inplace: bool = False) -> str:
        """POST /v1/load_lora_adapter; with `inplace`, swap the revision under an existing name."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        return self._call("POST", "/v1/load_lora_adapter", admin=True, json=body).text

    def unload_adapter(self, name: str) -> str:
        return self._call("POST", "/v1/unload_lora_adapter", admin=True, json={"lora_name": name}).text

    def put_canary(self, name: str, canary: str, control: str, share: float) -> dict[str, Any]:
        """PUT /v1/mint/canary/{name}: `share` of `name`'s request keys answered by `canary`, the rest by
        `control` (serving/canary.py). Repeating it changes nothing."""
        body = {"canary": canary, "control": control, "share": share}
        return dict(self._call("PUT", f"/v1/mint/canary/{name}", admin=True, json=body).json())

    def clear_canary(self, name: str) -> bool:
        """DELETE /v1/mint/canary/{name}; False when there was no split."""
        try:
            self._call("DELETE", f"/v1/mint/canary/{name}", admin=True)
        except ServingError as e:
            if e.status == 404:
                return False
            raise
        return True

    def canary(self, name: str, after: int = 0) -> dict[str, Any]:
        """GET /v1/mint/canary/{name}: the split, counts per arm, and score events after `after`."""
        return dict(self._call("GET", f"/v1/mint/canary/{name}", params={"after": after}).json())

    def feedback(self, response_id: str, score: float) -> dict[str, Any]:
        """POST /v1/feedback: score an answer in [0, 1] by its response id."""
        body = {"id": response_id, "score": score}
        return dict(self._call("POST", "/v1/feedback", json=body).json())

    # ---- inference and state ----------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/models").json()["data"])

    def complete(self, model: str, prompt: str, direct: bool = False, **params: Any) -> dict[str, Any]:
        """POST /v1/completions. `direct`: answered by what `model` names itself, past any canary split of it
        (a smoke check of the name)."""
        body = {"model": model, "prompt": prompt, **params}
        headers = {DIRECT_HEADER: "direct"} if direct else None
        return dict(self._call("POST", "/v1/completions", json=body, headers=headers).json())

    def ask(
        self, model: str, prompt: str | list[dict[str, str]], direct: bool = False, **params: Any
    ) -> tuple[str, str | None]:
        """A task row's prompt, asked as it is held: text to /v1/completions, chat messages to
        /v1/chat/completions (`direct` as in `complete`). Returns the answer's text and the revision that gave it
        (system_fingerprint)."""
        if isinstance(prompt, str):
            out = self.complete(model, prompt, direct=direct, **params)
            text = out["choices"][0]["text"]
        else:
            body = {"model": model, "messages": prompt, **params}
            headers = {DIRECT_HEADER: "direct"} if direct else None
            out = dict(self._call("POST", "/v1/chat/completions", json=body, headers=headers).json())
            text = out["choices"][0]["message"]["content"]
        fp = out.get("system_fingerprint")
        return str(text or ""), (str(fp) if fp else None)

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
