"""``paramshard demo`` end to end: it trains, prints both accuracies, and leaves nothing running.

The demo is run as users run it, ``python -m server.cli demo``, in a subprocess, and once from
a wheel installed in a fresh virtualenv. Whether its children are gone is checked in ``/proc``
by their command lines (the shards' ports), since they run in their own sessions.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/cmdline").exists(), reason="needs /proc to find leftover processes"
)


def demo_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    env["TMPDIR"] = str(tmp_path)  # where the demo keeps shard logs after a failure
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def demo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", "demo", *args]


def processes_using(ports: list[int]) -> list[str]:
    """Command lines of live processes started for a shard on one of ``ports`` or for a worker
    talking to one."""
    marks = (
        [f"--port\0{p}\0" for p in ports] + [f":{p}," for p in ports] + [f":{p}\0" for p in ports]
    )
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (
            state != "Z"
            and ("server.cli" in cmdline or "digits_worker" in cmdline)
            and any(m in cmdline for m in marks)
        ):
            found.append(cmdline.replace("\0", " "))
    return found


def ports_in(output: str) -> list[int]:
    return sorted(
        {int(p) for p in re.findall(r"shard \d+/\d+\s+http://127\.0\.0\.1:(\d+)", output)}
    )


def kill_leftovers(ports: list[int]) -> None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(f"--port\0{p}\0" in cmdline or f":{p}" in cmdline for p in ports) and (
                "server.cli" in cmdline or "digits_worker" in cmdline
            ):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def accuracy(label: str, output: str) -> float:
    m = re.search(re.escape(label) + r"[^\n]*?(\d+\.\d+) %", output)
    assert m, f"no accuracy for {label!r} in:\n{output}"
    return float(m.group(1))


@pytest.mark.slow
def test_demo_trains_reports_and_cleans_up(tmp_path):
    proc = subprocess.run(
        demo_command("--no-wait", "--shards", "2", "--workers", "2", "--steps", "150"),
        cwd=ROOT,
        env=demo_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    ports = ports_in(out)
    try:
        assert proc.returncode == 0, out
        assert len(ports) == 2, out
        acc_ps = accuracy("parameter server, 2 async workers", out)
        acc_ref = accuracy("one process, no parameter server", out)
        assert 50 < acc_ps <= 100 and 50 < acc_ref <= 100, out
        assert "difference" in out
        for w in ("[w0]", "[w1]"):  # every worker's progress was shown, prefixed
            assert f"{w} step 150/150 loss" in out, out
        assert f"http://127.0.0.1:{ports[0]}/v1/variables" in out
        assert "/docs" in out
        assert processes_using(ports) == []
        for port in ports:  # and nothing listens any more
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        kill_leftovers(ports)


def _busy_port_above_a_free_one() -> tuple[socket.socket, int]:
    """A socket listening on port P + 1, and P, which nothing holds: both below the kernel's
    ephemeral port range, so that no outgoing connection (another test's client) is handed P
    as its local port before the demo binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = max(1024, ephemeral - 12000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, ephemeral - 2)
        busy = socket.socket()
        try:
            busy.bind(("127.0.0.1", port + 1))
            busy.listen()
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError:
            busy.close()
            continue
        return busy, port
    pytest.skip("no free pair of ports below the ephemeral range")


def test_demo_reports_a_taken_port_and_stops_the_other_shard(tmp_path):
    busy, port = _busy_port_above_a_free_one()  # shard 1 gets the busy port
    with busy:
        try:
            proc = subprocess.run(
                demo_command("--no-wait", "--base-port", str(port), "--steps", "5"),
                cwd=ROOT,
                env=demo_env(tmp_path),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=90,
            )
            out = proc.stdout + proc.stderr
            assert proc.returncode == 1, out
            assert f"shard 1 (http://127.0.0.1:{port + 1}) exited with status" in out, out
            assert "--base-port" in out, out
            assert processes_using([port, port + 1]) == []
        finally:
            kill_leftovers([port, port + 1])


def test_demo_stops_everything_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        demo_command("--no-wait", "--workers", "2", "--steps", "100000", "--log-every", "10"),
        cwd=ROOT,
        env=demo_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until both workers are training
            lines.append(line)
            if sum("] step " in seen for seen in lines) >= 2:
                break
        else:
            pytest.fail("".join(lines))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        out = "".join(lines) + rest
        assert proc.returncode == 128 + signal.SIGINT, out
        assert "interrupted (SIGINT)" in out, out
        ports = ports_in(out)
        assert len(ports) == 2, out
        assert processes_using(ports) == []  # the demo waited for every child to exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(ports_in("".join(lines)))


@pytest.mark.slow
def test_demo_runs_from_an_installed_wheel(tmp_path):
    """The wheel carries everything the demo runs (its worker too): built from the sources,
    installed in a fresh virtualenv, run from a directory outside the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("client_sdk", "server"):  # a copy: building writes build/ next to them
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp_path)]
    subprocess.run(build, check=True, timeout=120)
    (wheel,) = tmp_path.glob("paramshard-*.whl")

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    install = [*pip, "--python", str(python), "install", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, timeout=120)
    # Its dependencies are this environment's (not its source tree: a path listed in a .pth
    # file is searched, but the .pth files in it, which hold this checkout's editable install,
    # are not run), and they come after the venv's own site-packages, where the wheel went.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")

    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in demo_env(tmp_path).items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(python), "-c", "import server.demo.digits_worker as m; print(m.__file__)"],
        cwd=away, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert where.startswith(site), where  # the wheel's, not the checkout's
    proc = subprocess.run(
        [str(venv / "bin" / "paramshard"), "demo", "--steps", "50", "--no-wait"],
        cwd=away,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    ports = ports_in(out)
    try:
        assert proc.returncode == 0, out
        assert "[w3] step 50/50 loss" in out, out
        assert 50 < accuracy("parameter server, 4 async workers", out) <= 100, out
        assert processes_using(ports) == []
    finally:
        kill_leftovers(ports)
