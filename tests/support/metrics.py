"""The admin HTTP endpoint of a running worker (/healthz, /readyz, /metrics), and one
/metrics scrape parsed with prometheus_client's own parser."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def get(port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    """(status, content type, body) of an admin HTTP request."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers["content-type"], response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["content-type"], e.read().decode()


def get_absolute(port: int, path: str) -> tuple[int, bytes]:
    """(status, body) of a GET of 127.0.0.1:``port`` whose request target is in absolute
    form (``GET http://127.0.0.1:port/path``, as a client sends it to a proxy)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", f"http://127.0.0.1:{port}{path}")
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


class Scrape:
    """One /metrics scrape, parsed by prometheus_client."""

    def __init__(self, port: int):
        status, ctype, body = get(port, "/metrics")
        assert status == 200
        assert ctype.startswith("text/plain; version=0.0.4")
        self.families = {f.name: f for f in text_string_to_metric_families(body)}

    def type(self, family: str) -> str:
        return self.families[family].type

    def samples(self, family: str, suffix: str = "", **labels: str) -> list:
        name = family + suffix
        return [
            s
            for s in self.families[family].samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, family: str, suffix: str = "", **labels: str) -> float:
        found = self.samples(family, suffix, **labels)
        assert len(found) == 1, (family, suffix, labels, found)
        return found[0].value

    def total(self, family: str, **labels: str) -> float:
        return self.value(family, "_total", **labels)
