"""pytest plugin for tools/ipython_suite.py: records every test's outcome, and (in the "ext" mode)
loads ipy_gpumem into IPython's global test shell as soon as that shell exists.

Passed to pytest with ``-p ipy_gpumem_suite_plugin`` (this directory on PYTHONPATH). Configured by
the environment, so that IPython's own conftest and options stay untouched:

    IPY_GPUMEM_SUITE_MODE     "plain" (record only) or "ext" (load the extension, then record)
    IPY_GPUMEM_SUITE_RESULTS  where to write the JSON outcomes at the end of the session
    IPY_GPUMEM_SUITE_CURRENT  (optional) a file holding the id of the test now running, so that a
                              run killed for hanging can say where it hung
    IPY_GPUMEM_SUITE_OVERLAY  (IPython 7/8 layout only) the run folder holding IPython/conftest.py
                              and IPython/core/tests/: modules under IPython.* found there (and
                              only those) are imported from there; all else from the installed
                              IPython

IPython's global test shell is the ``TerminalInteractiveShell`` singleton: IPython 9 creates it
when ``tests/conftest.py`` is imported, IPython 7/8 in ``IPython/conftest.py``, and older set-ups
through ``IPython.testing.globalipapp.start_ipython()``. All of them go through
``TerminalInteractiveShell.instance()``, so the plugin looks for that singleton after the initial
conftests are loaded (``pytest_configure``), and again before each collector and each test, and
loads the extension the first time it finds one. It never creates a shell itself.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import traceback

import pytest

MODE = os.environ.get("IPY_GPUMEM_SUITE_MODE", "plain")
RESULTS = os.environ.get("IPY_GPUMEM_SUITE_RESULTS")
CURRENT = os.environ.get("IPY_GPUMEM_SUITE_CURRENT")
OVERLAY = os.environ.get("IPY_GPUMEM_SUITE_OVERLAY")
EXTENSION = "ipy_gpumem"

_outcomes: dict = {}  # nodeid -> {"outcome": ..., "when": ..., "text": ...}
_ext = {"mode": MODE, "loaded_into": None, "load_error": None, "loaded_at": None,
        "still_loaded_at_end": None, "same_shell_at_end": None, "module": None, "cells_recorded": None}
_shell = None



class _TestsOverlay(importlib.abc.MetaPathFinder):
    """IPython 7/8 keep their tests inside the package (IPython.core.tests, IPython.conftest), and
    the tests rely on those names (relative imports, expected reprs). The sdist's copies live in the
    run folder next to stub IPython/__init__.py files; this finder serves exactly the modules that
    exist there and are not stubs, so the tests keep their names while IPython itself is the
    installed one. Submodules of an overlaid package are found through its __path__ as usual."""

    def __init__(self, root):
        self.root = os.path.abspath(root)

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("IPython."):
            return None
        base = os.path.join(self.root, *fullname.split("."))
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(init):
            with open(init, encoding="utf-8") as f:
                if "tools/ipython_suite.py" in f.readline():
                    return None  # a stub: the installed package is the real one
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[base])
        if os.path.isfile(base + ".py") and fullname.count(".") == 1:  # IPython.conftest
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


if OVERLAY:
    import IPython  # noqa: F401,E402 - the installed one, before pytest puts the run folder on sys.path

    sys.meta_path.insert(0, _TestsOverlay(OVERLAY))

_RANK = {"passed": 0, "skipped": 0, "xfailed": 0, "xpassed": 0, "failed": 2, "error": 2}


def _global_shell():
    # Never import IPython just to look: a run that has not imported it has no shell yet.
    core = sys.modules.get("IPython.core.interactiveshell")
    if core is None:
        return None
    return getattr(core.InteractiveShell, "_instance", None)


def _ensure_loaded(where):
    global _shell
    if MODE != "ext" or _shell is not None or _ext["load_error"] is not None:
        return
    shell = _global_shell()
    if shell is None:
        return
    _shell = shell
    _ext["loaded_into"] = "%s.%s at 0x%x" % (type(shell).__module__, type(shell).__name__, id(shell))
    _ext["loaded_at"] = where
    try:
        shell.events.register("pre_run_cell", _count_cell)
        result = shell.run_line_magic("load_ext", EXTENSION)
        if EXTENSION not in shell.extension_manager.loaded:
            raise RuntimeError("%%load_ext %s returned %r but the extension is not loaded" % (EXTENSION, result))
        _ext["module"] = getattr(sys.modules.get(EXTENSION), "__file__", None)
    except BaseException:  # report it: a run with the extension silently missing proves nothing
        _ext["load_error"] = traceback.format_exc()
        _write_results(3)  # pytest stops here (INTERNALERROR): no sessionfinish will write them
        raise


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    _ensure_loaded("pytest_configure")


@pytest.hookimpl(tryfirst=True)
def pytest_collectstart(collector):
    _ensure_loaded("collect %s" % collector.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _ensure_loaded("setup %s" % item.nodeid)


_cells = {"now": None, "counts": {}}


def _count_cell(*args):
    # which tests run cells through the shell the extension is loaded into (tools/ipython_suite.py --shell-files)
    if _cells["now"] is not None:
        _cells["counts"][_cells["now"]] = _cells["counts"].get(_cells["now"], 0) + 1


def pytest_runtest_logstart(nodeid, location):
    _cells["now"] = nodeid
    if CURRENT:
        with open(CURRENT, "w", encoding="utf-8") as f:
            f.write(nodeid)


def _record(nodeid, outcome, when, text):
    old = _outcomes.get(nodeid)
    if old is not None and _RANK[old["outcome"]] >= _RANK[outcome] and old["outcome"] != "passed":
        return  # keep the first failure (a teardown error after a failed call adds nothing new)
    if old is not None and old["outcome"] in ("skipped", "xfailed") and outcome == "passed":
        return  # a passing teardown after a skip
    _outcomes[nodeid] = {"outcome": outcome, "when": when, "text": text}


def pytest_runtest_logreport(report):
    text = report.longreprtext if report.failed else ""
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    if report.when != "call" and outcome == "passed":
        _outcomes.setdefault(report.nodeid, {"outcome": "passed", "when": report.when, "text": ""})
        return
    _record(report.nodeid, outcome, report.when, text)


def pytest_collectreport(report):
    if report.failed:
        _record("<collect> " + (report.nodeid or "."), "error", "collect", report.longreprtext)
    elif report.skipped:  # a whole module skipped (pytest.importorskip at module level)
        _record("<collect> " + (report.nodeid or "."), "skipped", "collect", "")


def pytest_sessionfinish(session, exitstatus):
    _ext["extension_imported"] = EXTENSION in sys.modules
    if MODE == "ext" and _shell is not None:
        _ext["still_loaded_at_end"] = EXTENSION in _shell.extension_manager.loaded
        _ext["same_shell_at_end"] = _global_shell() is _shell
        try:  # evidence that the hooks ran: how many cells the extension recorded
            _ext["cells_recorded"] = len(sys.modules[EXTENSION].history())
        except Exception as exc:  # noqa: BLE001 - informational only
            _ext["cells_recorded"] = "? (%s: %s)" % (type(exc).__name__, exc)
    _write_results(exitstatus)


def _write_results(exitstatus):
    if RESULTS:
        with open(RESULTS, "w", encoding="utf-8") as f:
            json.dump({"exitstatus": int(exitstatus), "extension": _ext, "outcomes": _outcomes,
                       "cells_by_test": _cells["counts"]}, f, indent=1)


def pytest_terminal_summary(terminalreporter):
    if MODE != "ext":
        return
    if _ext["load_error"]:
        terminalreporter.write_line("ipy_gpumem could NOT be loaded into the global shell:\n" + _ext["load_error"], red=True)
    elif _shell is None:
        terminalreporter.write_line("ipy_gpumem was never loaded: no global IPython shell appeared", red=True)
    else:
        terminalreporter.write_line("ipy_gpumem (%s) was loaded into %s at %s; still loaded at the end: %s"
                                    % (_ext["module"], _ext["loaded_into"], _ext["loaded_at"], _ext["still_loaded_at_end"]))
