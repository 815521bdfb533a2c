"""The rooms of the package import only downward, nothing heavy at import time, and IPython only in extension.py.

The package is a stack of rooms, one folder each (docs/architecture.md says what each room does):

    extension.py                 the IPython adapter (the only module that imports IPython at module level)
    present/                     what the user is shown: each cell, mode and estimate as outputs in order
    cell/                      per-cell records, %%gpumem (header, lines, watcher) and their views
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

Private means private: no module imports or reads another module's underscore name (what is
shared is public), no two modules import each other however indirectly (lazy imports count), and
torch's private names are spelled in ``tensors/`` only: outside it, a ``._name`` or a ``"_name"``
that is not the module's own fails unless :data:`FOREIGN_PRIVATE` lists it with its reason.
"""
import ast
import functools
import os
import re
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ipy_gpumem")

#: Each room and its level; a module may import rooms at a lower level, or its own room.
LEVELS = {"core": 0, "tensors": 1, "display": 1, "sealed": 1, "attribution": 2, "chart": 2, "anatomy": 3,
          "preflight": 4, "free": 5, "oom": 5, "snapshots": 6, "ranks": 6, "reruns": 6, "cell": 7, "present": 8}
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


@functools.lru_cache(maxsize=None)
def _tree(module):
    return ast.parse(open(_path(module), encoding="utf-8").read())


def _imports(module, top_level_only):
    """(absolute module name inside the package or outside it, level) for each import in ``module``."""
    tree = _tree(module)
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
    assert ast.get_docstring(_tree(module)), module


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
        "        'ipy_gpumem.chart.svg', 'ipy_gpumem.chart.live', 'ipy_gpumem.cell.lines', 'plotly', 'ipywidgets', 'torch')\n"
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


# ---------------------------------------------------------------------------------------------
# Private means private
# ---------------------------------------------------------------------------------------------

_NAME = re.compile(r"_[A-Za-z0-9_]*[A-Za-z0-9]_?")  # _x, _x_ (a protocol's), __x; never __x__
#: Names of other libraries that are public API despite the underscore, allowed anywhere.
PUBLIC_UNDERSCORED = {
    "_asdict": "namedtuple's API (underscored so as not to clash with a field)",
    "_replace": "namedtuple's API",
    "_make": "namedtuple's API",
    "_fields": "namedtuple's API",
}
#: IPython's display protocol (``_repr_mimebundle_``, ``_repr_html_``...): public methods by design.
_PROTOCOL = re.compile(r"_repr_[a-z]+_|_ipython_[a-z_]+_")
#: Python's own private names read through their module, allowed anywhere.
STDLIB_PRIVATE = {
    "sys._getframe": "the caller's frame (CPython's documented way; inspect.currentframe() calls it)",
    "sys._current_frames": "the frames of other threads (what faulthandler and py-spy read)",
    "os._exit": "a forked child ends without running the parent's cleanup (the documented use)",
}
_OPS = ("aten op names as data (autocast's CUDA lists transcribed from autocast_mode.cpp, the ops a GEMM or a "
        "convolution reaches), compared with the name of the op the dispatcher runs or looked up in torch.ops; "
        "never an attribute of a torch object")
_ATTENTION = ("the name of the attention backward op the dispatcher runs, compared to pick its scratch size "
              "(the ops are called through tensors/torch_api.py's attention_kernels())")
_TRACEBACK = ("torch's function names as a traceback prints them: text read from the user's error, never an "
              "attribute")
_IPYTHON = "IPython's history names in the user's namespace (In/Out and their shorthands): a key, not an attribute"


def _each(names, reason):
    return dict.fromkeys(names.split(), reason)


#: Private names of other libraries (torch's above all) spelled outside ``tensors/``, with the reason each
#: may be, as ``{module: {name: reason}}``; any other outside ``tensors/`` fails.
FOREIGN_PRIVATE = {
    "preflight.cudalike": _each("_convolution _thnn_fused_lstm_cell _thnn_fused_gru_cell "
                                "_scaled_dot_product_flash_attention _upsample_nearest_exact1d _upsample_nearest_exact2d "
                                "_upsample_nearest_exact3d _upsample_bilinear2d_aa _upsample_bicubic2d_aa "
                                "_addmm_activation _scaled_mm _int_mm _attention_backward", _OPS),
    "preflight.attention": _each("_scaled_dot_product_flash_attention_backward "
                                 "_scaled_dot_product_efficient_attention_backward", _ATTENTION),
    "oom.operation": _each("_scaled_dot_product_attention_math _scaled_dot_product_cudnn_attention",
                           "an attention kernel's op name in the failing traceback or allocation record (a regex "
                           "over text)"),
    "oom.stack": _each("_call_impl _wrapped_call_impl _engine_run_backward", _TRACEBACK),
    "oom.rules.training": _each("_fused_ _multi_tensor_ _foreach_ _single_tensor_",
                                "parts of torch.optim's function names in the failing traceback, which tell the "
                                "optimizer's implementation (text)"),
    "cell.header": {**_each("_ih _oh _dh _i _ii _iii", _IPYTHON),
                      "_actions": "argparse keeps no public list of a parser's options (the magic's help is "
                                  "built from it)"},
    "free.release": _each("_oh", _IPYTHON),
    "ranks.watch": _each("_popen", "multiprocessing's Process keeps its Popen (and so the pid of a spawned "
                                    "process) only there, in Python 3.9 to 3.13; read through vars(), no "
                                    "property runs"),
    "sealed.shims": _each("_posixsubprocess", "CPython's C module behind subprocess, whose fork_exec the seal "
                                              "refuses (found in sys.modules, never imported)"),
    "chart.figures.live": _each("_trait_values", "traitlets keeps a widget's trait values there: the Layout "
                                                 "model ipywidgets made, read without creating one"),
}


def _is_private(name):
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and not (
        name.startswith("__") and name.endswith("__"))


class _Names(ast.NodeVisitor):
    """One pass over a module: the private names it defines where code could reach them as an
    attribute (``defined``: module and class level names, attributes it assigns, ``__slots__``, dict
    keys it stores, names it gives ``setattr``; a function's local variables are no attributes), the
    private names it uses (``uses``: ``(line, kind, name, base)``), its ``import`` statements' names
    (``imports``) and its import statements (``statements``)."""

    def __init__(self, tree):
        self.defined, self.uses, self.imports = set(), [], []
        self.statements = []  # (import statement, under ``if TYPE_CHECKING:``)
        self.depth = 0  # functions we are inside
        self.typing_only = False
        self.skip = set()  # strings that name no attribute: annotations, docstrings, f-string pieces
        self.visit(tree)
        self.defined = frozenset(n for n in self.defined if _is_private(n))

    def _docstring(self, node):
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            self.skip.add(id(node.body[0].value))

    def _no_strings(self, part):
        if part is not None:
            self.skip.update(id(c) for c in ast.walk(part) if isinstance(c, ast.Constant))

    def visit_Module(self, node):
        self._docstring(node)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        if not self.depth:
            self.defined.add(node.name)
        self._docstring(node)
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        if not self.depth:
            self.defined.add(node.name)
        self._docstring(node)
        args = node.args
        for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if a is not None:
                self._no_strings(a.annotation)
        self._no_strings(node.returns)
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_AnnAssign(self, node):
        self._no_strings(node.annotation)
        self.generic_visit(node)

    def visit_JoinedStr(self, node):
        self._no_strings(node)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store) and not self.depth:
            self.defined.add(node.id)

    def visit_Attribute(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.defined.add(node.attr)
        elif _is_private(node.attr):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base not in ("self", "cls"):
                self.uses.append((node.lineno, "attr", node.attr, base))
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            self.defined.add(node.slice.value)
        self.generic_visit(node)

    def visit_Call(self, node):
        if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and (
                getattr(node.func, "id", None) == "setattr" or getattr(node.func, "attr", None) == "__setattr__"):
            self.defined.add(node.args[1].value)
        self.generic_visit(node)

    def visit_Assign(self, node):
        if any(getattr(t, "id", None) == "__slots__" for t in node.targets):
            self.defined.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
        self.generic_visit(node)

    def visit_Constant(self, node):
        if _is_private(node.value) and id(node) not in self.skip:
            self.uses.append((node.lineno, "string", node.value, None))

    def visit_If(self, node):
        if getattr(node.test, "id", None) == "TYPE_CHECKING":
            self.typing_only = True
            self.generic_visit(node)
            self.typing_only = False
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        self.statements.append((node, self.typing_only))
        self.imports.extend(node.names)
        for alias in node.names:
            if any(_is_private(part) for part in alias.name.split(".")):
                self.uses.append((node.lineno, "import", alias.name, None))

    def visit_ImportFrom(self, node):
        self.statements.append((node, self.typing_only))
        self.uses.append((node.lineno, "from", node, None))


@functools.lru_cache(maxsize=None)
def _names(module):
    return _Names(_tree(module))


@functools.lru_cache(maxsize=None)
def _defined_by():
    """private name -> a module that defines it where another module could reach it."""
    found = {}
    for module in MODULES:
        for name in _names(module).defined:
            found.setdefault(name, module)
    return found


def _bindings(module):
    """``(ours, theirs)``: local names bound to a module of the package (name -> module), and names
    bound by an import of anything else."""
    ours, theirs = {}, set()
    package = module.split(".") if _path(module).endswith("__init__.py") else module.split(".")[:-1]
    for _line, kind, node, _base in _names(module).uses:
        if kind != "from":
            continue
        if node.level == 0 and not (node.module or "").startswith("ipy_gpumem"):
            theirs.update(alias.asname or alias.name for alias in node.names)
            continue
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        target = (".".join(base + ([node.module] if node.module else [])) if node.level
                  else node.module[len("ipy_gpumem."):] if node.module != "ipy_gpumem" else "")
        for alias in node.names:
            sub = f"{target}.{alias.name}" if target else alias.name
            if sub in MODULES:
                ours[alias.asname or alias.name] = sub
    for alias in _names(module).imports:
        inside = alias.name.startswith("ipy_gpumem.") and alias.name[len("ipy_gpumem."):] in MODULES
        if inside and alias.asname:
            ours[alias.asname] = alias.name[len("ipy_gpumem."):]
        elif not inside:
            theirs.add(alias.asname or alias.name.split(".")[0])
    return ours, theirs


def _private_uses(module):
    """``(line, what, verdict)`` for every private name ``module`` uses that is not its own: verdict
    ``"ours"`` (another module's), ``"foreign"`` (another library's), or None (allowed anywhere)."""
    names = _names(module)
    own = names.defined
    ours, theirs = _bindings(module)
    # A name defined elsewhere in the package, read on an object here, is another module's private;
    # in tensors/ it is as likely torch's own (``_modules``, ``_snapshot``), which that room may read.
    others = _defined_by() if module.split(".")[0] != "tensors" else {}
    package = module.split(".") if _path(module).endswith("__init__.py") else module.split(".")[:-1]
    for line, kind, name, base in names.uses:
        if kind == "from":
            node = name
            inside = node.level > 0 or (node.module or "").startswith("ipy_gpumem")
            if inside:
                up = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(up + ([node.module] if node.module else [])) if node.level else node.module
                for alias in node.names:
                    if _is_private(alias.name) and target not in (module, f"ipy_gpumem.{module}"):
                        yield line, f"from {target} import {alias.name}", "ours"
            elif any(_is_private(part) for part in (node.module or "").split(".")) or any(
                    _is_private(alias.name) for alias in node.names):
                yield line, f"from {node.module} import {', '.join(a.name for a in node.names)}", "foreign"
        elif kind == "import":
            yield line, f"import {name}", "foreign"
        elif kind == "attr":
            if base in ours:
                yield line, f"{base}.{name} ({ours[base]})", "ours"
            elif name in own:
                continue
            elif base in theirs:
                dotted = f"{base}.{name}"
                yield line, dotted, None if dotted in STDLIB_PRIVATE else "foreign"
            elif name in PUBLIC_UNDERSCORED or _PROTOCOL.fullmatch(name):
                continue
            elif name in others:
                yield line, f".{name} (defined in {others[name]})", "ours"
            else:
                yield line, f".{name}", "foreign"
        elif kind == "string":  # a dict's key, getattr's name: whose, no one can tell; outside tensors/, listed
            if name in own or name in PUBLIC_UNDERSCORED or name.startswith("_ipy_gpumem"):
                continue
            yield line, f'"{name}"', "foreign"


@pytest.mark.slow
def test_no_module_uses_another_modules_private_names():
    """An underscore name is its module's own: imported from another module, read as another module's
    attribute (``other._name``, ``obj._method`` of a class defined elsewhere) or spelled as a string,
    it fails. What is shared is public."""
    found = [f"{module}:{line}: {what}" for module in MODULES for line, what, verdict in _private_uses(module)
             if verdict == "ours"]
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_torch_private_names_are_spelled_in_tensors_only():
    """``tensors/`` is the one room that names torch's internals. Elsewhere, a private name of another
    library (an attribute, a string for getattr or a dict's key, a private module) fails unless
    :data:`FOREIGN_PRIVATE` lists it for that module with its reason."""
    found = []
    for module in MODULES:
        if module.split(".")[0] == "tensors":
            continue
        allowed = FOREIGN_PRIVATE.get(module, {})
        for line, what, verdict in _private_uses(module):
            name = re.sub(r"^\.|^\"|\"$|^\w+\.", "", what)
            if verdict == "foreign" and name not in allowed:
                found.append(f"{module}:{line}: {what}")
    assert not found, "\n".join(found)


def test_every_allowed_private_name_is_still_used():
    """An allowance whose use went away goes too (the list says what is spelled, not what once was)."""
    stale = []
    for module, names in FOREIGN_PRIVATE.items():
        assert module in MODULES, module
        used = {re.sub(r"^\.|^\"|\"$|^\w+\.", "", what) for _, what, verdict in _private_uses(module)
                if verdict == "foreign"}
        stale.extend(f"{module}: {name}" for name in names if name not in used)
    assert not stale, stale


def _graph():
    """module -> the modules of the package it imports (lazy imports too; ``if TYPE_CHECKING:`` ones not)."""
    graph = {}
    for module in MODULES:
        edges = set()
        package = module.split(".") if _path(module).endswith("__init__.py") else module.split(".")[:-1]
        for node, typing_only in _names(module).statements:
            if typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name[len("ipy_gpumem."):] for a in node.names if a.name.startswith("ipy_gpumem.")]
            elif node.level == 0:
                if not (node.module or "").startswith("ipy_gpumem."):
                    continue
                base = node.module[len("ipy_gpumem."):]
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if base else a.name for a in node.names]
            for target in targets:
                while target and target not in MODULES:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def test_no_import_circle():
    """No module imports one that imports it back, directly or through others (a lazy import inside a
    function counts: it hides a circle, it does not remove it)."""
    graph = _graph()
    circles = []
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)
