"""Feeding a reply's body to a pull's ``Sink`` (client_sdk/_into.py) the way a connection does,
without a network: the tests of pulls into the caller's buffers and of widening as bytes arrive
drive it through here."""

from __future__ import annotations

from client_sdk._into import Sink


def drive(sink: Sink, body: bytes, first: int, step: int):
    """``sink.receive`` of ``body`` as a connection would: ``first`` bytes already buffered,
    then at most ``step`` bytes per receive. Returns what the sink returns at the body's end."""
    receiving = sink.receive(memoryview(body)[:first], len(body))
    at = first
    try:
        target = next(receiving)
        while True:
            n = min(len(target), step, len(body) - at)
            assert n > 0, "the sink asked for more than the body has"
            target[:n] = body[at : at + n]
            at += n
            target = receiving.send(n)
    except StopIteration as done:
        assert at == len(body), "the sink stopped before the body's end"
        return done.value
