"""The core imports neither IPython, torch, plotly nor ipywidgets; importing the package does nothing."""
import ast
import os
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ipy_gpumem")
# The pure core, and the display layer's string renderers: none may import IPython, torch,
# plotly or ipywidgets at import time (widget views import them inside the functions that draw).
CORE = ["units", "probes", "records", "recorder", "linetrace", "oom", "attribution", "diagnose", "timeline",
        "sampler", "observer", "release"]
DISPLAY = ["render", "panel", "svgchart", "chart", "explainer", "live"]
HEAVY = ("IPython", "torch", "plotly", "ipywidgets", "pynvml", "pandas", "psutil")


def test_importing_the_core_imports_nothing_heavy():
    present = [m for m in CORE + DISPLAY if os.path.exists(os.path.join(PKG, m + ".py"))]
    code = (
        "import sys, importlib\n"
        f"for m in {present!r}: importlib.import_module('ipy_gpumem.' + m)\n"
        "import ipy_gpumem\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", CORE + DISPLAY)
def test_core_modules_do_not_name_ipython_at_module_level(module):
    path = os.path.join(PKG, module + ".py")
    if not os.path.exists(path):
        pytest.skip(f"{module}.py not written yet")
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in tree.body:  # module level only: lazy imports inside functions are the point
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in HEAVY, f"{module}.py imports {name} at module level"


def test_every_module_says_what_it_is_for():
    for name in sorted(os.listdir(PKG)):
        if name.endswith(".py"):
            doc = ast.get_docstring(ast.parse(open(os.path.join(PKG, name), encoding="utf-8").read()))
            assert doc, f"{name} has no module docstring"


def test_load_ext_imports_only_the_per_cell_path():
    """%load_ext must stay fast: the chart, the OOM panel and who() load when first used."""
    code = (
        "import sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'ipy_gpumem')\n"
        "ip.run_cell('x = 1', store_history=True)\n"
        "lazy = ('ipy_gpumem.oom', 'ipy_gpumem.attribution', 'ipy_gpumem.diagnose', 'ipy_gpumem.chart',\n"
        "        'ipy_gpumem.svgchart', 'ipy_gpumem.live', 'ipy_gpumem.linetrace', 'plotly', 'ipywidgets', 'torch')\n"
        "print(sorted(m for m in lazy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
