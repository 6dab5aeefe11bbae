"""Hostile input against a real server of the default pair on a free loopback port: a 5 MB valid body whose prompt is
far past the context window, a 50 MB body, a lone UTF-16 surrogate. Prints and writes (JSON) each answer's status,
error code and seconds, and the process's resident memory before, after and at its peak.

    .venv/bin/python experiments/hostile_input.py runs/hostile_input.json
"""

from __future__ import annotations

import json
import sys
import time

import httpx

from kvhandoff.files import atomic_write_json
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.family import load_family
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.serving.loadtest import current_rss, peak_rss


def post(url: str, body: bytes) -> dict:
    start = time.perf_counter()
    response = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=600)
    error = response.json().get("error", {})
    return {"status": response.status_code, "code": error.get("code"), "param": error.get("param"),
            "seconds": round(time.perf_counter() - start, 3), "body_bytes": len(body)}


def main(out: str) -> None:
    models, mappers = load_family(progress=True)
    model = next(iter(models))
    engine = Engine(models, mappers, ServeConfig(log_level="warning"))
    results = {"rss_before_bytes": current_rss()}
    with serve_in_thread(engine) as server:
        for megabytes in (5, 50):
            text = "word " * (megabytes * 1024 * 1024 // 5)
            body = json.dumps({"model": model, "prompt": text, "max_tokens": 1}).encode()
            results[f"body_{megabytes}mb"] = post(server.url, body)
        results["lone_surrogate"] = post(server.url, b'{"model": "%s", "prompt": "a\\ud800b"}' % model.encode())
        results["rss_after_bytes"] = current_rss()
    results["peak_rss_bytes"] = peak_rss()
    atomic_write_json(out, results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    main(sys.argv[1])
