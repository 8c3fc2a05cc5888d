"""server.whole_heads: which heads of a whole small request are read without the parser.
Every head it does not take goes to the parser (tests/shard/test_immediate.py checks that the
answers are the same either way)."""

from __future__ import annotations

import pytest

from server.whole_heads import whole_request

PATHS = {b"/v1/pull": None}
BODY = b"\x81\xa5names\x91\xa1a"
HEAD = (
    b"POST /v1/pull HTTP/1.1\r\nhost: 127.0.0.1:8000\r\nx-paramshard-fleet: 0/1\r\n"
    b"accept: application/x-paramshard-frame, application/msgpack\r\n"
    b"authorization: Bearer a: b\r\ncontent-type: application/msgpack\r\n"
)


def whole(head: bytes = HEAD, body: bytes = BODY, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return head + b"content-length: %d\r\n\r\n" % size + body


def test_a_head_as_the_sdk_writes_it_is_read():
    path, headers, body = whole_request(whole(), PATHS, 65536)
    assert path == b"/v1/pull" and body == BODY
    assert headers[b"authorization"] == b"Bearer a: b"  # split at the first ": " only
    assert headers[b"content-length"] == b"%d" % len(BODY)
    assert headers[b"accept"].endswith(b", application/msgpack")


@pytest.mark.parametrize(
    "data",
    [
        whole(length=len(BODY) + 1),  # a body still to come
        whole() + b"POST",  # the start of another request after it
        whole(HEAD.replace(b"/v1/pull", b"/v1/pull?x=1")),
        whole(HEAD.replace(b"/v1/pull", b"/v1/push")),
        whole(HEAD.replace(b"POST", b"PUT ")),
        whole(HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")),
        whole(HEAD.replace(b"host:", b"Host:")),
        whole(HEAD.replace(b"host:", b"host :")),
        whole(HEAD.replace(b"host: ", b"host:")),
        whole(HEAD.replace(b"host: ", b"host:  ")),
        whole(HEAD.replace(b"host: ", b"host: \t")),
        whole(HEAD.replace(b"8000\r\n", b"8000 \r\n")),
        whole(HEAD.replace(b"8000\r\n", b"8000\r\n continued\r\n")),  # obsolete folding
        whole(HEAD.replace(b"8000\r\n", b"8000\nx-a: b\r\n")),  # a bare LF
        whole(HEAD.replace(b"8000\r\n", b"80\r00\r\n")),  # a bare CR
        whole(HEAD.replace(b"8000", b"80\x0000")),
        whole(HEAD.replace(b"8000", b"80\xe900")),
        whole(HEAD.replace(b"host: ", b"ho(st: ")),
        whole(HEAD + b"x-empty:\r\n"),
        whole(HEAD + b": no name\r\n"),
        whole(HEAD + b"host: again\r\n"),
        whole(HEAD + b"transfer-encoding: chunked\r\n"),
        whole(HEAD + b"expect: 100-continue\r\n"),
        whole(HEAD + b"connection: close\r\n"),
        whole(HEAD + b"upgrade: websocket\r\n"),
        whole(HEAD + b"content-length: %d\r\n" % len(BODY)),  # twice
        HEAD + b"content-length: +5\r\n\r\n12345",
        HEAD + b"\r\n" + BODY,  # no content-length
        b"POST /v1/pull HTTP/1.1\r\n\r\n",
    ],
)
def test_any_other_head_is_left_to_the_parser(data):
    assert whole_request(data, PATHS, 65536) is None


def test_a_head_above_the_bound_is_left_to_the_parser():
    data = whole()
    head = data.index(b"\r\n\r\n") + 4
    assert whole_request(data, PATHS, head) is not None
    assert whole_request(data, PATHS, head - 1) is None


def test_a_connection_reads_its_repeated_head_as_whole_request_reads_it(monkeypatch):
    """KeptHeads gives what whole_request gives, for every head of the list above after a
    head it kept, and splits a head it kept only once."""
    from server import whole_heads

    heads = whole_heads.KeptHeads()
    first = heads.read(whole(), PATHS, 65536)
    assert first == whole_request(whole(), PATHS, 65536)
    splits = []
    real = whole_heads.whole_request
    monkeypatch.setattr(whole_heads, "whole_request", lambda *args: splits.append(1) or real(*args))
    again = heads.read(whole(), PATHS, 65536)
    assert again == first and again[1] is not first[1] and not splits  # not split again
    again[1][b"host"] = b"changed"  # the caller's to change: the kept head is not
    assert heads.read(whole(), PATHS, 65536) == first
    assert heads.read(whole()[:-1], PATHS, 65536) is None  # the same head, a body too short
    assert heads.read(whole() + b"POST", PATHS, 65536) is None  # another request after it
    assert not splits
    for data in test_any_other_head_is_left_to_the_parser.pytestmark[0].args[1]:
        assert heads.read(whole(), PATHS, 65536) == first
        assert heads.read(data, PATHS, 65536) is None
    other = whole(HEAD.replace(b"8000", b"8001"), b"abc")
    assert heads.read(other, PATHS, 65536) == whole_request(other, PATHS, 65536) is not None
    assert heads.read(whole(), PATHS, 65536) == first  # the new head is kept instead


def test_a_head_is_kept_for_each_path(monkeypatch):
    """A client taking turns between verbs on one connection finds each verb's head kept."""
    from server import whole_heads

    paths = {b"/v1/pull": None, b"/v1/push": None}
    pull, push = whole(), whole(HEAD.replace(b"/v1/pull", b"/v1/push"), b"xyz")
    heads = whole_heads.KeptHeads()
    read = [heads.read(pull, paths, 65536), heads.read(push, paths, 65536)]
    assert read == [whole_request(pull, paths, 65536), whole_request(push, paths, 65536)]
    assert read[1][0] == b"/v1/push"
    splits = []
    real = whole_heads.whole_request
    monkeypatch.setattr(whole_heads, "whole_request", lambda *args: splits.append(1) or real(*args))
    for _ in range(3):
        assert [heads.read(pull, paths, 65536), heads.read(push, paths, 65536)] == read
    assert not splits


def test_a_long_head_is_not_kept():
    from server import whole_heads

    long = whole(HEAD + b"x-long: %s\r\n" % (b"a" * whole_heads.KEPT_HEAD))
    heads = whole_heads.KeptHeads()
    assert heads.read(long, PATHS, 65536) == whole_request(long, PATHS, 65536) is not None
    assert not heads._kept


def test_a_head_with_the_start_of_its_body_is_read_when_asked():
    """With ``started``, a read may hold the head and only the start of the body (never more
    than the body); a connection's kept head is read the same way."""
    from server import whole_heads

    data = whole()
    for cut in (len(data) - len(BODY), len(data) - 1, len(data)):
        path, headers, body = whole_request(data[:cut], PATHS, 65536, started=True)
        assert path == b"/v1/pull" and body == data[len(data) - len(BODY) : cut]
        assert headers == whole_request(data, PATHS, 65536)[1]
    assert whole_request(data[:-1], PATHS, 65536) is None  # not asked: the body must be whole
    assert whole_request(data + b"P", PATHS, 65536, started=True) is None
    assert whole_request(whole(length=len(BODY) - 1), PATHS, 65536, started=True) is None
    heads = whole_heads.KeptHeads()
    assert heads.read(data[:-3], PATHS, 65536, started=True) == (
        whole_request(data[:-3], PATHS, 65536, started=True)
    )
    assert heads._kept  # kept with its Content-Length, not the bytes of the body it read
    assert heads.read(data, PATHS, 65536)[2] == BODY
    assert heads.read(data[:-3], PATHS, 65536, started=True)[2] == BODY[:-3]
    assert heads.read(data[:-3], PATHS, 65536) is None
    assert heads.read(data + b"P", PATHS, 65536, started=True) is None
