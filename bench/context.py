"""What a case gets to run with: the run's settings and lazily started shared processes."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import processes
from .peers.driver import Peer, start_peers

__all__ = ["Context"]


@dataclass
class Context:
    """Settings of one ``python -m bench`` run plus the processes cases share.

    ``sizes`` is ``None`` unless ``--sizes`` was given (a case then uses its ``DEFAULT_SIZES``).
    ``reps``/``min_reps`` feed :func:`bench.timing.reps_for`. ``peer_names`` are the peers
    asked for with ``--peers`` (empty: none). ``seconds`` is how long one timed phase of a
    load case runs, ``rounds`` how often each is repeated. ``quick`` is ``--quick``: a case whose
    content has a scale (how many variables a shard holds, how many workers or shards) runs a
    smaller one. Processes are started on first use and stopped by :meth:`close`. Not
    thread-safe: call it from the main thread.
    """

    sizes: tuple[int, ...] | None
    reps: int
    min_reps: int
    warmup: int
    peer_names: tuple[str, ...] = ()
    seconds: float = 1.5
    rounds: int = 2
    quick: bool = False
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="paramshard-bench-")))
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)
    _fleets: dict[int, processes.Fleet] = field(default_factory=dict, repr=False)
    _raw: processes.RawServer | None = field(default=None, repr=False)
    _tls: tuple[processes.Fleet, str] | None = field(default=None, repr=False)
    _peers: list[Peer] | None = field(default=None, repr=False)

    def sizes_for(self, defaults: tuple[int, ...]) -> tuple[int, ...]:
        return self.sizes if self.sizes is not None else defaults

    def fleet(self, n: int = 1) -> processes.Fleet:
        """A fleet of ``n`` shards (URLs and pids), started once per run and shared by the
        cases (use unique variable names). Blocks until the shards are healthy."""
        if n not in self._fleets:
            d = self.logdir / f"fleet{n}"
            d.mkdir(exist_ok=True)
            # --log-level warning: no per-request logging inside the timed path
            self._fleets[n] = self._stack.enter_context(
                processes.shards(n, d, "--log-level", "warning")
            )
        return self._fleets[n]

    def tls_fleet(self) -> tuple[processes.Fleet, str]:
        """One shard serving https with a certificate made for this run, and the path of the
        CA file that verifies it. Started once per run, like :meth:`fleet`."""
        if self._tls is None:
            import trustme

            d = self.logdir / "fleet-tls"
            d.mkdir(exist_ok=True)
            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1", "localhost")
            ca.cert_pem.write_to_path(str(d / "ca.pem"))
            cert.private_key_pem.write_to_path(str(d / "key.pem"))
            cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
            args = ("--tls-cert", str(d / "cert.pem"), "--tls-key", str(d / "key.pem"))
            fleet = self._stack.enter_context(
                processes.shards(1, d, "--log-level", "warning", *args)
            )
            self._tls = (fleet, str(d / "ca.pem"))
        return self._tls

    def shard_urls(self, n: int = 1) -> list[str]:
        """URLs of :meth:`fleet` ``(n)``."""
        return self.fleet(n).urls

    def raw(self) -> processes.RawServer:
        """The raw-socket reference server (:mod:`bench.rawsock`): address and pid."""
        if self._raw is None:
            self._raw = self._stack.enter_context(processes.raw_server(self.logdir))
        return self._raw

    def raw_address(self) -> tuple[str, int]:
        """``(host, port)`` of :meth:`raw`."""
        raw = self.raw()
        return raw.host, raw.port

    def peers(self) -> list[Peer]:
        """The peers asked for, each a driver process with its server(s) up, in the order
        given; all start at once on first use. Empty without ``--peers``."""
        if self._peers is None:
            self._peers = self._stack.enter_context(start_peers(self.peer_names, self.logdir))
        return self._peers

    def close(self, keep_logs: bool = False) -> None:
        """Stop the processes; remove their logs unless ``keep_logs`` (say, after a failure)."""
        self._stack.close()
        if not keep_logs:
            shutil.rmtree(self.logdir, ignore_errors=True)
