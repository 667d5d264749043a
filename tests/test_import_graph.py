"""No import circles in ``src/trainops`` (issue 44, part 3): the modules' import graph has no cycle.

The graph is read from the sources with ``ast`` (nothing is imported). Its nodes are the modules
under ``src/trainops`` (``pkg/__init__.py`` is ``pkg``, ``pkg/x.py`` is ``pkg.x``); an edge A -> B
means that running A's code imports B. The rules:

- Every ``import`` / ``from ... import`` statement counts, at module level and inside functions,
  methods and classes: a lazy import back is still a circle (the two modules still depend on each
  other, and the late import may run while the other module is half-initialised, as when a
  package's ``__init__`` imports a module that imports the package back). Left out: statements
  under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), which never run.
  ``importlib.import_module`` with literal arguments counts as the import it performs.
- ``import a.b.c`` is an edge to ``a.b.c``. ``from a.b import n`` is an edge to the module
  ``a.b.n`` when that module exists (``n`` is a submodule), else to ``a.b`` (``n`` is a name its
  ``__init__`` defines). Relative imports resolve against the importer's package (an
  ``__init__``'s package is itself): ``from . import x`` in ``pkg/m.py`` is an edge to ``pkg.x``
  if ``pkg/x.py`` (or ``pkg/x/__init__.py``) exists, else to ``pkg``; ``from .sub import name`` is
  an edge to ``pkg.sub.name`` if that is a module, else to ``pkg.sub``. Imports of anything
  outside ``trainops`` are not nodes.
- Importing ``trainops.x.y`` first runs the ``__init__`` of every package on its path
  (``trainops``, ``trainops.x``). So the importer also gets an edge to each of those packages,
  except the ones already running when the importer runs: the importer itself and its own
  ancestor packages (Python imports a module's parents before the module, so counting those would
  put every module in a circle with its own package). That implicit edge is how real circles bite:
  ``trainops.train.gpt`` importing ``trainops.bench.case`` also runs ``trainops/bench/__init__``,
  and if that imported the train package back, the two would be half-initialised in turn.

A cycle is a strongly connected component of more than one module, or a module importing itself.
``ALLOWED`` lists the cycles the tree may keep (each with its reason); it is empty: the target is
none, and an entry that is no longer a cycle fails the test too, so the list stays minimal.

``LAYERS`` also pins the one-way layout of the whole programs (STYLE.md): in ``trainops.train``
the command line imports the model modules, which import ``common`` (``fsdp`` also ``gpt``, whose
model it shards), never each other or back; ``trainops.bench.case`` imports nothing of ``bench``.
"""

from __future__ import annotations

import ast
import os
import textwrap

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
PACKAGE = "trainops"

# frozenset of the modules of a cycle -> why it stays. Empty: src/ has no import circle.
ALLOWED: dict[frozenset, str] = {}


# -- reading the graph ---------------------------------------------------------------------------

def module_files(root: str, package: str) -> dict[str, str]:
    """{module name: file path} of every .py file under ``root/package``."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        parts = os.path.relpath(folder, root).split(os.sep)
        for name in files:
            if name.endswith(".py"):
                stem = name[:-3]
                found[".".join(parts if stem == "__init__" else parts + [stem])] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom / literal importlib.import_module call, anywhere in the tree, except
    under ``if TYPE_CHECKING:`` (its ``else:`` branch is kept)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "importlib" and node.args
              and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:2])):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def _ancestors(module: str) -> list[str]:
    """``a.b.c`` -> [``a``, ``a.b``]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node, importer: str, is_package: bool, modules) -> list[str]:
    """The modules an import statement (or import_module call) of ``importer`` names, before the
    implicit package edges."""
    here = importer if is_package else importer.rpartition(".")[0]   # the package relative imports start from

    def absolute(name: str, level: int) -> str:
        if level == 0:
            return name
        base = here.split(".")
        if level - 1 > len(base) - 1:
            raise ValueError(f"{importer}: relative import beyond the top package")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        source = absolute(node.module or "", node.level)
        return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
    name = node.args[0].value   # importlib.import_module(name, package)
    if name.startswith("."):
        package = node.args[1].value if len(node.args) > 1 else ""
        level = len(name) - len(name.lstrip("."))
        parts = package.split(".")
        return [".".join(parts[: len(parts) - (level - 1)] + ([name.lstrip(".")] if name.lstrip(".") else []))]
    return [name]


def _by_line(where: str):
    path, _, line = where.rpartition(":")
    return path, int(line)


def import_graph(root: str, package: str) -> dict[str, dict[str, list[str]]]:
    """{importer: {imported module: ["path:line", ...]}} over the modules of ``root/package``."""
    files = module_files(root, package)
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in files}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        running = set(_ancestors(module)) | {module}   # already executing when this module's code runs
        where = f"{os.path.relpath(path, root)}:"
        for node in _import_nodes(tree):
            for target in _targets(node, module, is_package, files):
                for name in _ancestors(target) + [target]:
                    if name in files and (name == target or name not in running):
                        graph[module].setdefault(name, []).append(f"{where}{node.lineno}")
        for lines in graph[module].values():
            lines.sort(key=_by_line)
    return graph


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules importing themselves,
    each sorted; Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph) -> str:
    """The edges inside one cycle, with the lines that make them."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for a in component:
        for b, where in sorted(graph[a].items()):
            if b in members:
                lines.append(f"    {a} -> {b}  ({', '.join(dict.fromkeys(where))})")
    return "\n".join(lines)


# -- the tree --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def src_graph():
    return import_graph(SRC, PACKAGE)


def test_src_has_no_import_circles(src_graph):
    found = {frozenset(c): c for c in cycles(src_graph)}
    new = [describe(c, src_graph) for key, c in sorted(found.items(), key=lambda kv: kv[1]) if key not in ALLOWED]
    stale = [sorted(key) for key in ALLOWED if key not in found]
    assert not new, "import circles in src/trainops:\n" + "\n".join(new)
    assert not stale, f"ALLOWED lists cycles that are gone (remove them): {stale}"


def test_the_graph_sees_the_tree(src_graph):
    """The reader finds the modules and the edges it must (a reader finding nothing would pass above)."""
    assert {"trainops", "trainops.functional", "trainops.ops", "trainops.bench", "trainops.train"} <= set(src_graph)
    assert "trainops.functional" in src_graph["trainops"]   # from . import ... functional
    assert "trainops.ops" in src_graph["trainops"]
    assert sum(len(edges) for edges in src_graph.values()) > 3 * len(src_graph) // 2


# Within the whole programs, each module's imports of its own package (one way: the command line
# -> the model modules -> what they share; the runner and the case lists -> the case base).
LAYERS = {
    "trainops.train": {"__init__": {"cli", "common", "gpt"}, "__main__": {"cli"},
                       "cli": {"cnn", "common", "fsdp", "gpt", "llama"}, "gpt": {"common"}, "llama": {"common"},
                       "cnn": {"common"}, "fsdp": {"common", "gpt"}, "common": set()},
    "trainops.bench": {"case": set()},
}


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_whole_programs_import_one_way(src_graph, package):
    """The train demos' modules import what they share from ``common``, never each other (fsdp shards
    gpt's model), and nothing imports the command line back; bench's ``case`` imports nothing of bench."""
    for module, allowed in LAYERS[package].items():
        name = package if module == "__init__" else f"{package}.{module}"
        siblings = {m.rpartition(".")[2] if m != package else "__init__" for m in src_graph[name]
                    if m == package or m.startswith(package + ".")}
        assert siblings <= allowed, f"{name} imports {sorted(siblings - allowed)} of {package}"
    if package == "trainops.train":   # every module of the package is listed
        assert {m for m in src_graph if m.startswith(package + ".")} == {f"{package}.{m}" for m in LAYERS[package]
                                                                           if m != "__init__"}


# -- the rules, on a made-up package ---------------------------------------------------------------

def _package(tmp_path, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(tmp_path)


def test_a_lazy_import_back_is_a_circle(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from . import b\n",
                               "b.py": "def f():\n    from .a import g\n"})
    assert cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b"]]


def test_type_checking_imports_are_left_out(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from . import b\n",
                               "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n"
                                       "else:\n    import os\n"})
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {} and cycles(graph) == []


def test_from_package_import_resolves_submodules_and_names(tmp_path):
    root = _package(tmp_path, {"__init__.py": "X = 1\n", "sub/__init__.py": "Y = 2\n", "sub/leaf.py": "",
                               "m.py": "from . import sub, X\nfrom .sub import leaf, Y\nimport pkg.sub.leaf\n"})
    graph = import_graph(root, "pkg")
    # sub and leaf are modules; X is a name of pkg's __init__, Y of pkg.sub's; importing leaf runs pkg.sub
    assert set(graph["pkg.m"]) == {"pkg", "pkg.sub", "pkg.sub.leaf"}
    assert graph["pkg.m"]["pkg.sub"] == ["pkg/m.py:1", "pkg/m.py:2", "pkg/m.py:2", "pkg/m.py:3"]


def test_importing_a_submodule_runs_its_package(tmp_path):
    """a -> other.leaf also runs other/__init__, which imports a back: a circle, though no module
    names a and other/__init__ both."""
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from .other.leaf import f\n",
                               "other/__init__.py": "from ..a import g\n", "other/leaf.py": ""})
    assert cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.other"]]


def test_a_package_importing_its_own_modules_is_no_circle(tmp_path):
    """A package's __init__ importing its submodules, which import siblings (the parents running
    already), is the ordinary layout; a submodule taking a name from the __init__ that imports it
    is a circle (the name may not be defined yet when it runs)."""
    files = {"__init__.py": "from . import a\nfrom .sub import b\n", "a.py": "from .sub.b import h\n",
             "sub/__init__.py": "from . import b\n", "sub/b.py": "from ..c import V\n", "c.py": "V = 1\n"}
    assert cycles(import_graph(_package(tmp_path, files), "pkg")) == []
    files["sub/b.py"] = "from .. import V\n"
    assert cycles(import_graph(_package(tmp_path, files), "pkg")) == [["pkg", "pkg.a", "pkg.sub", "pkg.sub.b"]]


def test_a_self_import_and_import_module_are_seen(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "def f():\n    from pkg import a\n",
                               "b.py": "import importlib\nimportlib.import_module('.c', 'pkg')\n",
                               "c.py": "def f():\n    import pkg.b\n"})
    assert cycles(import_graph(root, "pkg")) == [["pkg.a"], ["pkg.b", "pkg.c"]]


def test_a_failure_names_the_lines(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "import os\nfrom . import b\n", "b.py": "from . import a\n"})
    graph = import_graph(root, "pkg")
    text = describe(cycles(graph)[0], graph)
    assert "pkg.a -> pkg.b  (pkg/a.py:2)" in text and "pkg.b -> pkg.a  (pkg/b.py:1)" in text


def test_a_relative_import_past_the_top_is_an_error(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from .. import x\n"})
    with pytest.raises(ValueError, match="beyond the top package"):
        import_graph(root, "pkg")
