"""A local stand-in for the Hugging Face hub's HTTP API (the endpoints `huggingface_hub.snapshot_download` calls:
revision info, tree listing, HEAD + GET of `resolve/<sha>/<file>`), so the chart's `hf` init container command
runs end to end with the real `huggingface_hub` and no network. Records every request with its Authorization."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeHub:
    repo: str
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, authorization)

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool) -> None:
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("authorization")))
                api, res = f"/api/models/{hub.repo}", f"/{hub.repo}/resolve/{hub.sha}/"
                if path.startswith(api + "/revision/"):
                    info = {"id": hub.repo, "sha": hub.sha, "siblings": [{"rfilename": f} for f in hub.files]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                if path.startswith(api + "/tree/"):
                    tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in hub.files.items()]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                if path.startswith(res) and path[len(res):] in hub.files:
                    b = hub.files[path[len(res):]]
                    return self._send(200, b, {"X-Repo-Commit": hub.sha,
                                               "ETag": f'"{hashlib.sha1(b).hexdigest()}"'}, head)
                return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
