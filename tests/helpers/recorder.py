"""A transport for driving the shard's HTTP protocol in this process and reading what it wrote."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Recorder"]


class Recorder(asyncio.Transport):
    """A transport that records each write call: ("write", bytes) or ("writelines", pieces).

    What else an HTTP protocol asks of its transport is answered as for an open loopback
    connection."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []
        self.protocol = None
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def set_protocol(self, protocol) -> None:  # a websocket upgrade hands the connection on
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def set_write_buffer_limits(self, high=None, low=None) -> None:  # websockets' legacy
        pass  # protocol (uvicorn before 0.50) sets them when the connection is handed to it

    def write(self, data) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, pieces) -> None:
        self.calls.append(("writelines", [bytes(memoryview(p).cast("B")) for p in pieces]))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def sent(self, since: int = 0) -> bytes:
        """The bytes written, from write call ``since`` on."""
        return b"".join(d if kind == "write" else b"".join(d) for kind, d in self.calls[since:])
