"""A stand-in for a chat/paging bridge: prints every alert Alertmanager's webhook posts (compose only).

Listens on $RELAY_ADDRESS (default 0.0.0.0:8080, the URL in deploy/prometheus/alertmanager.yml).
"""

import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Relay(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        for alert in body.get("alerts", []):
            labels, notes = alert.get("labels", {}), alert.get("annotations", {})
            print(f"[{alert.get('status')}] {labels.get('alertname')} {json.dumps(labels, sort_keys=True)}"
                  f" - {notes.get('summary')}", flush=True)
            # The alert's links (`tracejudge alerts render`), one a line, as a chat bridge would show them.
            for link in ("runbook_url", "dashboard_url", "traces_url"):
                if notes.get(link):
                    print(f"    {link}: {notes[link]}", flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    host, _, port = os.environ.get("RELAY_ADDRESS", "0.0.0.0:8080").rpartition(":")
    ThreadingHTTPServer((host, int(port)), Relay).serve_forever()
