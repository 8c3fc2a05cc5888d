"""Build paramshard's images with whatever container engine this machine has (`make image`).

    python3 docker/images.py build     # paramshard:<v>, paramshard-demo:<v>, paramshard-etcd:<v>
    python3 docker/images.py base      # only the Python base image (see below)
    python3 docker/images.py engine    # which engine would be used, and why

What it owns: choosing the engine, making a Python base image when no registry is reachable, and
building docker/Dockerfile's three targets with the version and commit as OCI labels. It runs on
the interpreter alone (standard library), before any virtualenv exists.

**The engine.** ``PARAMSHARD_ENGINE`` (``docker`` or ``podman``) if set; else Docker if its
daemon answers; else Podman. Podman reads a ``containers.conf`` written here (unless
``CONTAINERS_CONF`` names one already) that fits hosts without systemd: runc as the runtime
where it is installed (crun refuses cgroup v1/v2 hybrid hosts), cgroupfs, events in a file, and
containers' default ulimits no higher than this host's hard limits (Podman's defaults are higher,
and a non-root-capable host refuses them). Images are built in Docker's format, so that the
``HEALTHCHECK`` stays in them.

**The base.** docker/Dockerfile starts from ``PYTHON_IMAGE`` (default: the official
``python:3.11-slim-bookworm``). ``--python-image`` or ``PYTHON_IMAGE`` picks another. Otherwise
the official image is used if it is here or can be pulled; if not (no registry reachable), a
base is made locally: ``debootstrap --variant=minbase bookworm`` from the Debian mirror apt uses
(``/etc/apt/sources.list*``, or ``PARAMSHARD_DEBIAN_MIRROR``), imported as
``localhost/paramshard-debian:bookworm``, then docker/base/Containerfile installs Debian's
python3 (3.11) on it: ``localhost/paramshard-python:3.11-bookworm``. Nothing comes from outside
Debian's mirror and the Python package index. Made once; ``base --rebuild`` makes it again.
``PARAMSHARD_LOCAL_BASE=1`` skips the pull attempt.

The image layers stay in the engine's cache between runs, so a rebuild after a code change
only redoes the layers that copy the code and install it.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
BASE_CONTAINERFILE = ROOT / "docker" / "base" / "Containerfile"
#: Where the engine settings and the debootstrap root file system are kept between runs.
STATE_DIR = Path(os.environ.get("PARAMSHARD_IMAGE_STATE", "/var/tmp/paramshard-image"))
OFFICIAL_BASE = "python:3.11-slim-bookworm"
LOCAL_DEBIAN = "localhost/paramshard-debian:bookworm"
LOCAL_BASE = "localhost/paramshard-python:3.11-bookworm"
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class ImageError(Exception):
    """A step cannot go on; the message says why and what to do."""


def log(msg: str) -> None:
    print(f"[image {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(
    cmd: list[str], *, check: bool = True, capture: bool = False, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, logged; raise ImageError (with its stderr when captured) if it fails."""
    log("$ " + shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, check=False, text=True, capture_output=capture, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{shlex.join(cmd)} did not finish in {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or "").strip()[-2000:] if capture else ""
        raise ImageError(
            f"{shlex.join(cmd)} exited {proc.returncode}" + (f": {detail}" if detail else "")
        )
    return proc


# -- the engine ----------------------------------------------------------------------------------


def _answers(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _hard_limit(which: int, cap: int) -> int:
    hard = resource.getrlimit(which)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


def podman_conf() -> Path:
    """A containers.conf for Podman on this host (module docstring), written once per host."""
    # Open files: the host's hard limit (at most 2**20). Processes: at most 32768, plenty for a
    # shard or a build; runc failed to set anything higher on hosts whose hard limit was higher.
    nofile = _hard_limit(resource.RLIMIT_NOFILE, 1 << 20)
    nproc = _hard_limit(resource.RLIMIT_NPROC, 32768)
    lines = [
        "# written by paramshard's docker/images.py for this host; delete it to have it rewritten",
        "[containers]",
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]',
        "[engine]",
        'events_logger = "file"',
    ]
    if shutil.which("runc"):
        lines.append('runtime = "runc"')
    if not Path("/run/systemd/system").is_dir():
        lines.append('cgroup_manager = "cgroupfs"')
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / "containers.conf"
    text = "\n".join(lines) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def choose_engine() -> tuple[str, str]:
    """(engine, why). Sets up Podman's environment in ``os.environ`` when Podman is chosen."""
    wanted = os.environ.get("PARAMSHARD_ENGINE", "").strip()
    if wanted and wanted not in ("docker", "podman"):
        raise ImageError(f"PARAMSHARD_ENGINE={wanted!r}: set docker or podman, or unset it")
    if wanted == "docker" or (
        not wanted and shutil.which("docker") and _answers(["docker", "info"])
    ):
        if not shutil.which("docker"):
            raise ImageError("PARAMSHARD_ENGINE=docker but there is no docker command")
        return "docker", "PARAMSHARD_ENGINE=docker" if wanted else "the Docker daemon answers"
    if not shutil.which("podman"):
        raise ImageError(
            "no container engine: docker does not answer and podman is not installed "
            "(apt-get install podman runc, or start the Docker daemon)"
        )
    if "CONTAINERS_CONF" not in os.environ:
        os.environ["CONTAINERS_CONF"] = str(podman_conf())
    os.environ.setdefault("BUILDAH_FORMAT", "docker")
    why = "PARAMSHARD_ENGINE=podman" if wanted else "no Docker daemon answers; podman is installed"
    return "podman", f"{why} (CONTAINERS_CONF={os.environ['CONTAINERS_CONF']})"


def image_exists(engine: str, ref: str) -> bool:
    return _answers([engine, "image", "inspect", ref])


# -- the base image -----------------------------------------------------------------------------


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror apt uses here (the first ``.../debian`` URI for bookworm in its sources,
    one-line or deb822 format), or ``PARAMSHARD_DEBIAN_MIRROR``, or deb.debian.org."""
    if os.environ.get("PARAMSHARD_DEBIAN_MIRROR"):
        return os.environ["PARAMSHARD_DEBIAN_MIRROR"]
    paths = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        # one-line format: deb [opts] URI suite components; deb822: URIs: ... / Suites: ...
        for m in re.finditer(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", text, re.M):
            if m.group(2) == SUITE and m.group(1).rstrip("/").endswith("/debian"):
                return m.group(1)
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(.+)$", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and SUITE in suites.group(1).split():
                for uri in uris.group(1).split():
                    if uri.rstrip("/").endswith("/debian"):
                        return uri
    return DEFAULT_MIRROR


#: What a container never reads: the downloaded packages, apt's lists, documentation (but the
#: copyright files), manual pages, translations. The dpkg rule keeps them out of later installs.
SLIM_DPKG_RULES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""


def slim(rootfs: Path) -> None:
    """Remove from a debootstrap root file system what no container reads (``SLIM_DPKG_RULES``)."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/man", "usr/share/info"):
        for entry in (rootfs / sub).glob("*"):
            if entry.is_file() or entry.is_symlink():
                entry.unlink()
            elif entry.name != "partial":
                shutil.rmtree(entry)
    for entry in (rootfs / "usr/share/locale").glob("*"):
        if entry.is_dir():
            shutil.rmtree(entry)
    for doc in (rootfs / "usr/share/doc").glob("*"):
        if doc.is_dir() and not doc.is_symlink():
            for entry in doc.iterdir():
                if entry.name != "copyright":
                    shutil.rmtree(
                        entry
                    ) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    (rootfs / "etc/dpkg/dpkg.cfg.d/paramshard-slim").write_text(SLIM_DPKG_RULES)


def make_local_base(engine: str, *, rebuild: bool = False) -> str:
    """Make ``LOCAL_BASE`` from Debian's mirror (module docstring); return its name."""
    if not rebuild and image_exists(engine, LOCAL_BASE):
        log(f"base: {LOCAL_BASE} is here already (base --rebuild makes it again)")
        return LOCAL_BASE
    if rebuild or not image_exists(engine, LOCAL_DEBIAN):
        if not shutil.which("debootstrap"):
            raise ImageError(
                "making a base image without a registry needs debootstrap: apt-get install "
                "debootstrap (or give a base: --python-image IMAGE / PYTHON_IMAGE=IMAGE)"
            )
        if os.geteuid() != 0:
            raise ImageError("debootstrap needs root: run make image as root, or give PYTHON_IMAGE")
        mirror = debian_mirror()
        rootfs = STATE_DIR / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        log(f"base: debootstrap {SUITE} from {mirror} (a few minutes)")
        run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror])
        slim(rootfs)
        log(f"base: importing the root file system as {LOCAL_DEBIAN}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            log(f"$ tar -C {rootfs} -c . | {engine} import - {LOCAL_DEBIAN}")
            imp = subprocess.run(
                [engine, "import", "-", LOCAL_DEBIAN], stdin=tar.stdout, check=False
            )
        finally:
            if tar.stdout:
                tar.stdout.close()
            tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise ImageError(
                f"importing {rootfs} as {LOCAL_DEBIAN} failed (tar {tar.returncode}, "
                f"{engine} import {imp.returncode})"
            )
        shutil.rmtree(rootfs, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="paramshard-base-") as ctx:
        certs = Path(ctx) / "certs"
        certs.mkdir()
        for crt in sorted(glob.glob("/usr/local/share/ca-certificates/**/*.crt", recursive=True)):
            shutil.copy(crt, certs / Path(crt).name)
        log(
            f"base: building {LOCAL_BASE} (Debian's python3 on {LOCAL_DEBIAN}; "
            f"{len(list(certs.iterdir()))} extra CA certificate(s) from this host)"
        )
        run(
            [
                engine,
                "build",
                "--build-arg",
                f"DEBIAN_IMAGE={LOCAL_DEBIAN}",
                "-f",
                str(BASE_CONTAINERFILE),
                "-t",
                LOCAL_BASE,
                ctx,
            ]
        )
    return LOCAL_BASE


def python_base(engine: str, given: str | None) -> str:
    """The ``PYTHON_IMAGE`` to build on (module docstring)."""
    given = given or os.environ.get("PYTHON_IMAGE") or None
    if given:
        log(f"base: {given} (given)")
        return given
    official = OFFICIAL_BASE if engine == "docker" else f"docker.io/library/{OFFICIAL_BASE}"
    if image_exists(engine, official):
        log(f"base: {official} (here already)")
        return official
    if os.environ.get("PARAMSHARD_LOCAL_BASE") != "1":
        log(f"base: trying to pull {official}")
        try:
            pulled = subprocess.run(
                [engine, "pull", official], capture_output=True, text=True, timeout=120, check=False
            )
            if pulled.returncode == 0:
                return official
            reason = (pulled.stderr.strip().splitlines() or ["?"])[-1]
        except subprocess.TimeoutExpired:
            reason = "no answer in 120 s"
        log(f"base: cannot pull {official} ({reason[:300]}); making a base locally")
    return make_local_base(engine)


# -- the images ----------------------------------------------------------------------------------


def version() -> str:
    """The package version, from pyproject.toml (read as text: no tomllib before Python 3.11)."""
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if not m:
        raise ImageError('pyproject.toml has no version = "..." line')
    return m.group(1)


def revision() -> str:
    """The commit the images are built from (``-dirty`` when the work tree has changes)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def image_names(ver: str | None = None) -> dict[str, str]:
    """Build target -> image name; the names docker-compose.yml refers to."""
    ver = ver or version()
    return {
        "runtime": f"paramshard:{ver}",
        "demo": f"paramshard-demo:{ver}",
        "etcd": f"paramshard-etcd:{ver}",
    }


def build(engine: str, python_image: str | None = None) -> dict[str, str]:
    """Build every target; return target -> image name."""
    base = python_base(engine, python_image)
    ver, rev = version(), revision()
    names = image_names(ver)
    for target, name in names.items():
        log(f"building {name} (target {target}, version {ver}, revision {rev})")
        run(
            [
                engine,
                "build",
                "-f",
                str(DOCKERFILE),
                "--target",
                target,
                "--build-arg",
                f"PYTHON_IMAGE={base}",
                "--build-arg",
                f"PARAMSHARD_VERSION={ver}",
                "--build-arg",
                f"PARAMSHARD_REVISION={rev}",
                "-t",
                name,
                str(ROOT),
            ]
        )
        relabel(engine, name, ver, rev)
    return names


def relabel(engine: str, name: str, ver: str, rev: str) -> None:
    """Give ``name`` these version and revision labels for sure: a build whose every step came
    from the layer cache can keep the labels of the build that made the cache (Podman 4.3 did),
    so one uncached metadata-only step sets them again."""
    containerfile = (
        f"FROM {name}\n"
        f'LABEL org.opencontainers.image.version="{ver}" '
        f'org.opencontainers.image.revision="{rev}"\n'
    )
    with tempfile.TemporaryDirectory(prefix="paramshard-label-") as ctx:
        (Path(ctx) / "Containerfile").write_text(containerfile)
        run(
            [engine, "build", "--no-cache", "-f", str(Path(ctx) / "Containerfile"), "-t", name, ctx]
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the runtime, demo and etcd images")
    b.add_argument("--python-image", help="the base to build on (default: see module docstring)")
    s = sub.add_parser("base", help="make the local Python base image")
    s.add_argument("--rebuild", action="store_true", help="make it again, debootstrap included")
    sub.add_parser("engine", help="say which engine would be used and why")
    args = p.parse_args(argv)
    try:
        engine, why = choose_engine()
        log(f"engine: {engine}: {why}")
        if args.command == "build":
            names = build(engine, args.python_image)
            log("built " + ", ".join(names.values()))
        elif args.command == "base":
            log(f"base: {make_local_base(engine, rebuild=args.rebuild)}")
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
