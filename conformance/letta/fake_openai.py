"""OpenAI's model list on 127.0.0.1, so that Letta can create the agents its sandbox tests
use (no completion is ever asked for). Usage: ``python fake_openai.py PORTFILE``; it writes
the port it listens on to PORTFILE and serves until killed."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

MODELS = {
    "object": "list",
    "data": [
        {"id": "gpt-4o-mini", "object": "model", "owned_by": "openai", "context_length": 128000}
    ],
}


class Models(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        listed = self.path.rstrip("/").endswith("/models")
        body = json.dumps(MODELS if listed else {}).encode()
        self.send_response(200 if listed else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    server = HTTPServer(("127.0.0.1", 0), Models)
    with open(sys.argv[1], "w") as fh:
        fh.write(str(server.server_address[1]))
    server.serve_forever()
