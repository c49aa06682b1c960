"""The package's shape, checked from its source: imports point one way through the layers and
through the rooms inside them, no modules import each other in a circle, no two modules share a
name, no folder grows past a reader's glance, schedules and collective modes are named by their
enums, private Lightning names are reached from one module only, and every Lightning override
says so with ``@override``.

Layers, lowest first: ``_common`` <- ``planner`` <- ``runtime`` (and ``testing``) <- ``profiling``
<- ``models`` <- the Lightning layer (``lightning/`` and the top-level modules, ``demo``,
``configs``). A module may import its own layer and the layers below it, never one above. Two layers
have rooms, lowest first, with the same rule between them (``ROOMS``): the planner's
``schema`` <- ``cost`` <- ``search`` <- its public surface (``planning``, ``why``, ``report``, ...), and
the Lightning layer's base modules (``_private``, ``strategy_config``) <- ``steps`` <- ``fit`` <-
``callback`` <- ``strategy`` <- ``cli``. Within a layer, the module import graph (every import:
module level, inside functions, under ``TYPE_CHECKING``) has no circle: its strongly connected
components are single modules.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import cephalo_lightning

PACKAGE = Path(cephalo_lightning.__file__).parent
NAME = PACKAGE.name
LAYERS = {"_common": 0, "planner": 1, "runtime": 2, "testing": 2, "profiling": 3, "models": 4, "lightning": 5}
TOP = 5  # the top-level modules, demo/ and configs/ sit with the Lightning layer
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
NO_TORCH = ("_common", "planner")
NO_LIGHTNING = ("_common", "planner", "runtime", "testing", "profiling", "models")
PRIVATE_HOME = "lightning/_private.py"
# Rooms inside a layer, lowest first; a layer's modules outside every room (its public surface) sit on top.
ROOMS = {
    "planner": {"schema": 0, "cost": 1, "search": 2},
    "lightning": {"_private": 0, "strategy_config": 0, "steps": 1, "fit": 2, "callback": 3, "strategy": 4},
}
SURFACE = 9  # the room of a layer's modules outside ``ROOMS`` (and of its package's ``__init__``)
MAX_MODULES = 15  # modules in one folder: more and the tree no longer shows what is where


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every import in the file, module-level or inside a function: (line, module, names)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, target, tuple(alias.name for alias in node.names)))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def _room(module: str) -> int:
    """The room of a module inside its layer (``SURFACE`` for the layer's public surface)."""
    parts = module.split(".")
    rooms = ROOMS.get(parts[1], {}) if len(parts) > 1 else {}
    return rooms.get(parts[2], SURFACE) if len(parts) > 2 else SURFACE


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _where(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def test_imports_point_one_way_through_the_layers():
    wrong = []
    for path in _sources():
        own = _layer(_module_name(path))
        for line, module, names in _imports(path):
            targets = [module] + [f"{module}.{n}" for n in names] if module == NAME else [module]
            for target in targets:
                if target.split(".")[0] == NAME and target != NAME and _layer(target) > own:
                    wrong.append(f"{_where(path)}:{line} imports {target} (a layer above)")
                elif target == NAME and own < TOP:
                    wrong.append(f"{_where(path)}:{line} imports the top-level package")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_imports_point_one_way_through_the_rooms_of_a_layer():
    """Inside the planner and the Lightning layer, a module imports its own room and the rooms below
    it (``ROOMS``); the public surface on top may import every room."""
    modules = {_module_name(path) for path in _sources()}
    wrong = []
    for path in _sources():
        module = _module_name(path)
        for line, target, names in _imports(path):
            named = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            for each in named or [target]:
                same_layer = each.split(".")[:2] == module.split(".")[:2] and len(module.split(".")) > 2
                if each.startswith(f"{NAME}.") and same_layer and _room(each) > _room(module):
                    wrong.append(f"{_where(path)}:{line} imports {each} (a room above)")
    assert not wrong, "imports against the rooms (ROOMS):\n" + "\n".join(wrong)


def test_the_rooms_named_exist():
    """A room in ``ROOMS`` is a subpackage or a module of its layer: a renamed room cannot leave its
    modules unchecked."""
    missing = [f"{layer}/{room}" for layer, rooms in ROOMS.items() for room in rooms
               if not (PACKAGE / layer / room).is_dir() and not (PACKAGE / layer / f"{room}.py").is_file()]
    assert not missing, f"ROOMS names what the tree does not have: {missing}"


def test_no_two_modules_share_a_name():
    """A module's file name says which one it is wherever it is quoted (a traceback, a log line, a
    review): no two modules, and no module and package, share a name."""
    names: dict[str, list[str]] = {}
    for path in _sources():
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.stem, []).append(_where(path))
    for folder in PACKAGE.rglob("*"):
        if folder.is_dir() and (folder / "__init__.py").is_file():
            names.setdefault(folder.name, []).append(_where(folder) + "/")
    repeated = {name: where for name, where in names.items() if len(where) > 1}
    assert not repeated, "names used more than once (rename one):\n" + "\n".join(
        f"{name}: {', '.join(where)}" for name, where in sorted(repeated.items()))


def test_no_folder_holds_more_modules_than_a_glance_takes():
    crowded = {_where(folder) or ".": count for folder in [PACKAGE, *PACKAGE.rglob("*")] if folder.is_dir()
               and (count := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES}
    assert not crowded, f"folders with more than {MAX_MODULES} modules (split them into rooms): {crowded}"


# ----------------------------------------------------------------------------- import circles


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from package import module`` names the module;
    an implicit import of a parent package's ``__init__`` is not an edge)."""
    modules = {_module_name(path): path for path in _sources()}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, target, names in _imports(path):
            if target.split(".")[0] != NAME:
                continue
            submodules = {f"{target}.{n}" for n in names if f"{target}.{n}" in modules}
            targets |= submodules
            if target in modules and (not names or len(submodules) < len(names)):
                targets.add(target)
        graph[module] = targets - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_circle_finder_finds_circles_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(map(sorted, _circles(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_modules_import_each_other_in_a_circle():
    circles = [sorted(m.removeprefix(f"{NAME}.") for m in circle) for circle in _circles(_import_graph())]
    assert not circles, "modules that import each other in a circle (break it: move what both need below them):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("forbidden,layers", [(("torch",) + LIGHTNING, NO_TORCH), (LIGHTNING, NO_LIGHTNING)],
                         ids=["no-torch-in-planner-and-common", "no-lightning-below-the-lightning-layer"])
def test_lower_layers_never_import_torch_or_lightning(forbidden, layers):
    wrong = [f"{_where(path)}:{line} imports {module}"
             for path in _sources() if _where(path).split("/")[0] in layers
             for line, module, _ in _imports(path) if module.split(".")[0] in forbidden]
    assert not wrong, f"{', '.join(layers)} must not import {', '.join(forbidden)}:\n" + "\n".join(wrong)


def test_only_the_private_module_imports_private_lightning():
    wrong = []
    for path in _sources():
        if _where(path) == PRIVATE_HOME:
            continue
        for line, module, names in _imports(path):
            if module.split(".")[0] not in LIGHTNING:
                continue
            private = [p for p in module.split(".") if p.startswith("_")] + [n for n in names if n.startswith("_")]
            if private:
                wrong.append(f"{_where(path)}:{line} imports {module} {', '.join(names)}")
    assert not wrong, f"private Lightning imports outside {PRIVATE_HOME}:\n" + "\n".join(wrong)


def _lightning_private_names() -> set[str]:
    """Every private name Lightning's source defines: its ``_modules``, ``_functions``, ``_Classes``
    and the ``self._attributes`` it assigns (dunders are Python's, not Lightning's)."""
    import lightning

    names = set()
    for path in Path(lightning.__file__).parent.rglob("*.py"):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and n.strip("_") and not (n.startswith("__") and n.endswith("__"))}


def test_no_private_lightning_name_is_reached_through_a_string():
    """``getattr(x, "_name")`` or ``"lightning.x._y"`` reaches a private Lightning name as surely as an
    import does, but no import check sees it: outside the private module, no string literal spells a
    private name Lightning defines, or a dotted Lightning path with a private part."""
    private = _lightning_private_names()
    wrong = []
    for path in _sources():
        if _where(path) == PRIVATE_HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            dotted = node.value.split(".")
            if node.value in private or (dotted[0] in LIGHTNING and any(p.startswith("_") for p in dotted[1:])):
                wrong.append(f"{_where(path)}:{node.lineno} {node.value!r}")
    assert not wrong, f"private Lightning names reached through strings outside {PRIVATE_HOME}:\n" + "\n".join(wrong)


# ----------------------------------------------------------------------------- closed vocabularies

VOCABULARY_HOME = "_common/vocabulary.py"


def _spelled_words(path: Path, words: set[str]) -> list[tuple[int, str]]:
    """String literals in ``path`` that spell one of ``words``, outside docstrings, f-string text and the
    bodies of enum classes (whose members define a vocabulary of their own)."""
    tree = ast.parse(path.read_text(), str(path))
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            exempt |= {id(part) for part in ast.walk(node)}
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            exempt.add(id(node.body[0].value))
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", getattr(b, "attr", "")).endswith("Enum")
                                                  for b in node.bases):
            exempt |= {id(part) for part in ast.walk(node)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words
                  and id(node) not in exempt)


def test_schedules_and_collectives_are_named_by_their_enums():
    """Outside the vocabulary module no code spells a schedule or a collective mode as a string: it
    compares, defaults and builds choices from ``Schedule`` and ``Collective`` (whose members equal
    the strings files carry), so a renamed or added member cannot be missed in one place."""
    from cephalo_lightning._common.vocabulary import Collective, Schedule

    words = {member.value for vocabulary in (Schedule, Collective) for member in vocabulary}
    spelled = [f"{_where(path)}:{line} {word!r}" for path in _sources() if _where(path) != VOCABULARY_HOME
               for line, word in _spelled_words(path, words)]
    assert not spelled, "name these by their enum member (cephalo_lightning._common.vocabulary):\n" + "\n".join(spelled)


# ----------------------------------------------------------------------------- @override


def _overriding_classes() -> list[type]:
    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.lightning.cli import CephaloCLI
    from cephalo_lightning.lightning.strategy import precision

    plugins = [c for _, c in inspect.getmembers(precision, inspect.isclass)
               if c.__module__ == precision.__name__ and any(b.__module__.startswith(LIGHTNING) for b in c.__mro__)]
    return [CephaloStrategy, CephaloCallback, CephaloCLI, *plugins]


def _function(value: object) -> object | None:
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value if callable(value) else None


def test_every_lightning_override_carries_override():
    """Every method (not a dunder) that one of our classes defines, or inherits from a class of
    ours, whose name a Lightning base class defines too, has ``__override__`` set
    (``typing_extensions.override`` sets it)."""
    missing = set()
    for cls in _overriding_classes():
        lightning_bases = [b for b in cls.__mro__ if b.__module__.startswith(LIGHTNING)]
        lightning_names = {name for b in lightning_bases for name in vars(b)}
        for own in cls.__mro__:
            if not own.__module__.startswith(NAME):
                continue
            for name, value in vars(own).items():
                function = _function(value)
                if (function is None or name not in lightning_names or (name.startswith("__") and name.endswith("__"))):
                    continue
                if not getattr(function, "__override__", False):
                    missing.add(f"{own.__module__}.{own.__qualname__}.{name}")
    assert not missing, f"{len(missing)} Lightning override(s) without @override:\n" + "\n".join(sorted(missing))


# ----------------------------------------------------------------------------- test modules stand alone


def _imports_of_test_modules(root: Path) -> list[str]:
    """``file:line: statement`` for every import of a test module (``tests....test_*``) under ``root``'s
    tests/, scenarios/, benchmarks/ and examples/, in code or in a script a test writes out as a string."""
    import re

    statement = re.compile(r"^[ \t]*(?:from[ \t]+(tests(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
                           r"|import[ \t]+(tests(?:\.\w+)+))", re.M)
    found = []
    for folder in ("tests", "scenarios", "benchmarks", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            for match in statement.finditer(text):
                module, names, plain = match.groups()
                parts = (module or plain).split(".")[1:] + re.findall(r"\w+", names or "")
                if any(part.startswith("test_") for part in parts):
                    line = text.count("\n", 0, match.start()) + 1
                    found.append(f"{path.relative_to(root)}:{line}: {match.group(0).strip()}")
    return found


def test_no_test_module_imports_another():
    """What several test files share lives in the helper modules beside them (``tests/*.py`` without
    the ``test_`` prefix): a test module imported by another would run its module-level code, and
    collect its fixtures' state, twice, and a change to one test file would move another's."""
    found = _imports_of_test_modules(PACKAGE.parent)
    assert not found, "move what these take into a helper module (tests/helpers.py, ...):\n" + "\n".join(found)
