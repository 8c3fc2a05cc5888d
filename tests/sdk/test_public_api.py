"""The SDK's public surface is marked mechanically, and a worker needs no server packages."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types

import pytest

import client_sdk
from client_sdk import PSError
from tests.conftest import ROOT


def test_all_is_sorted_and_matches_the_exported_members():
    assert client_sdk.__all__ == sorted(client_sdk.__all__)
    assert len(set(client_sdk.__all__)) == len(client_sdk.__all__)
    for name in client_sdk.__all__:
        assert hasattr(client_sdk, name), name
    public = {
        name
        for name, value in vars(client_sdk).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(client_sdk.__all__)


def test_every_exported_class_is_documented_and_every_error_is_a_pserror():
    for name in client_sdk.__all__:
        obj = getattr(client_sdk, name)
        assert inspect.isclass(obj), name
        if name.endswith("Error"):
            assert issubclass(obj, PSError), name
    for cls in (client_sdk.PSClient, client_sdk.AsyncPSClient):
        assert cls.__doc__
        for verb in (
            "init",
            "wait_ready",
            "pull",
            "push",
            "push_async",
            "flush",
            "increment",
            "assign",
            "variables",
            "checkpoint",
            "set_optimizer",
            "delete",
            "close",
        ):
            method = getattr(cls, verb)
            assert method.__doc__, f"{cls.__name__}.{verb} has no docstring"
        for verb in (
            "init",
            "wait_ready",
            "pull",
            "push",
            "push_async",
            "flush",
            "increment",
            "assign",
            "variables",
            "checkpoint",
            "set_optimizer",
            "delete",
            "close",
        ):
            is_async = inspect.iscoroutinefunction(getattr(cls, verb))
            assert is_async == (cls is client_sdk.AsyncPSClient), f"{cls.__name__}.{verb}"


BLOCKER = """
import sys

class Blocker:
    BLOCKED = ("fastapi", "uvicorn", "starlette")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ImportError(f"{name} is blocked: the worker SDK must not need it")
        return None

sys.meta_path.insert(0, Blocker())
try:
    import fastapi  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker does not work")

import client_sdk
from client_sdk import AsyncPSClient, PSClient, PSError
from client_sdk.optimizers import SGD, Adagrad
from client_sdk import wire, placement

ps = PSClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], worker_id="w0")
ps.close()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in Blocker.BLOCKED + ("server",))
print("loaded:", loaded)
raise SystemExit(1 if loaded else 0)
"""


def test_the_sdk_imports_without_server_packages():
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_sdk_ships_its_types():
    """PEP 561: the marker sits in the package and the wheel's package data carries it, so a
    user's type checker reads the SDK's annotations (checked by `make typecheck`)."""
    assert (ROOT / "client_sdk" / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["client_sdk"]
