"""Router layer (stdlib): a small blocking client of `pagedkv router serve` (keep-alive HTTP),
used by `pagedkv simulate --router-url` and the load benchmark."""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from pagedkv.credentials import redact
from pagedkv.errors import InvalidArgumentError
from pagedkv.router.index import IndexUnavailableError


class RouterClient:
    """One keep-alive connection to the service. Errors: `InvalidArgumentError` for a request
    the service refused (400) or a bad URL, `IndexUnavailableError` when it cannot answer
    (503, or the connection failed)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise InvalidArgumentError(
                f"router URL must be http://HOST:PORT, got {redact(repr(url))}"
            )
        self.url = redact(url.rstrip("/"))
        """For messages: credentials hidden (the service takes none)."""
        self._host, self._port = parts.hostname, parts.port or 80
        self._timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        for attempt in range(2):  # a keep-alive connection the server closed: retry once
            if self._connection is None:
                self._connection = http.client.HTTPConnection(
                    self._host, self._port, timeout=self._timeout_s
                )
            try:
                self._connection.request(method, path, payload, headers)
                response = self._connection.getresponse()
                raw = response.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt:
                    raise IndexUnavailableError(f"router at {self.url}: {exc}") from exc
        answer = json.loads(raw) if raw else None
        if response.status == 503:
            raise IndexUnavailableError(f"router at {self.url}: {answer}")
        if response.status != 200:
            message = answer.get("error") if isinstance(answer, dict) else answer
            raise InvalidArgumentError(
                f"router at {self.url} answered {response.status}: {message}"
            )
        return answer

    def route(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, float] | None = None,
        *,
        policy: str | None = None,
        sync: Mapping[str, int] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": list(token_ids)}
        if loads is not None:
            body["loads"] = dict(loads)
        if policy is not None:
            body["policy"] = policy
        if sync:
            body["sync"] = dict(sync)
        return self.call("POST", "/route", body)

    def score(self, token_ids: Sequence[int]) -> dict[str, Any]:
        return self.call("POST", "/score", {"token_ids": list(token_ids)})

    def health(self) -> dict[str, Any]:
        return self.call("GET", "/health")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
