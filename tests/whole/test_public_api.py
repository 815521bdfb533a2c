"""The public surface: every name of ``ipy_gpumem.__all__`` imports from the top, the public types load
only when first named, and the errors the API raises are the ones importable from the top."""
import ast
import subprocess
import sys

import pytest

import ipy_gpumem

#: Each public type and the module that defines it.
TYPES = {
    "CellRecord": "ipy_gpumem.core.records",
    "OomReport": "ipy_gpumem.oom.parse.report",
    "WhoReport": "ipy_gpumem.attribution.who",
    "Estimate": "ipy_gpumem.preflight.result",
    "EstimateError": "ipy_gpumem.preflight.result",
    "SnapshotReport": "ipy_gpumem.snapshots.report",
    "SnapshotError": "ipy_gpumem.snapshots.stream",
}


def test_importing_the_package_loads_none_of_the_types_modules():
    """``import ipy_gpumem`` (and so ``%load_ext``) pays nothing for the types: a fresh interpreter."""
    code = "import sys, ipy_gpumem\nprint(sorted(m for m in sys.modules if m.startswith('ipy_gpumem')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert "ipy_gpumem" in loaded
    assert not set(loaded) & set(TYPES.values()), loaded
    assert not [m for m in loaded if m.startswith(("ipy_gpumem.preflight", "ipy_gpumem.snapshots", "ipy_gpumem.oom",
                                                    "ipy_gpumem.attribution", "ipy_gpumem.cell"))], loaded


@pytest.mark.parametrize("name", ipy_gpumem.__all__)
def test_each_public_name_imports_from_the_top_and_is_listed(name):
    namespace = {}
    exec(f"from ipy_gpumem import {name}", namespace)  # the spelling a user writes
    assert namespace[name] is getattr(ipy_gpumem, name)
    assert name in dir(ipy_gpumem)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_each_type_is_its_rooms_class(name):
    cls = getattr(ipy_gpumem, name)
    assert isinstance(cls, type) and cls.__module__ == TYPES[name] and cls.__name__ == name
    assert cls is getattr(sys.modules[TYPES[name]], name)
    assert name in ipy_gpumem.__all__


def test_star_import_gives_every_public_name_and_an_unknown_name_is_an_attribute_error():
    namespace = {}
    exec("from ipy_gpumem import *", namespace)
    assert set(ipy_gpumem.__all__) <= set(namespace)
    assert not hasattr(ipy_gpumem, "NoSuchThing")
    with pytest.raises(AttributeError, match="'ipy_gpumem' has no attribute 'NoSuchThing'"):
        ipy_gpumem.NoSuchThing  # noqa: B018


def test_the_errors_the_api_raises_are_the_ones_at_the_top():
    assert issubclass(ipy_gpumem.EstimateError, Exception) and issubclass(ipy_gpumem.SnapshotError, Exception)
    with pytest.raises(ipy_gpumem.SnapshotError):
        ipy_gpumem.snapshot(b"not a snapshot")
    with pytest.raises(ipy_gpumem.EstimateError):
        ipy_gpumem.estimate(42)  # refused before anything runs: no sealed copy is made
