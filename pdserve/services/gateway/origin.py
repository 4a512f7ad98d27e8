"""What a web page can make the gateway do (docs/api.md, Browsers).

A page in the user's browser can send requests to a gateway on the user's machine. Two checks keep it out:
* POST bodies must be `application/json` (else 415). A page may POST `text/plain` or a form to any origin without
  asking; a JSON body makes the browser ask first (a CORS preflight), which fails unless `--allowed-origins` names
  the page's origin (then Starlette's CORSMiddleware, app.py).
* DNS rebinding: a page's own host name re-pointed at 127.0.0.1 reaches a loopback gateway as the same origin, so
  no CORS check applies. Its requests still carry that name in `Host`: a gateway on loopback answers only loopback
  names (localhost, 127.0.0.1, [::1], any port) and those of `--allowed-hosts` (else 421). A gateway on another
  address is reached under names it cannot know (a Service, an ingress), so there only `--allowed-hosts` is checked,
  when given.
"""
from __future__ import annotations

import ipaddress

from pdserve.services.gateway.guard import error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON = "application/json"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """`Host` without its port: `localhost:8000` -> localhost, `[::1]:8000` -> ::1."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def allowed_hosts(bind_host: str | None, extra: tuple[str, ...]) -> frozenset[str] | None:
    """The Host names the gateway answers, None for any (`bind_host` None: not listening itself, as in tests)."""
    if "*" in extra or (not extra and (bind_host is None or not is_loopback(bind_host))):
        return None
    return LOOPBACK_NAMES | {host_name(h) for h in extra}


class BrowserGuard:
    def __init__(self, app, hosts: frozenset[str] | None):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                start, body = error_response(*refusal)
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> tuple[int, str, str, str] | None:
        headers = dict(scope["headers"])
        if self.hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.hosts:
                return (421, f"the Host header {host[:100]!r} is not a name this gateway answers to (a loopback "
                             "name, or one of --allowed-hosts)", "invalid_request_error", "invalid_host")
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1")
            if kind.partition(";")[0].strip().lower() != JSON:
                return (415, f"the request body must be {JSON} (Content-Type was {kind[:100]!r})",
                        "invalid_request_error", "unsupported_media_type")
        return None
