"""A private certificate authority for TLS tests: a CA and a certificate it signed for the
loopback names (127.0.0.1, localhost), written as PEM files (trustme makes them)."""

from __future__ import annotations

from pathlib import Path

import trustme

__all__ = ["loopback_pki"]


def loopback_pki(d: Path) -> dict[str, str]:
    """Write ``ca.pem``, ``cert.pem`` (the chain) and ``key.pem`` into ``d``; their paths by
    ``ca``, ``cert``, ``key``."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(d / "cert.pem"), append=True)
    return {k: str(d / f"{k}.pem") for k in ("ca", "cert", "key")}
