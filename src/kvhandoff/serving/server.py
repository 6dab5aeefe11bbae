"""Running the server: `run_server` (blocking, what `kvhandoff serve` calls) and `serve_in_thread` (a server on a
background thread, for tests and notebooks)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from kvhandoff.serving.app import create_app
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.settings import ServeConfig

logger = logging.getLogger(__name__)


def run_server(models, mappers, config: ServeConfig = ServeConfig()) -> None:  # noqa: B008 - frozen
    """Serve ``models`` (name → (model, tokenizer)) with ``mappers`` ((from, to) → Mapper, every ordered pair) on
    ``config.host``:``config.port`` until interrupted; SIGTERM or SIGINT drains first (`DrainingServer`)."""
    engine = Engine(models, mappers, config)
    try:
        uvicorn_config = uvicorn.Config(create_app(engine), host=config.host, port=config.port,
                                        log_level=config.log_level)
        DrainingServer(uvicorn_config, engine).run()
    finally:
        engine.close()


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains at its first SIGTERM or SIGINT: new requests get 503 (``/health`` too, so a
    balancer stops sending), running ones go on for up to ``config.drain_timeout_s`` seconds and are then ended
    with an error event, and the process exits. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if self.engine.draining:
            super().handle_exit(sig, frame)
            return
        self.engine.draining = True
        logger.info("draining: %d running request(s), new ones refused (503)", self.engine.running())
        threading.Thread(target=self._drain, name="kvhandoff-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.engine.config.drain_timeout_s
        while self.engine.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.engine.running():
            logger.warning("drain timeout: ending %d running request(s) with an error", self.engine.running())
            self.engine.abort_running()
            time.sleep(0.2)  # the error events go out before the connections close
        self.should_exit = True


class RunningServer:
    """A uvicorn server on a background thread; `url` is its base URL; `close()` stops it (and the engine)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 timeout: float = 30.0) -> None:
        self.engine = engine
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections only of a socket that says it is TCP (with
        # proto 0, Nagle's algorithm held an answer's body back until the client's delayed ACK: ~40 ms a request
        # on a reused connection)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        config = uvicorn.Config(create_app(engine), log_level=log_level, lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="kvhandoff-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def close(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()
        self.engine.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_in_thread(engine: Engine, host: str = "127.0.0.1", port: int = 0,
                    log_level: str = "warning") -> RunningServer:
    """Serve ``engine`` on a background thread (port 0: a free port); returns the `RunningServer` (a context
    manager)."""
    return RunningServer(engine, host, port, log_level)
