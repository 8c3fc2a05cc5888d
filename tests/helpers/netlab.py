"""A private network of test hosts on one machine, for tests of what crosses a network.

Every host is a network namespace of its own with one interface, ``eth0``, cabled (a veth pair)
to a bridge that lives in one more namespace, the switch. Host names resolve through
``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts`` for the
processes it starts, so a worker can be given ``http://ps0:7100`` as under Docker Compose.

Nothing is created in the machine's own network namespace: the bridge, the cables and the
addresses exist only inside namespaces this module made, and no route leads out of them. Names
carry the creating process's pid (``psnet<pid>-<host>``), so concurrent runs do not collide and a
run killed before it could clean up is swept by the next one (:func:`sweep_stale`).

Needs root and iproute2. :meth:`Netlab.close` removes everything (processes, namespaces, hosts
files) and is safe to call more than once, after any failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Netlab", "available", "sweep_stale"]

PREFIX = "psnet"
NETNS_ETC = Path("/etc/netns")
#: The lab's subnet; it exists only inside the lab's namespaces.
SUBNET = "10.213.0"

_FETCH = (
    "import os, sys, urllib.request\n"
    "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
    "req = urllib.request.Request(sys.argv[1])\n"
    "token = os.environ.get('PARAMSHARD_TOKEN')\n"
    "if token: req.add_header('Authorization', 'Bearer ' + token)\n"
    "sys.stdout.write(opener.open(req, timeout=float(sys.argv[2])).read().decode())\n"
)


def available() -> str | None:
    """``None`` if a lab can be built here, else the reason it cannot."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for word in done.stdout.split():
        try:
            os.kill(int(word), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass


def _remove_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove the namespaces of labs whose creating process is gone; return their names."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            _remove_namespace(name)
            removed.append(name)
    return removed


class Netlab:
    """Hosts on a private switch. Not thread-safe; every call blocks until ``ip`` is done."""

    def __init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.switch = self.prefix + "switch"
        self.hosts: dict[str, str] = {}  # host name -> address
        self.procs: list[subprocess.Popen] = []
        #: The bearer token :meth:`fetch` sends, if any.
        self.token: str | None = None
        self._namespaces: list[str] = []
        self._made_netns_etc = not NETNS_ETC.exists()
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return self.prefix + host

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_hosts(self, *names: str) -> None:
        """Plug in hosts ``names`` with the next free addresses, and (re)write every host's
        hosts file so that all of them resolve each other's names."""
        for name in names:
            if name in self.hosts:
                raise ValueError(f"host {name} exists")
            address = f"{SUBNET}.{10 + len(self.hosts)}"
            ns = self.namespace(name)
            self._add_namespace(ns)
            port = self._port(name)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self.hosts[name] = address
        table = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.hosts.items())
        for name in self.hosts:
            etc = NETNS_ETC / self.namespace(name)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(table)

    def _port(self, host: str) -> str:
        return f"p-{host}"[:15]  # the switch's side of the host's cable

    def cut(self, host: str) -> None:
        """Unplug ``host``'s cable at the switch: its packets go nowhere, both ways."""
        _ip("-n", self.switch, "link", "set", self._port(host), "down")

    def plug(self, host: str) -> None:
        """Plug ``host``'s cable back in."""
        _ip("-n", self.switch, "link", "set", self._port(host), "up")

    def start(
        self, host: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (``ip netns exec`` execs it: the pid is the program's).
        Output goes to ``log``; the process is killed by :meth:`close` if still running."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace(host), *argv],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def python(
        self,
        host: str,
        code: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess:
        """Run ``python -c code args...`` on ``host`` and wait for it."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(host), sys.executable, "-c", code, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def fetch(self, host: str, url: str, timeout: float = 2.0) -> str | None:
        """GET ``url`` from ``host`` (with :attr:`token` as a bearer token, if set); the body,
        or ``None`` if there was no answer."""
        env = None if self.token is None else {**os.environ, "PARAMSHARD_TOKEN": self.token}
        done = self.python(host, _FETCH, url, str(timeout), env=env, timeout=timeout + 30)
        return done.stdout if done.returncode == 0 else None

    def fetch_json(self, host: str, url: str, timeout: float = 2.0) -> dict | None:
        body = self.fetch(host, url, timeout)
        return None if body is None else json.loads(body)

    def wait_for(
        self, host: str, url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None
    ) -> dict:
        """Poll ``url`` from ``host`` until it answers with JSON; raise if ``proc`` dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
            answer = self.fetch_json(host, url, timeout=1.0)
            if answer is not None:
                return answer
            time.sleep(0.1)
        raise TimeoutError(f"{url} did not answer {host} within {timeout}s")

    def leftovers(self) -> list[str]:
        """This lab's namespaces and hosts files that still exist (after :meth:`close`: none)."""
        done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        names = [ln.split()[0] for ln in done.stdout.splitlines() if ln.split()]
        files = [p.name for p in NETNS_ETC.glob(self.prefix + "*")] if NETNS_ETC.exists() else []
        return sorted({n for n in names if n.startswith(self.prefix)} | set(files))

    def close(self) -> None:
        """Kill every process started here, delete every namespace and hosts file."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._namespaces):
            _remove_namespace(ns)
        self._namespaces.clear()
        if self._made_netns_etc:
            try:
                NETNS_ETC.rmdir()  # only if empty: another lab may be using it
            except OSError:
                pass


@contextlib.contextmanager
def opened(what: str) -> Iterator[Netlab]:
    """A new :class:`Netlab` (labs a killed run left behind swept first), closed after the
    ``with`` block, which then fails if anything of it is left (``what`` names the test)."""
    sweep_stale()
    lab = Netlab()
    try:
        yield lab
    finally:
        lab.close()
        left = lab.leftovers()
        assert not left, f"{what} left {left} behind"
