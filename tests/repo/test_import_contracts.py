"""Which code may import what: the layering a reviewer would otherwise check by eye.

Each contract in :data:`CONTRACTS` names the modules it binds and the imports they must never
reach. A module reaches what it imports anywhere in its file (an import inside a function too;
not one under ``if TYPE_CHECKING:``, which never runs) and, through the repository's own
modules, whatever those reach in turn: ``server/store/verbs.py`` importing a module of ours that
imports starlette breaks its contract as surely as importing starlette itself. What third-party
packages import is not followed. A broken contract fails with the chain of imports that breaks
it. The files are read, never imported, so this runs in a fraction of a second.

To change a contract, edit :data:`CONTRACTS` (each says why it exists). A module it names that
no longer exists fails the test too, so that a rename updates the rules instead of leaving them
to bind nothing.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: The repository's importable packages, by top-level name.
PACKAGES = ("client_sdk", "server", "bench")
TESTS = ROOT / "tests"
WEB_STACK = ("fastapi", "starlette", "uvicorn", "httptools", "h11")


@dataclass(frozen=True)
class Contract:
    name: str
    why: str
    #: Dotted module names; ``"pkg.*"`` is every module of the package. Test modules are named
    #: ``tests.<path>`` (``tests.*``: all of them).
    modules: tuple[str, ...]
    #: Top-level names (``fastapi``) or dotted prefixes (``bench``, ``server.app``).
    forbidden: tuple[str, ...]
    #: Modules the pattern matches that the rule does not bind, each with the reason.
    exempt: tuple[tuple[str, str], ...] = ()


CONTRACTS = (
    Contract(
        "the SDK never imports the shard or the web stack",
        "workers install paramshard without the [server] extra; the SDK shares only "
        "client_sdk.wire with the shards, which the shards import from the SDK",
        ("client_sdk.*",),
        ("server", "fastapi", "starlette", "uvicorn"),
    ),
    Contract(
        "the SDK's core never imports the frameworks",
        "`import client_sdk` needs httpx2, msgpack and numpy alone: torch and jax come with the "
        "paramshard[torch] and [jax] extras, for the users who import their binding by name",
        ("client_sdk.*",),
        ("torch", "jax", "jaxlib", "flax", "keras"),
        exempt=(
            ("client_sdk.jax", "the JAX binding: it imports jax"),
            ("client_sdk.torch", "the torch binding: it imports torch when bind() runs"),
        ),
    ),
    Contract(
        "the store, optimizers and persistence never import the web stack",
        "they are the shard's state and its files, testable and reusable without HTTP "
        "(reshard runs offline); the web stack reaches them, not the other way round",
        (
            "server.store.*",
            "server.optim",
            "server.persistence.*",
            "server.reshard",
        ),
        WEB_STACK,
    ),
    Contract(
        "the launcher, the supervisor, the probes, status and the demo never import the web stack",
        "they start shards as processes and talk to them over HTTP like any client: `paramshard "
        "up`, `status` and `demo` start fast, and bench and tests start shards through them",
        ("server.launcher", "server.supervisor", "server.probes", "server.status", "server.demo.*"),
        WEB_STACK,
    ),
    Contract(
        "the demo's worker is a worker",
        "it imports the SDK and nothing else of paramshard: it is the example users copy, and "
        "it runs with the SDK's dependencies alone (and scikit-learn)",
        ("server.demo.digits_worker",),
        ("server", "fastapi", "starlette", "uvicorn"),
    ),
    Contract(
        "tests never import bench",
        "bench is a measuring tool, free to change; the suite tests the product",
        ("tests.*",),
        ("bench",),
        exempt=(
            ("tests.e2e.test_bench", "it tests make bench itself: its arithmetic and a quick run"),
        ),
    ),
)


# -- reading the tree --------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every module of the repository's packages and tests, by dotted name."""
    found = {}
    for package in (*PACKAGES, TESTS.name):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[tuple[str, int, tuple[str, ...]]]:
    """``(module, level, names)`` for every import that can run: ``import a.b`` is
    ``("a.b", 0, ())``, ``from ..x import y`` is ``("x", 2, ("y",))``."""
    out: list[tuple[str, int, tuple[str, ...]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, 0, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level, tuple(a.name for a in node.names)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> what it imports: our modules by dotted name, others by top-level name."""
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for module, level, names in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package.split(".")
                base = base[: len(base) - (level - 1)]
                module = ".".join(base + ([module] if module else []))
            targets.update(_resolve(module, names, modules))
        targets.discard(name)
        graph[name] = targets
    return graph


def _resolve(module: str, names: tuple[str, ...], modules: dict[str, Path]) -> set[str]:
    """What importing ``names`` from ``module`` runs: each package on the way, the module, and
    any of ``names`` that is a submodule; a third-party import by its top-level name."""
    parts = module.split(".")
    if parts[0] not in PACKAGES and parts[0] != "tests":
        return {parts[0]}
    out = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    out.update(f"{module}.{n}" for n in names if f"{module}.{n}" in modules)
    return {m for m in out if m in modules} or {module}


# -- checking ----------------------------------------------------------------------------------


def _bound(contract: Contract, modules: dict[str, Path]) -> list[str]:
    bound = []
    for pattern in contract.modules:
        if pattern.endswith(".*"):
            prefix = pattern[:-2]
            matched = [m for m in modules if m == prefix or m.startswith(prefix + ".")]
        else:
            matched = [pattern] if pattern in modules else []
        assert matched, (
            f"contract {contract.name!r} names {pattern}, which is not a module of "
            f"the repository: update CONTRACTS in {Path(__file__).name}"
        )
        bound += matched
    exempt = dict(contract.exempt)
    for module in exempt:
        assert module in bound, (
            f"contract {contract.name!r} exempts {module}, which it does "
            f"not bind: update CONTRACTS in {Path(__file__).name}"
        )
    return [m for m in bound if m not in exempt]


def _forbidden(target: str, forbidden: tuple[str, ...]) -> bool:
    return any(target == f or target.startswith(f + ".") for f in forbidden)


def violations(
    contract: Contract, modules: dict[str, Path], graph: dict[str, set[str]]
) -> list[str]:
    """One line per module of the contract that reaches a forbidden import, with the chain."""
    out = []
    for start in _bound(contract, modules):
        parent: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            here = queue.popleft()
            hit = sorted(t for t in graph.get(here, ()) if _forbidden(t, contract.forbidden))
            if hit:
                chain, step = [max(hit, key=len)], here  # the most precise: bench.stepcost
                while step is not None:
                    chain.append(step)
                    step = parent[step]
                out.append(" -> ".join(reversed(chain)))
                break
            for target in sorted(graph.get(here, ())):
                if target in modules and target not in parent:
                    parent[target] = here
                    queue.append(target)
    return out


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], dict[str, set[str]]]:
    modules = _modules()
    return modules, _graph(modules)


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.name for c in CONTRACTS])
def test_import_contract(contract, tree):
    modules, graph = tree
    broken = violations(contract, modules, graph)
    if broken:
        pytest.fail(
            f"{contract.name} ({contract.why}), but:\n  " + "\n  ".join(broken), pytrace=False
        )


def test_tests_import_one_another_by_their_package_path(tree):
    """A test module imports conftest, a helper or another test module as ``tests.<path>``
    (``from tests.conftest import Fleet``, ``from tests.helpers import netlab``), never by bare
    name (``from conftest import Fleet``) nor relatively. pytest imports conftest.py as
    ``tests.conftest``; a bare import loads the same file a second time as another module, with
    globals of its own, and works only while pytest happens to put that folder on sys.path."""
    modules, _ = tree
    ours = {name.rpartition(".")[2] for name in modules if name.startswith("tests.")}
    wrong = []
    for name, path in modules.items():
        if not name.startswith("tests."):
            continue
        for module, level, names in _imports(ast.parse(path.read_text(), str(path))):
            if level or module.split(".")[0] in ours:
                shown = "." * level + module
                line = f"from {shown} import {', '.join(names)}" if names else f"import {shown}"
                wrong.append(f"{path.relative_to(ROOT)}: {line}")
    assert not wrong, "import these as tests.<path>:\n  " + "\n  ".join(wrong)


def test_the_checker_sees_imports_in_functions_and_through_our_modules(tmp_path):
    """The reader itself: a lazy import counts, a TYPE_CHECKING one does not, relative imports
    resolve, and a chain through our own modules is followed and reported."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import fastapi\n"
        "def f():\n    import uvicorn\n"
        "from . import sibling\nfrom ..store import x\n"
    )
    assert sorted(_imports(tree)) == [
        ("", 1, ("sibling",)),
        ("store", 2, ("x",)),
        ("typing", 0, ("TYPE_CHECKING",)),
        ("uvicorn", 0, ()),
    ]
    modules = {"server.a": Path("a.py"), "server.b": Path("b.py"), "server": Path("i.py")}
    graph = {"server.a": {"server.b", "numpy"}, "server.b": {"starlette"}, "server": set()}
    rule = Contract("t", "t", ("server.a",), WEB_STACK)
    assert violations(rule, modules, graph) == ["server.a -> server.b -> starlette"]
