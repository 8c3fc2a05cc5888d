"""A transport for driving the shard's HTTP protocol in this process and reading what it wrote."""

from __future__ import annotations

from bench.stepcost import NullTransport

__all__ = ["Recorder"]


class Recorder(NullTransport):
    """A transport that records each write call: ("write", bytes) or ("writelines", pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []
        self.protocol = None

    def set_protocol(self, protocol) -> None:  # a websocket upgrade hands the connection on
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def write(self, data) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, pieces) -> None:
        self.calls.append(("writelines", [bytes(memoryview(p).cast("B")) for p in pieces]))

    def sent(self, since: int = 0) -> bytes:
        """The bytes written, from write call ``since`` on."""
        return b"".join(d if kind == "write" else b"".join(d) for kind, d in self.calls[since:])
