"""The rooms of the package import only downward, nothing heavy at import time, and IPython only in extension.py.

The package is a stack of rooms, one folder each (docs/architecture.md says what each room does):

    extension.py                 the IPython adapter (the only module that imports IPython at module level)
    ledger/                      per-cell records, %%gpumem (header, lines, watcher) and their views
    snapshots/                   PyTorch memory snapshots: read safely, replayed exactly, explained (OOM panel)
    oom/   free/                 out-of-memory diagnosis and panel; %gpumem free
    preflight/                   the pre-flight estimate on fake tensors, the allocator model, max batch size
    anatomy/                     roles of every byte (parameters, gradients, ...), per line and per phase
    attribution/   chart/        who holds the memory; the live chart
    display/   tensors/          View, tables, text and HTML parts; the one count of tensors (torch's internals)
    sealed/                      run_sealed(): a function run in a forked child sealed off from files, network, processes
    core/                        units, devices, the memory model, probes, records

A room may import itself and the rooms below it, never one beside or above it. Inside a room,
the modules that compute never import the ones that draw (``view``, ``panel``, ``svg``,
``views``, ``live``), so every room's logic can be used and tested without its display.
"""
import ast
import os
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ipy_gpumem")

#: Each room and its level; a module may import rooms at a lower level, or its own room.
LEVELS = {"core": 0, "tensors": 1, "display": 1, "sealed": 1, "attribution": 2, "chart": 2, "anatomy": 3,
          "preflight": 4, "free": 5, "oom": 5, "snapshots": 6, "ledger": 7}
#: Modules that draw: inside a room, no other module imports them.
DRAWING = {"view", "panel", "svg", "views", "live", "figures"}
HEAVY = ("IPython", "torch", "plotly", "ipywidgets", "pynvml", "pandas", "psutil", "sidecar", "anywidget")


def _modules():
    out = []
    for room in LEVELS:
        folder = os.path.join(PKG, room)
        for dirpath, _dirs, files in os.walk(folder):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), PKG)[:-3].replace(os.sep, ".")
                    out.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(out)


MODULES = _modules()


def _path(module):
    base = os.path.join(PKG, *module.split("."))
    return base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")


def _imports(module, top_level_only):
    """(absolute module name inside the package or outside it, level) for each import in ``module``."""
    tree = ast.parse(open(_path(module), encoding="utf-8").read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = module.split(".") if _path(module).endswith("__init__.py") else module.split(".")[:-1]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.module or "", 0
                continue
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # from . import x  /  from .. import x
                for alias in node.names:
                    yield ".".join(base + [alias.name]), node.level
            else:
                yield target, node.level


def test_the_rooms_are_where_the_file_tree_says():
    rooms = sorted(n for n in os.listdir(PKG) if os.path.isdir(os.path.join(PKG, n)) and not n.startswith("__"))
    assert rooms == sorted(LEVELS), rooms
    top = sorted(n for n in os.listdir(PKG) if n.endswith(".py"))
    assert top == ["__init__.py", "__main__.py", "extension.py"], top
    for room in LEVELS:
        doc = ast.get_docstring(ast.parse(open(os.path.join(PKG, room, "__init__.py"), encoding="utf-8").read()))
        assert doc, f"{room}/__init__.py needs a docstring saying what the room is for"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_says_what_it_is_for(module):
    assert ast.get_docstring(ast.parse(open(_path(module), encoding="utf-8").read())), module


@pytest.mark.parametrize("module", MODULES)
def test_rooms_import_only_downward(module):
    room = module.split(".")[0]
    for name, level in _imports(module, top_level_only=False):
        if level == 0 and not name.startswith("ipy_gpumem"):
            continue
        target = name[len("ipy_gpumem."):] if name.startswith("ipy_gpumem") else name
        other = target.split(".")[0]
        assert other != "extension", f"{module} imports the IPython adapter"
        assert other in LEVELS, f"{module} imports {name}, which is in no room"
        if other != room:
            assert LEVELS[other] < LEVELS[room], f"{module} ({room}) imports {target}, a room at its level or above"


def _draws(module):
    """A module that draws: any part of its name below the room is a drawing name (``chart.svg.axes``)."""
    return any(part in DRAWING for part in module.split(".")[1:])


@pytest.mark.parametrize("module", [m for m in MODULES if not _draws(m)])
def test_logic_never_imports_drawing(module):
    for name, level in _imports(module, top_level_only=False):
        target = name[len("ipy_gpumem."):] if name.startswith("ipy_gpumem") else name
        if level == 0 and not name.startswith("ipy_gpumem"):
            continue
        if target.split(".")[0] == module.split(".")[0] and module.split(".")[0] != "display":
            assert not _draws(target), f"{module} computes but imports {target}, which draws"


@pytest.mark.slow
def test_importing_any_room_imports_nothing_heavy():
    code = (
        "import sys, importlib\n"
        f"for m in {MODULES!r}: importlib.import_module('ipy_gpumem.' + m)\n"
        "import ipy_gpumem\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", MODULES)
def test_no_room_names_a_heavy_package_at_module_level(module):
    for name, level in _imports(module, top_level_only=True):  # lazy imports inside functions are the point
        if level == 0:
            assert name.split(".")[0] not in HEAVY, f"{module} imports {name} at module level"


@pytest.mark.slow
def test_load_ext_imports_only_the_per_cell_path():
    """%load_ext must stay fast: the chart, the OOM panel and who() load when first used."""
    code = (
        "import sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'ipy_gpumem')\n"
        "ip.run_cell('x = 1', store_history=True)\n"
        "lazy = ('ipy_gpumem.oom.parse', 'ipy_gpumem.attribution.who', 'ipy_gpumem.oom.rules', 'ipy_gpumem.chart.views',\n"
        "        'ipy_gpumem.chart.svg', 'ipy_gpumem.chart.live', 'ipy_gpumem.ledger.lines', 'plotly', 'ipywidgets', 'torch')\n"
        "print(sorted(m for m in lazy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# One layout, two renderers: neither imports the other
# ---------------------------------------------------------------------------------------------


def _chart_imports():
    """``(module, imported module, names)`` for every import inside ``ipy_gpumem.chart``, read from the source."""
    import pathlib

    root = pathlib.Path(PKG)
    for path in sorted((root / "chart").rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        if path.name == "__init__.py":
            module = module[: -len(".__init__")]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                yield module, target, [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield module, alias.name, []


def test_the_svg_and_plotly_renderers_share_the_layout_and_import_nothing_of_each_other():
    """Issue 31: chart/figures/ imported eight private helpers of chart/svg/. Both now draw the layouts
    (``chart.session``, ``chart.columns``) with the words of ``chart.words``: neither package imports the
    other, and no module of the chart imports another's underscore name."""
    seen = list(_chart_imports())
    assert seen
    for module, target, names in seen:
        for one, other in (("ipy_gpumem.chart.figures", "ipy_gpumem.chart.svg"),
                           ("ipy_gpumem.chart.svg", "ipy_gpumem.chart.figures")):
            if module.startswith(one):
                assert not (target or "").startswith(other) and not any(
                    f"{target}.{name}".startswith(other) for name in names), (module, target, names)
        if (target or "").startswith("ipy_gpumem"):
            private = [name for name in names if name.startswith("_")]
            assert not private, f"{module} imports {private} from {target}"
