"""HTTP-level metrics of the gateway: responses by route and status, requests in flight (an ASGI middleware, the
outermost one, so refusals by the other middlewares count too), and the gateway's metrics exposition."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.routing import BaseRoute, Match

from pdserve.services.metrics import exposition
from pdserve.services.metrics import gateway as M

OTHER = "other"  # any path no route matches: one label value, so a scanner cannot blow up the series count
CLIENT_CLOSED = "499"  # the client left before a response started (nginx's convention)


class HttpMetrics:
    """`pdserve_http_requests_total{endpoint,status}` and `pdserve_http_requests_in_flight{endpoint}`. The endpoint
    is the matched route's path template (`/v1/models/{model_id}`), never the raw path. A streaming response is in
    flight until its last chunk is sent or the client leaves."""

    def __init__(self, app, routes: list[BaseRoute]):
        self.app = app
        self.routes = routes  # the app's live route list: routes added after this middleware still match

    def endpoint(self, scope) -> str:
        for r in self.routes:
            match, _ = r.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path matched, the method did not (405)
                return getattr(r, "path", OTHER)
        return OTHER

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.endpoint(scope)
        status = CLIENT_CLOSED

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        gauge = M.HTTP_IN_FLIGHT.labels(endpoint)
        gauge.inc()
        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            if status == CLIENT_CLOSED:  # Starlette's outer error middleware answers 500
                status = "500"
            raise
        finally:
            gauge.dec()
            M.HTTP_REQUESTS.labels(endpoint, status).inc()


def install(app: FastAPI, model: str, compat: str | None):
    """Add the middleware (outermost); returns the registry /metrics and --metrics-port serve."""
    registry = exposition.exposition(M.GATEWAY, {"model": model}, compat)
    app.add_middleware(HttpMetrics, routes=app.router.routes)
    return registry
