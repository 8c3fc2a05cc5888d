"""Two network namespaces joined by one cable (a veth pair) shaped to a link's rate: a network
between a shard and its client on one machine, for the link case (:mod:`bench.link`).

    with LinkPair("10gbit") as pair:             # needs root, iproute2's ip and tc
        pair.popen("server", [...])              # runs in the server's namespace
        pair.address("server")                   # 10.214.0.1; the client is 10.214.0.2

Each end's interface sends through a token bucket (``tc qdisc ... tbf rate RATE burst 4mb
latency 10ms``), so both directions are held to the rate; on loopback 100 MB move in the time
memory takes to copy them, on a 10 Gbit/s link in about 85 ms.

Nothing is made in the machine's own namespace: the cable is created between the two new ones.
Their names carry this process's pid and a random token (``psbench<pid>-<token>-server``),
so runs never collide. They are removed (with every process still in them) by :meth:`close`,
and also when this process dies without closing them, even by SIGKILL: a guard process
(``python -m bench.netns --guard``, in a session of its own) waits for this one to exit and
removes them then. A pair whose guard was killed too is swept by the next run
(:func:`sweep_stale`: namespaces of this prefix whose pid is gone).

Not thread-safe; every call blocks until ``ip``/``tc`` are done.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["PREFIX", "LinkPair", "sweep_stale", "unavailable"]

PREFIX = "psbench"
#: Addresses of the two ends; they exist only inside the pair's namespaces.
_ADDRESSES = {"server": "10.214.0.1", "client": "10.214.0.2"}
_DEVICE = "link0"
#: How often the guard looks whether its owner is still there (seconds).
_GUARD_POLL = 0.2


def unavailable() -> str | None:
    """``None`` if a pair can be made here, else why not (a sentence for the report)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root for a network namespace"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` command (and root) for a network namespace"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(ns: str) -> None:
    """Kill every process in namespace ``ns``, then delete it (its end of the cable goes with
    it, and the other end with that)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for word in done.stdout.split():
        try:
            os.kill(int(word), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _listed() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.split()]


def sweep_stale() -> list[str]:
    """Remove the pairs whose creating process is gone; return the namespaces removed."""
    removed = []
    for name in _listed():
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            _remove(name)
            removed.append(name)
    return removed


class LinkPair:
    """The two ends, ``"server"`` and ``"client"``, of a cable shaped to ``rate`` (tc's
    syntax: ``10gbit``). Made on construction (raises RuntimeError saying which command
    failed, having removed what it made); :meth:`close` removes it, and is safe to call
    twice."""

    def __init__(self, rate: str) -> None:
        self.rate = rate
        base = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-"
        self.namespaces = {end: base + end for end in _ADDRESSES}
        self._made: list[str] = []
        self._guard: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        try:
            sweep_stale()
            for ns in self.namespaces.values():
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            self._guard = subprocess.Popen(
                [sys.executable, "-m", "bench.netns", "--guard", str(os.getpid()), *self._made],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
            server, client = self.namespaces["server"], self.namespaces["client"]
            _run(
                "ip",
                "-n",
                server,
                "link",
                "add",
                _DEVICE,
                "type",
                "veth",
                "peer",
                "name",
                _DEVICE,
                "netns",
                client,
            )
            for end, ns in self.namespaces.items():
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "addr", "add", f"{_ADDRESSES[end]}/30", "dev", _DEVICE)
                _run("ip", "-n", ns, "link", "set", _DEVICE, "up")
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    _DEVICE,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "4mb",
                    "latency",
                    "10ms",
                )
        except BaseException:
            self.close()
            raise

    def address(self, end: str) -> str:
        """The IPv4 address of ``end`` (``"server"`` or ``"client"``)."""
        return _ADDRESSES[end]

    def command(self, end: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run in ``end``'s namespace (``ip netns exec`` execs it: the pid is
        the program's own)."""
        return ["ip", "netns", "exec", self.namespaces[end], *argv]

    def close(self) -> None:
        """Kill every process in the namespaces and remove them; stop the guard."""
        for ns in reversed(self._made):
            _remove(ns)
        self._made.clear()
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.terminate()
            try:
                guard.wait(10)
            except subprocess.TimeoutExpired:
                guard.kill()
                guard.wait()

    def __enter__(self) -> LinkPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _guard(owner: int, namespaces: list[str]) -> None:
    """Wait until process ``owner`` is gone or this guard is told to stop (SIGTERM: its owner
    closed the pair itself), then remove whichever of ``namespaces`` still exist."""
    stop = False

    def stopped(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the bench is the owner's
    while not stop and _alive(owner):
        time.sleep(_GUARD_POLL)
    if stop:
        return
    listed = set(_listed())
    for ns in namespaces:
        if ns in listed:
            _remove(ns)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.netns", description=__doc__.splitlines()[0])
    p.add_argument("--guard", type=int, required=True, help="the pid whose exit removes them")
    p.add_argument("namespaces", nargs="+")
    args = p.parse_args(argv)
    _guard(args.guard, args.namespaces)


if __name__ == "__main__":
    main()
