"""The core imports neither IPython, torch, plotly nor ipywidgets; importing the package does nothing."""
import ast
import os
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ipy_gpumem")


def _modules(layer):
    folder = os.path.join(PKG, layer)
    return sorted(f"{layer}.{n[:-3]}" for n in os.listdir(folder) if n.endswith(".py") and n != "__init__.py")


# The pure core, and the display layer's string renderers: none may import IPython, torch,
# plotly or ipywidgets at import time (widget views import them inside the functions that draw).
CORE = _modules("core")
DISPLAY = _modules("display")
HEAVY = ("IPython", "torch", "plotly", "ipywidgets", "pynvml", "pandas", "psutil")


def _imports(module, top_level_only):
    """(imported name, level) for each import in ``module`` ('core.units' style)."""
    path = os.path.join(PKG, *module.split(".")) + ".py"
    tree = ast.parse(open(path, encoding="utf-8").read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def test_the_layers_are_where_the_file_tree_says():
    assert "core.units" in CORE and "core.probes" in CORE and "core.oom" in CORE
    assert "display.render" in DISPLAY and "display.chart" in DISPLAY
    top = sorted(n for n in os.listdir(PKG) if n.endswith(".py"))
    assert top == ["__init__.py", "__main__.py", "extension.py"], top


def test_importing_the_core_imports_nothing_heavy():
    code = (
        "import sys, importlib\n"
        f"for m in {CORE + DISPLAY!r}: importlib.import_module('ipy_gpumem.' + m)\n"
        "import ipy_gpumem\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", CORE + DISPLAY)
def test_core_modules_do_not_name_ipython_at_module_level(module):
    for name, level in _imports(module, top_level_only=True):  # lazy imports inside functions are the point
        if level == 0:
            assert name.split(".")[0] not in HEAVY, f"{module} imports {name} at module level"


@pytest.mark.parametrize("module", CORE)
def test_the_core_never_reaches_up_into_display_or_ipython(module):
    for name, level in _imports(module, top_level_only=False):
        if level == 0:
            assert name.split(".")[0] not in ("IPython", "ipywidgets", "plotly"), f"{module} imports {name}"
            assert not name.startswith("ipy_gpumem."), f"{module} imports {name}: use a relative import"
        else:
            assert level == 1, f"{module} imports from outside the core ({'.' * level}{name})"


@pytest.mark.parametrize("module", DISPLAY)
def test_display_never_imports_the_extension(module):
    for name, level in _imports(module, top_level_only=False):
        assert not (level >= 2 and name.split(".")[0] == "extension"), f"{module} imports the IPython module"
        if level >= 2:
            assert name.split(".")[0] == "core", f"{module} imports {'.' * level}{name}"


def test_every_module_says_what_it_is_for():
    for folder, _, names in os.walk(PKG):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()))
            assert doc, f"{os.path.relpath(path, PKG)} has no module docstring"


def test_load_ext_imports_only_the_per_cell_path():
    """%load_ext must stay fast: the chart, the OOM panel and who() load when first used."""
    code = (
        "import sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'ipy_gpumem')\n"
        "ip.run_cell('x = 1', store_history=True)\n"
        "lazy = ('ipy_gpumem.core.oom', 'ipy_gpumem.core.attribution', 'ipy_gpumem.core.diagnose', 'ipy_gpumem.display.chart',\n"
        "        'ipy_gpumem.display.svgchart', 'ipy_gpumem.display.live', 'ipy_gpumem.core.linetrace', 'plotly', 'ipywidgets', 'torch')\n"
        "print(sorted(m for m in lazy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
