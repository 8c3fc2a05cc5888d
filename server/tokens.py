"""A shard's bearer tokens as settings: what a token may be, a list of them, a file of them.

Pure parsing, no web stack (``server/config.py`` checks tokens with it when a shard starts;
``server/auth.py`` checks requests). Errors say what is wrong and how to make a good token,
never quoting a token.
"""

from __future__ import annotations

__all__ = ["MAX_TOKEN", "MIN_TOKEN", "check_token", "read_token_file", "split_tokens"]

#: Shortest and longest token a shard accepts.
MIN_TOKEN = 16
MAX_TOKEN = 1024
#: Largest token file read.
MAX_TOKEN_FILE = 64 * 1024
_TOKEN_HINT = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_token(token: str, where: str) -> str:
    """``token`` if a shard may accept it, else ``ValueError`` saying why (``where``: the
    setting it came from, never the token itself)."""
    if not MIN_TOKEN <= len(token) <= MAX_TOKEN:
        raise ValueError(
            f"a token in {where} has {len(token)} characters; a token has "
            f"{MIN_TOKEN}..{MAX_TOKEN}: {_TOKEN_HINT}"
        )
    if not token.isascii() or not token.isprintable() or " " in token or "," in token:
        raise ValueError(
            f"a token in {where} has a character other than printable ASCII (no spaces or "
            f"commas): {_TOKEN_HINT}"
        )
    return token


def split_tokens(text: str, where: str) -> tuple[str, ...]:
    """The tokens of a comma-separated list (``--token old,new``), each checked."""
    tokens = tuple(t.strip() for t in text.split(",") if t.strip())
    if not tokens:
        raise ValueError(f"{where} is empty: give a token, or leave it unset for no auth")
    return tuple(check_token(t, where) for t in tokens)


def read_token_file(path: str) -> tuple[str, ...]:
    """The tokens in a file: one per line (blank lines and ``#`` comments ignored), each
    checked. Raises ``ValueError`` saying what is wrong (never quoting a token)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_FILE:
        raise ValueError(f"the token file {path} is above 64 KiB: it holds one token a line")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(
            f"the token file {path} holds bytes other than ASCII: {_TOKEN_HINT}"
        ) from None
    lines = [line.strip() for line in text.splitlines()]
    tokens = tuple(
        check_token(line, f"the token file {path}")
        for line in lines
        if line and not line.startswith("#")
    )
    if not tokens:
        raise ValueError(f"the token file {path} holds no token: write one a line; {_TOKEN_HINT}")
    return tokens
