"""Nothing that crosses a wire is pickled: pickle (and marshal) run code chosen by whoever wrote the
bytes, so a peer that can reach a port could run code in the worker. This scans the wire code."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_WIRE_CODE = ("kvtransfer", "services")
_FORBIDDEN = frozenset({"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve"})
# torch helpers that unpickle or pickle behind the scenes.
_FORBIDDEN_CALLS = frozenset({"torch.load", "torch.save", "send_object_list", "recv_object_list",
                              "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"})


def forbidden_uses(source: str) -> list[str]:
    """What in `source` imports a pickling module or calls a pickling helper, with line numbers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        elif isinstance(node, ast.Call):
            names = [ast.unparse(node.func)]
        else:
            continue
        for name in names:
            if name in _FORBIDDEN or name in _FORBIDDEN_CALLS or name.rpartition(".")[2] in _FORBIDDEN_CALLS:
                found.append(f"line {node.lineno}: {name}")
    return found


def test_the_scan_catches_each_way_of_pickling() -> None:
    assert forbidden_uses("import pickle") == ["line 1: pickle"]
    assert forbidden_uses("from marshal import loads") == ["line 1: marshal"]
    assert forbidden_uses("import os\nx = torch.load(f)") == ["line 2: torch.load"]
    assert forbidden_uses("dist.send_object_list([x], 1)") == ["line 1: dist.send_object_list"]
    assert forbidden_uses("import json\njson.loads(b)") == []


def test_no_wire_code_pickles() -> None:
    files = [path for folder in _WIRE_CODE for path in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 20  # the scan really looked at the code
    found = {str(path.relative_to(REPO)): uses for path in files if (uses := forbidden_uses(path.read_text()))}
    assert found == {}
