"""The layering, read from the source: the engine imports neither grpc nor service code, kvtransfer
no service code, the gateway never reaches torch, no two packages import each other, and no two
modules know each other (in the product, bench/, harness/ and tests/ alike). Around the product:
engine/, kvtransfer/ and services/ import none of bench/, harness/ and tests/; harness/ (what tests
and benchmarks share) imports neither bench/ nor tests/; and of the tests only tests/benchmarks/
(the benchmarks' own logic) imports bench/.

Imports are parsed with `ast`, nothing is imported. Every `import` counts wherever it stands
(an import inside a function runs too, only later). What an import loads ignores those under
`if TYPE_CHECKING:`; who knows whom counts them, since a type named under `TYPE_CHECKING` is still
a module knowing another's. A package is a directory; it contains its subpackages, so
`engine/kv_cache` using `engine/config.py` is no cycle, while `services/common` and
`services/observability` importing each other is one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "kvtransfer", "services")
FIRST_PARTY = (*PRODUCT, "harness", "bench", "tests")
# The tests' helper modules, which tests import by their bare names (pytest puts their folders on the path).
TEST_HELPERS = tuple(sorted({path.stem for path in (REPO / "tests").rglob("*.py")
                             if not path.stem.startswith("test_") and path.stem != "conftest"}))
# Where the gateway process starts: its package and its command.
GATEWAY_ROOTS = ("services.gateway", "services.commands.gateway")
HEAVY = frozenset({"torch", "triton", "transformers"})


@dataclass(frozen=True)
class Import:
    """`importer` imports `imported` (a dotted name) at `line`; `typing_only` when under `if TYPE_CHECKING:`."""

    importer: str
    imported: str
    line: int
    typing_only: bool = False


class SourceTree:
    """The first-party modules under a root directory and what each imports."""

    def __init__(self, root: Path, packages: Iterable[str] = FIRST_PARTY) -> None:
        self.root = root
        self.top = tuple(packages)
        self.files: dict[str, Path] = {}
        for top in self.top:
            for path in sorted((root / top).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                if any(part.startswith(".") for part in parts):
                    continue  # not the project's: bench/.cache holds the vLLM venv the benchmarks install
                self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.all_imports = {module: list(self._imports_of(module)) for module in self.files}
        # What runs: the imports outside `if TYPE_CHECKING:`.
        self.imports = {module: [i for i in imports if not i.typing_only]
                        for module, imports in self.all_imports.items()}

    def package_of(self, module: str) -> str:
        """The directory a module is in, as a dotted name (a package's own directory for its __init__)."""
        return module if self.files[module].name == "__init__.py" else module.rpartition(".")[0]

    def first_party(self, name: str) -> bool:
        """Whether a dotted name is inside the tree's packages."""
        return name.split(".")[0] in self.top

    def modules_run_by(self, name: str) -> list[str]:
        """The tree's modules that importing `name` runs: every enclosing package's __init__, then
        the module itself (an imported name that is no module stops at its package)."""
        parts = name.split(".")
        return [prefix for i in range(1, len(parts) + 1) if (prefix := ".".join(parts[:i])) in self.files]

    def module_named(self, name: str) -> str | None:
        """The module an imported dotted name is, or is in (the longest prefix that is a module)."""
        run = self.modules_run_by(name)
        return run[-1] if run else None

    def _imports_of(self, module: str) -> Iterator[Import]:
        path = self.files[module]
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, typing_only in _nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(module, alias.name, node.lineno, typing_only)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, package)
                # `from package import module` imports the module (its package runs on the way, see
                # modules_run_by); `from module import name` imports the module.
                submodules = [f"{base}.{alias.name}" for alias in node.names
                              if self.first_party(base) and f"{base}.{alias.name}" in self.files]
                if len(submodules) < len(node.names):
                    yield Import(module, base, node.lineno, typing_only)
                for submodule in submodules:
                    yield Import(module, submodule, node.lineno, typing_only)


def _absolute(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{module}" if module else base


def _nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node, with whether it stands in the body of an `if TYPE_CHECKING:` (its else runs)."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        yield node, typing_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True) for child in node.body)
            stack.extend((child, typing_only) for child in node.orelse)
        else:
            stack.extend((child, typing_only) for child in ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def forbidden_imports(tree: SourceTree, package: str, forbidden: Iterable[str]) -> list[str]:
    """Imports, by modules of `package` (and its subpackages), of anything under a `forbidden` top-level name."""
    tops = set(forbidden)
    return [f"{i.importer}:{i.line} imports {i.imported}"
            for module in tree.files if module == package or module.startswith(f"{package}.")
            for i in tree.imports[module] if i.imported.split(".")[0] in tops]


def closure_reaches(tree: SourceTree, roots: Iterable[str], heavy: Iterable[str]) -> list[str]:
    """For each `heavy` top-level name reachable from the modules under `roots`, one import chain to it."""
    start = [m for m in tree.files if any(m == root or m.startswith(f"{root}.") for root in roots)]
    came_from: dict[str, str | None] = {}
    for module in start:
        for run in tree.modules_run_by(module):
            came_from.setdefault(run, None)
    queue, found, heavy = list(came_from), {}, set(heavy)
    while queue:
        module = queue.pop(0)
        for i in tree.imports[module]:
            top = i.imported.split(".")[0]
            if top in heavy and top not in found:
                found[top] = " -> ".join([*_chain(came_from, module), f"{i.imported} (line {i.line})"])
            for run in tree.modules_run_by(i.imported) if tree.first_party(i.imported) else ():
                if run not in came_from:
                    came_from[run] = module
                    queue.append(run)
    return [found[top] for top in sorted(found)]


def _chain(came_from: dict[str, str | None], module: str) -> list[str]:
    chain = [module]
    while (parent := came_from[chain[-1]]) is not None:
        chain.append(parent)
    return chain[::-1]


def package_cycles(tree: SourceTree) -> list[str]:
    """Every set of packages that import each other in a circle, with the imports that close it.

    An import between two packages counts between the two sibling packages that hold them under
    their closest common parent; one between a package and its own parent or child does not count."""
    edges: dict[str, dict[str, str]] = {}
    for module, imports in tree.imports.items():
        for i in imports:
            for imported in tree.modules_run_by(i.imported) if tree.first_party(i.imported) else ():
                pair = _siblings(tree.package_of(module), tree.package_of(imported))
                if pair is not None:
                    edges.setdefault(pair[0], {}).setdefault(pair[1], f"{module}:{i.line} imports {i.imported}")
    cycles = []
    for component in _strongly_connected(edges):
        witnesses = sorted(w for a in component for b, w in edges.get(a, {}).items() if b in component)
        cycles.append(f"{' <-> '.join(sorted(component))}: {'; '.join(witnesses)}")
    return sorted(cycles)


def module_cycles(tree: SourceTree) -> list[str]:
    """Every set of modules that know each other in a circle, directly or through a chain, each with
    one circle through them written out, then every import that closes it.

    An import counts wherever it stands, under `if TYPE_CHECKING:` and inside functions too. Its
    edge goes to the module it names (for `from module import name`, that module; for a package, its
    `__init__`), not to the packages run on the way: `engine.kv_cache.codec` importing
    `engine.kv_cache.blocks` does not know `engine/kv_cache/__init__.py`."""
    edges: dict[str, dict[str, str]] = {}
    for module, imports in tree.all_imports.items():
        for i in imports:
            imported = tree.module_named(i.imported) if tree.first_party(i.imported) else None
            if imported is not None and imported != module:
                note = " (TYPE_CHECKING)" if i.typing_only else ""
                edges.setdefault(module, {}).setdefault(imported, f"{module}:{i.line} imports {i.imported}{note}")
    cycles = []
    for component in _strongly_connected(edges):
        witnesses = sorted(w for a in component for b, w in edges.get(a, {}).items() if b in component)
        circle = " -> ".join(_shortest_circle(edges, min(component)))
        cycles.append(f"{circle}: {'; '.join(witnesses)}")
    return sorted(cycles)


def _shortest_circle(edges: dict[str, dict[str, str]], start: str) -> list[str]:
    """The fewest modules from `start` back to itself (breadth first), `start` at both ends."""
    came_from: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for successor in edges.get(node, {}):
            if successor == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*chain[::-1], start]
            if successor not in came_from:
                came_from[successor] = node
                queue.append(successor)
    raise ValueError(f"{start} is on no circle")


def _siblings(a: str, b: str) -> tuple[str, str] | None:
    """(a's, b's) enclosing packages just below their closest common parent; None if one holds the other."""
    pa, pb = a.split("."), b.split(".")
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    if common in (len(pa), len(pb)):
        return None
    return ".".join(pa[:common + 1]), ".".join(pb[:common + 1])


def _strongly_connected(edges: dict[str, dict[str, str]]) -> list[set[str]]:
    """The graph's strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in edges.get(node, {}):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while (member := stack.pop()) != node:
                component.add(member)
            component.add(node)
            if len(component) > 1:
                components.append(component)

    for node in list(edges):
        if node not in index:
            visit(node)
    return components


# ---- the checker, on a small tree made to break each rule ---------------------------------------

def _write(root: Path, files: dict[str, str]) -> SourceTree:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return SourceTree(root, ("engine", "services"))


def test_the_checker_finds_forbidden_imports_wherever_they_run(tmp_path: Path) -> None:
    tree = _write(tmp_path, {
        "engine/__init__.py": "",
        "engine/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import grpc\nelse:\n    import os\n",
        "engine/sub/__init__.py": "",
        "engine/sub/b.py": "def f():\n    from services.x import y\n",
        "services/__init__.py": "",
        "services/x.py": "y = 1\n",
    })
    assert forbidden_imports(tree, "engine", ["grpc", "services"]) == ["engine.sub.b:2 imports services.x"]


def test_the_checker_follows_the_gateway_to_torch_through_packages_and_relative_imports(tmp_path: Path) -> None:
    tree = _write(tmp_path, {
        "engine/__init__.py": "",
        "engine/light.py": "import json\n",
        "engine/kv/__init__.py": "from . import heavy\n",
        "engine/kv/heavy.py": "import torch.nn\n",
        "services/__init__.py": "",
        "services/gateway/__init__.py": "",
        "services/gateway/app.py": "from engine import light\nfrom ..helpers import tool\n",
        "services/helpers.py": "from engine.kv.other import thing\n",
    })
    assert closure_reaches(tree, ["services.gateway"], HEAVY) == [
        "services.gateway.app -> services.helpers -> engine.kv -> engine.kv.heavy -> torch.nn (line 1)"]
    assert closure_reaches(tree, ["engine.light"], HEAVY) == []


def test_the_checker_skips_hidden_folders(tmp_path: Path) -> None:
    # bench/.cache/vllm-venv has thousands of modules, some in a newer Python's syntax: reading them
    # took minutes and failed the run.
    tree = _write(tmp_path, {"engine/__init__.py": "", "engine/.cache/venv/new.py": "def f[T](a): ...\n"})
    assert list(tree.files) == ["engine"]


def test_the_checker_finds_cycles_between_sibling_packages_but_not_with_a_parent(tmp_path: Path) -> None:
    tree = _write(tmp_path, {
        "engine/__init__.py": "",
        "engine/config.py": "",
        "engine/engine.py": "from engine.kv import cache\n",
        "engine/kv/__init__.py": "",
        "engine/kv/cache.py": "from engine.config import X\n",
        "services/__init__.py": "",
        "services/common/__init__.py": "",
        "services/common/errors.py": "from services.observability.deep.spans import set_error\n",
        "services/observability/__init__.py": "",
        "services/observability/deep/__init__.py": "",
        "services/observability/deep/spans.py": "",
        "services/observability/metrics.py": "from services.common import errors\n",
    })
    assert package_cycles(tree) == [
        "services.common <-> services.observability: "
        "services.common.errors:1 imports services.observability.deep.spans; "
        "services.observability.metrics:1 imports services.common.errors"]


def test_the_checker_finds_circles_between_modules_counting_typing_and_lazy_imports(tmp_path: Path) -> None:
    tree = _write(tmp_path, {
        "engine/__init__.py": "",
        "engine/engine.py": "from engine.spec import drafter\n",
        "engine/spec/__init__.py": "from engine.spec.drafter import Drafter\n",
        "engine/spec/drafter.py":
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.engine import Engine\n",
        "engine/kv/__init__.py": "",
        "engine/kv/cache.py": "from engine.kv import codec\n",
        "engine/kv/codec.py": "from engine.kv.blocks import size\n",
        "engine/kv/blocks.py": "def f():\n    from engine.kv.cache import g\n",
        "engine/kv/free.py": "from engine.kv import cache, codec\nfrom engine.spec import Drafter\n",
        "services/__init__.py": "",
    })
    assert module_cycles(tree) == [
        "engine.engine -> engine.spec.drafter -> engine.engine: "
        "engine.engine:1 imports engine.spec.drafter; engine.spec.drafter:3 imports engine.engine (TYPE_CHECKING)",
        "engine.kv.blocks -> engine.kv.cache -> engine.kv.codec -> engine.kv.blocks: "
        "engine.kv.blocks:2 imports engine.kv.cache; engine.kv.cache:1 imports engine.kv.codec; "
        "engine.kv.codec:1 imports engine.kv.blocks"]


# ---- the rules, on this repository -----------------------------------------------------------------

TREE = SourceTree(REPO)


def test_the_tree_was_read() -> None:
    assert len(TREE.files) > 100 and "services.gateway.router" in TREE.files
    assert {"harness.worker", "bench.suites", "tests.unit.test_layering"} <= set(TREE.files)
    assert "reference" in TEST_HELPERS


def test_the_engine_imports_neither_grpc_nor_protobuf_nor_service_code() -> None:
    assert forbidden_imports(TREE, "engine", ["grpc", "grpc_health", "tandem", "google", "services"]) == []


def test_kvtransfer_imports_no_service_code() -> None:
    assert forbidden_imports(TREE, "kvtransfer", ["services"]) == []


def test_the_gateway_never_reaches_torch() -> None:
    assert closure_reaches(TREE, GATEWAY_ROOTS, HEAVY) == []


def test_no_two_packages_import_each_other() -> None:
    assert package_cycles(TREE) == []


def test_the_product_imports_neither_bench_nor_harness_nor_tests() -> None:
    assert [found for package in PRODUCT
            for found in forbidden_imports(TREE, package, ["bench", "harness", "tests", *TEST_HELPERS])] == []


def test_harness_imports_neither_bench_nor_tests() -> None:
    assert forbidden_imports(TREE, "harness", ["bench", "tests", *TEST_HELPERS]) == []


def test_bench_imports_no_tests() -> None:
    assert forbidden_imports(TREE, "bench", ["tests", *TEST_HELPERS]) == []


def test_only_the_tests_of_the_benchmarks_own_logic_import_bench() -> None:
    """Every other test drives Tandem through harness/; tests/benchmarks/ checks bench's own arithmetic and clients."""
    found = forbidden_imports(TREE, "tests", ["bench"])
    assert any(f.startswith("tests.benchmarks.") for f in found)  # the rule sees the imports it allows
    assert [f for f in found if not f.startswith("tests.benchmarks.")] == []


def test_no_two_modules_know_each_other() -> None:
    assert module_cycles(TREE) == []
