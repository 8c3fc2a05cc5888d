"""``paramshard serve``: one shard in the foreground, on uvicorn, until SIGTERM or SIGINT.

:func:`serve` binds the shard's port, reports it (``--port-file``: how a launcher learns the
port a shard given port 0 was handed, :mod:`server.launcher`), and runs the app under
:class:`DrainingServer`, uvicorn's server that also turns the shard's gate to ``draining`` when
the signal comes: ``/readyz`` answers 503 and new data-plane requests are refused while those
in flight finish, then a shard with a data dir writes its final snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import uvicorn

from .config import ShardConfig

__all__ = ["DrainingServer", "serve", "write_port_file"]


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also turns the shard's gate to ``draining`` on SIGTERM or
    SIGINT, so ``/readyz`` says 503 and new data-plane requests are refused while the requests
    in flight finish."""

    def __init__(self, config: uvicorn.Config, gate: Any) -> None:
        super().__init__(config)
        self.gate = gate

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if self.gate.phase in ("ready", "restoring"):
            self.gate.set_phase("draining", "shutting down")


def write_port_file(path: str, port: int) -> None:
    """Write ``port`` and a newline to ``path`` at once (a reader never sees half of it)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{port}\n")
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def serve(config: ShardConfig) -> int:
    """Run one shard with uvicorn until SIGTERM/SIGINT; blocks; returns 0 after a clean stop.

    Uses uvloop when installed, and the HTTP path :func:`server.upstream.serving` chooses
    (``config.http``). Port 0 binds a port the system picks; with ``config.port_file`` the
    port bound is written there before the app starts. Returns 1 if the shard cannot start
    (e.g. its port is taken) or its final snapshot could not be written.
    """
    from .app import create_app
    from .logs import configure as configure_logs
    from .readguard import EdgeLimits
    from .store.heap import keep_big_buffers
    from .upstream import serving

    keep_big_buffers()
    limits = EdgeLimits(
        max_head_bytes=config.max_head_bytes,
        head_timeout=config.head_timeout,
        body_timeout=config.body_timeout,
        min_body_rate=config.min_body_rate,
    )

    level = config.log_level.upper()
    configure_logs(
        logging.DEBUG if level == "TRACE" else getattr(logging, level),
        config.log_format,
        config.fleet,
    )
    app = create_app(config)
    served = serving(app, limits, config.http)
    uv_config = uvicorn.Config(
        served.app,
        host=config.host,
        port=config.port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http=served.protocol,
        h11_max_incomplete_event_size=limits.max_head_bytes,  # the head bound, on h11
        log_level=config.log_level,
        # In JSON, uvicorn's own lines go through the shard's handler (every line parses).
        **({"log_config": None} if config.log_format == "json" else {}),
        access_log=config.access_log,
        server_header=False,
        proxy_headers=False,  # X-Forwarded-* would only rename the client in logs; per-request work
        timeout_graceful_shutdown=10,
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
    )
    server = DrainingServer(uv_config, app.state.gate)
    app.state.durability.on_fatal = lambda reason: setattr(server, "should_exit", True)

    def stop(signum: int, frame: Any) -> None:
        # Before uvicorn installs its handlers (startup) and after it restores these ones: uvicorn
        # re-raises the signal that stopped it, which must not turn a clean stop into a kill.
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        # Bound here rather than by uvicorn's startup, so that the port is known (and reported)
        # even when it was 0; uvicorn serves the socket it is given.
        sock = uv_config.bind_socket()  # logs the address; exits with 1 when it cannot bind
        if config.port_file is not None:
            try:
                write_port_file(config.port_file, sock.getsockname()[1])
            except OSError as exc:
                sock.close()
                print(
                    f"paramshard serve: error: shard {config.fleet} could not write its port "
                    f"to --port-file {config.port_file}: {exc}",
                    file=sys.stderr,
                )
                return 1
        host, port = sock.getsockname()[:2]
        logging.getLogger("paramshard.server").info(
            "shard %s serving on %s://%s:%d (http %s, auth %s, data dir %s)",
            config.fleet,
            config.scheme,
            host,
            port,
            served.mode,
            app.state.auth.mode,
            "yes" if config.data_dir else "none",
            extra={"event": "start", "outcome": "serving"},
        )
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits with 1 or 3 when it cannot start (e.g. port taken)
        if exc.code in (None, 0):
            return 0
        print(
            f"paramshard serve: error: shard {config.fleet} could not start on "
            f"{config.host}:{config.port} (see the log above)",
            file=sys.stderr,
        )
        return 1
    failure = app.state.durability.failed or app.state.shutdown_error
    if failure:
        print(f"paramshard serve: error: shard {config.fleet}: {failure}", file=sys.stderr)
        return 1
    return 0
