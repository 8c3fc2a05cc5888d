"""TLS for the SDK's own connections: the context a client verifies shards with, and the
handshake on a freshly connected socket.

``verify`` (``PSClient(verify=...)``) is ``True`` (the system's trusted CAs), the path of a
CA bundle (PEM) that signed the shards' certificates, or ``False`` (no verification: tests and
trusted networks only). The context is made once per client (:func:`context`) and every
``https://`` connection is wrapped with it, its host name checked (SNI and the certificate's
names). A certificate that does not verify is not a passing network failure: it is raised at
once as :class:`~client_sdk.ConfigError` saying what to pass (:func:`refused`), never retried.

After the handshake the connection is an ``ssl.SSLSocket`` used as the plain one is
(``connection.py``): non-blocking, ``send`` instead of ``sendmsg`` (TLS has no vectored write),
``recv_into`` straight into the reply's buffer, and ``ssl.SSLWantReadError`` /
``SSLWantWriteError`` meaning "not now" like ``BlockingIOError``.
"""

from __future__ import annotations

import socket
import ssl

from .._exceptions import ConfigError

__all__ = ["WANT", "context", "refused", "wrap"]

#: What a non-blocking TLS socket raises for "not now".
WANT = (ssl.SSLWantReadError, ssl.SSLWantWriteError)


def context(verify: bool | str) -> ssl.SSLContext:
    """The client's TLS context for ``verify`` (see the module). Raises :class:`ConfigError`
    for a CA file that cannot be read."""
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if verify is True:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=verify)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"verify={verify!r}: cannot read it as a CA bundle (PEM) ({exc}): pass the "
            "path of the CA certificate that signed the shards' certificates"
        ) from None


def wrap(sock: socket.socket, ctx: ssl.SSLContext, host: str, url: str) -> ssl.SSLSocket:
    """``sock`` (connected, blocking with a timeout) after a TLS handshake with ``host``.
    Raises :class:`ConfigError` for a certificate that does not verify (:func:`refused`), and
    ``ssl.SSLError``/``OSError`` for a handshake the network broke."""
    try:
        return ctx.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        sock.close()
        raise refused(url, exc) from None
    except BaseException:
        sock.close()
        raise


def refused(url: str, exc: ssl.SSLCertVerificationError) -> ConfigError:
    """The error for a shard whose certificate does not verify."""
    return ConfigError(
        f"shard {url}: its TLS certificate does not verify ({exc.verify_message or exc}): "
        "pass verify='/path/to/ca.pem' (the CA that signed the shards' certificates), or "
        "fix the URL's host name to one the certificate names",
        shard=url,
    )
