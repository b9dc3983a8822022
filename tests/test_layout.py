"""The house has no import circles: neither between modules nor between sinkformer's folders.

Every import is read from the source (lazy imports inside functions too), so a shim that imports
"upwards" (attention/ from nn/, training/ from runs/) closes a circle and fails here.
"""

import ast
from pathlib import Path

import sinkformer

PACKAGE = Path(sinkformer.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module → the sinkformer modules it imports (``from . import x`` resolved to the module ``x``
    where ``x`` is one)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    assert node.level <= len(package.split(".")), \
                        f"{path}:{node.lineno}: a relative import beyond the top-level package"
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_finds_the_imports():
    graph = import_graph()
    assert "sinkformer.sinkhorn.problem" in graph["sinkformer.sinkhorn.tiled"]
    assert "sinkformer.provenance" in graph["sinkformer.training.runner"]  # a lazy import, inside a function
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


def test_no_module_imports_itself_back():
    graph = import_graph()
    # the package's face (sinkformer/__init__.py and each folder's __init__) imports what it shows
    inner = {m: {t for t in ts if not _is_face(t, m)} for m, ts in graph.items()}
    assert circles(inner) == []


def test_no_folder_imports_a_folder_that_imports_it():
    """Folders (sinkhorn/, attention/, nn/, training/, runs/, ...) form layers: no circle between them."""
    folders: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module == "sinkformer":
            continue
        folder = module.split(".")[1]
        folders.setdefault(folder, set()).update(t.split(".")[1] for t in targets if t != "sinkformer")
    for folder in folders:
        folders[folder].discard(folder)
        folders[folder] &= set(folders)
    assert circles(folders) == []


def _is_face(target: str, importer: str) -> bool:
    """Whether ``target`` is the ``__init__`` of a package that contains ``importer``."""
    return (PACKAGE.parent / Path(*target.split(".")) / "__init__.py").exists() and importer.startswith(target + ".")
