"""ServeConfig, a server on a background thread, and `run_server` in a process of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from _serving_support import tiny_family
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def test_serve_config_validates_every_field_by_name():
    config = ServeConfig()
    switch = config.switch
    assert switch.guard and (switch.guard_signal, switch.guard_threshold, switch.guard_window) == (None, None, None)
    assert config.max_context is None and config.host == "127.0.0.1"
    for field, bad in (("port", -1), ("max_sessions", 0), ("session_ttl_s", 0), ("cache_memory_bytes", 0),
                       ("max_context", 1), ("default_max_tokens", 0), ("max_queue", 0), ("handover", "lazy"),
                       ("log_level", "loud"), ("host", ""), ("max_body_bytes", 0), ("admission_wait_s", -1),
                       ("drain_timeout_s", 0), ("read_timeout_s", 0), ("open_probes", "yes"), ("api_key", ""),
                       ("api_key", ("a", "")), ("api_key", ()),
                       ("switch", {"guard": False})):
        with pytest.raises(ConfigError, match=field):
            ServeConfig(**{field: bad})
    for field, bad in (("guard", "on"), ("guard_signal", "vibes"), ("guard_threshold", "high"),
                       ("guard_threshold", float("nan")), ("guard_window", 0), ("exact_prefix", -1),
                       ("recompute", "sinks:300%")):
        with pytest.raises(ConfigError, match=field):
            SwitchSettings(**{field: bad})


def test_serve_config_takes_one_api_key_or_several_and_never_writes_them():
    assert ServeConfig(api_key="k").api_key == ("k",)
    config = ServeConfig(api_key=["k1", "k2"])
    assert config.api_key == ("k1", "k2") and config.to_dict()["api_key"] == "2 set"
    assert ServeConfig(admission_wait_s=0).admission_wait_s == 0


def test_server_in_a_thread_starts_on_a_free_port_and_stops():
    family, mappers = tiny_family()
    engine = Engine(family, mappers, ServeConfig(max_context=64))
    assert engine.max_context == 64
    with serve_in_thread(engine) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def server_process(tmp_path, setup: str = "", **settings):
    """`run_server` of the tiny family in a process of its own on a free port (``setup``: code run on ``models``
    before it serves; ``settings``: ServeConfig fields); yields (process, url) once /health answers; killed after
    if still running."""
    port = free_port()
    script = tmp_path / "serve.py"
    config = ", ".join(f"{name}={value!r}" for name, value in {"port": port, "log_level": "warning",
                                                                  **settings}.items())
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from _serving_support import tiny_family
        from kvhandoff.serving.settings import ServeConfig
        from kvhandoff.serving.server import run_server
        models, mappers = tiny_family()
    """) + textwrap.dedent(setup) + f"run_server(models, mappers, ServeConfig({config}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # bounded: up to 60 s for torch to import and the server to start
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read().decode()[-2000:]
                time.sleep(0.1)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_run_server_serves_until_interrupted(tmp_path):
    with server_process(tmp_path) as (process, url):
        assert httpx.get(url + "/health").json()["status"] == "ok"
        body = {"model": "small", "prompt": "abc", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


SLOW_SMALL_MODEL = """
model = models["small"][0]
forward = model.forward


def slow(*args, **kwargs):  # a decode step long enough to act while the stream runs
    time.sleep(0.02)
    return forward(*args, **kwargs)


model.forward = slow
"""


def test_sigterm_drains_running_streams_refuses_new_requests_and_exits(tmp_path):
    with server_process(tmp_path, SLOW_SMALL_MODEL, drain_timeout_s=60) as (process, url):
        body = {"model": "small", "prompt": "abc", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")  # running
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)  # it finished
        assert process.wait(30) == 0


def test_abort_running_ends_a_stream_with_an_error_event():
    family, mappers = tiny_family()
    engine = Engine(family, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
    with serve_in_thread(engine) as server:
        body = {"model": "small", "prompt": "abc", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line)
            engine.abort_running()
            rest = [line for line in lines if line]
        assert '"shutting_down"' in rest[-2] and rest[-1] == "data: [DONE]"


def test_a_server_in_a_thread_answers_a_reused_connection_without_nagle_delays():
    """Its connections have TCP_NODELAY (asyncio sets it only on a socket that says it is TCP): an answer written
    in two pieces (head, body) is not held back until the client's delayed ACK, which put a 40 ms floor under every
    request on a reused connection."""
    family, mappers = tiny_family()
    engine = Engine(family, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
    with serve_in_thread(engine) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        waits = []
        for _ in range(12):
            asked = time.perf_counter()
            assert http.get("/health").status_code == 200
            waits.append(time.perf_counter() - asked)
    assert min(waits[1:]) < 0.03, waits  # with Nagle's algorithm: every one ≥ 0.04 s
