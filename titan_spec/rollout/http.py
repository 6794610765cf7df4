"""One JSON request to a rollout server over HTTP, shared by the SGLang and vLLM clients.

An HTTP error status is an answer (its status and body come back); no answer at all (a
timeout, a refused or dropped connection) is ``NoAnswer``, which each client turns into its
engine's "the server died" error, so the engine restarts the server.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

__all__ = ["NoAnswer", "request_json"]


class NoAnswer(Exception):
    """The server gave no answer (the message says what happened)."""


def request_json(url: str, endpoint: str, payload: dict | None, method: str, timeout: float) -> tuple[int, bytes]:
    """``payload`` as JSON to ``url/endpoint`` (None: no body) -> (HTTP status, raw body)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        f"{url}/{endpoint}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except TimeoutError:
        raise NoAnswer(f"no answer to /{endpoint} within {timeout:g}s") from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        raise NoAnswer(f"/{endpoint} failed: {getattr(e, 'reason', e)}") from None
