"""The kernel's layering, held by the suite: every "never" of docs/layers.json is kept by the code's imports,
and every arrow drawn there is one the code has. Imports are read with ``ast`` (module level, function-local
and ``if TYPE_CHECKING:`` alike); nothing is imported. One process, no world."""

from __future__ import annotations

import ast
import json
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHITEBOARD = ROOT / "docs" / "layers.json"
#: Where the importable packages stand: spmd under core/, each backend plugin's package under plugins/<name>/.
SOURCE_ROOTS = [ROOT / "core", *sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir())]
#: Python files on no part that a never-rule still follows through (an import via them counts).
OTHER_TREES = [ROOT / "core", ROOT / "plugins", ROOT / "benchmarks"]


def _python_files(tree: pathlib.Path) -> Iterator[pathlib.Path]:
    for path in sorted(tree.rglob("*.py")):
        relative = path.relative_to(ROOT).parts
        if "tests" in relative or any(part.startswith(".") for part in relative) or path.name.startswith("test_"):
            continue
        yield path


def _modules() -> dict[str, pathlib.Path]:
    """Every module name of the source trees -> its file (a package -> its __init__.py)."""
    found: dict[str, pathlib.Path] = {}
    for root in SOURCE_ROOTS:
        for path in _python_files(root):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts and parts[0] not in ("tests", "benchmarks"):
                found[".".join(parts)] = path
    return found


def _module_name(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> str | None:
    return next((name for name, file in modules.items() if file == path), None)


def imported_files(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[pathlib.Path]:
    """The source files ``path`` imports anywhere in its body (``from pkg import sub`` names the submodule)."""
    own = _module_name(path, modules) or ""
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    targets: set[pathlib.Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a non-module attribute path: its module
                name = name.rpartition(".")[0]
            if name and modules[name] != path:
                targets.add(modules[name])
    return targets


def _whiteboard() -> dict:
    return json.loads(WHITEBOARD.read_text())


def _part_files(spec: dict) -> set[pathlib.Path]:
    files: set[pathlib.Path] = set()
    for entry in spec["is"]:
        target = ROOT / entry
        files |= set(_python_files(target)) if entry.endswith("/") else {target}
    return files


class Layers:
    """The whiteboard's parts as files, and the import graph of every source file."""

    def __init__(self) -> None:
        board = _whiteboard()
        self.board = board
        self.modules = _modules()
        self.parts = {name: _part_files(spec) for name, spec in board["parts"].items()}
        on_parts = set().union(*self.parts.values())
        self.files = {p for tree in OTHER_TREES for p in _python_files(tree)} | on_parts
        self.on_no_part = self.files - on_parts
        self.edges = {path: imported_files(path, self.modules) for path in self.files}

    def reached(self, source: str, target: str) -> list[str]:
        """Import chains from part ``source`` into part ``target``: straight, or through files on no part."""
        chains: list[str] = []
        goal = self.parts[target]
        for start in sorted(self.parts[source]):
            seen: set[pathlib.Path] = set()
            stack = [(start, [start])]
            while stack:
                here, route = stack.pop()
                for nxt in sorted(self.edges.get(here, ())):
                    if nxt in goal:
                        chains.append(" -> ".join(str(p.relative_to(ROOT)) for p in [*route, nxt]))
                    elif nxt in self.on_no_part and nxt not in seen:
                        seen.add(nxt)
                        stack.append((nxt, [*route, nxt]))
        return chains


LAYERS = Layers()


def test_every_part_names_files_that_exist():
    """A part that names a missing path would keep every never-rule about it vacuously."""
    for name, spec in LAYERS.board["parts"].items():
        for entry in spec["is"]:
            assert (ROOT / entry).exists(), f"docs/layers.json part {name!r} names {entry!r}, which does not exist"
        assert LAYERS.parts[name], f"docs/layers.json part {name!r} holds no Python file"


def test_every_never_rule_is_kept():
    broken = []
    for source, target, why in LAYERS.board["never"]:
        for chain in LAYERS.reached(source, target):
            broken.append(f"never {source} -> {target} ({why}): {chain}")
    assert not broken, "imports that break docs/layers.json:\n" + "\n".join(broken)


def test_every_drawn_arrow_is_in_the_code():
    """The arrows drawn are ones the code has: this also shows the reader above finds real imports."""
    missing = [
        f"{source} -> {target}"
        for source, target in LAYERS.board["arrows"]
        if not any(LAYERS.edges[f] & LAYERS.parts[target] for f in LAYERS.parts[source])
    ]
    assert not missing, f"arrows drawn in docs/layers.json that no import makes: {missing}"


def test_function_local_and_type_checking_imports_count(tmp_path):
    """An import inside a function or under TYPE_CHECKING is an arrow like any other."""
    module = tmp_path / "probe.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from spmd.comm.group import ProcessGroup\n"
        "def later():\n    from spmd.tensor import dtensor\n    import spmd.mesh\n"
    )
    found = {str(p.relative_to(ROOT)) for p in imported_files(module, LAYERS.modules)}
    assert found == {"core/spmd/comm/group.py", "core/spmd/tensor/dtensor.py", "core/spmd/mesh.py"}
