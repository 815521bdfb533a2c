"""Packaging: the license shipped, a PEP 517 build backend, a PyPI description without broken images,
metadata as PyPI shows it, and an sdist whose tests collect."""
import configparser
import email.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/whole/ -> the checkout


def _setup_module():
    spec = importlib.util.spec_from_file_location("ipy_gpumem_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its setup() call only runs as __main__
    return module


def test_the_pypi_description_has_no_relative_image():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert re.search(r"!\[[^\]]*\]\((?!https?://)", readme), "the README shows a screenshot from docs/"
    setup = _setup_module()
    for base in ("", "https://example.org/ipy_gpumem/raw/main"):
        described = setup.pypi_description(readme, base)
        assert not re.search(r"!\[[^\]]*\]\((?!https?://)", described)
    assert "https://example.org/ipy_gpumem/raw/main/docs/chart-jupyterlab.png" in setup.pypi_description(
        readme, "https://example.org/ipy_gpumem/raw/main")


def test_license_build_backend_and_metadata():
    license_text = open(os.path.join(ROOT, "LICENSE"), encoding="utf-8").read()
    assert "BSD 3-Clause License" in license_text
    assert "build-backend = \"setuptools.build_meta\"" in open(os.path.join(ROOT, "pyproject.toml")).read()
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    assert config["metadata"]["license_expression"] == "BSD-3-Clause" and config["metadata"]["license_files"] == "LICENSE"
    assert "License ::" not in config["metadata"]["classifiers"]  # superseded by the SPDX expression
    requires = config["options"]["install_requires"]
    assert "torch" not in requires  # the user's, with the CUDA build they chose
    assert "nvidia-ml-py>=12.535.77" in requires
    assert "plotly>=5.24" in requires and "ipywidgets>=7.7" in requires
    extras = config["options.extras_require"]
    assert {"widgets", "sidebar", "test"} <= set(extras)


def test_the_readme_install_section_names_every_extra():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    install = readme[readme.index("## Install"):readme.index("## Develop")]
    for needed in ("ipy_gpumem[sidebar]", "pandas", "plotly", "ipywidgets"):
        assert needed in install, needed
    assert "ipy_gpumem[widgets]" in install  # the extra is empty now: the README says it still installs


def test_the_readme_says_how_to_get_the_cpu_wheel():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    develop = readme[readme.index("## Develop"):readme.index("<!-- ci:setup -->")]
    assert 'pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu' in develop
    setup = readme[readme.index("<!-- ci:setup -->"):readme.index("<!-- /ci:setup -->")]
    assert '"torch==2.13.0"' in setup  # the same version, so the setup command keeps the CPU wheel


# -- the source distribution, built as pip builds it (setuptools' PEP 517 backend) -------------------

_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist",
                                      "artifacts", "demo-out", ".pytest_cache", ".hypothesis", "*.py[cod]")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist built from a copy of the checkout (the checkout's own egg-info stays untouched),
    unpacked: (its folder, PKG-INFO as a message, everything the build printed)."""
    work = tmp_path_factory.mktemp("sdist")
    tree = work / "tree"
    shutil.copytree(ROOT, tree, ignore=_NOT_SOURCES)
    build = subprocess.run(
        [sys.executable, "-W", "default", "-c",
         "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))", str(work / "dist")],
        cwd=tree, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    name = build.stdout.strip().splitlines()[-1]
    with tarfile.open(work / "dist" / name) as archive:
        archive.extractall(work / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = (work / "unpacked").iterdir()
    pkg_info = email.parser.Parser().parsestr((unpacked / "PKG-INFO").read_text(encoding="utf-8"))
    return unpacked, pkg_info, build.stdout + build.stderr


@pytest.mark.slow
def test_the_build_prints_no_warning(sdist):
    _, _, printed = sdist
    assert "License classifiers are deprecated" not in printed
    assert not re.search(r"(?i)warning", printed), printed


@pytest.mark.slow
def test_the_built_metadata(sdist):
    _, info, _ = sdist
    assert "a %%gpumem magic" in info["Summary"]  # configparser's interpolation keeps both signs
    assert info["License-Expression"] == "BSD-3-Clause"
    assert not [c for c in info.get_all("Classifier") if c.startswith("License ::")]
    urls = dict(u.split(", ", 1) for u in info.get_all("Project-URL"))
    assert {"Homepage", "Source", "Issues"} <= set(urls)
    assert all(u.startswith("https://github.com/ipy-gpumem/ipy_gpumem") for u in urls.values())
    requires = info.get_all("Requires-Dist")
    assert "plotly>=5.24" in requires and "ipywidgets>=7.7" in requires  # what Google Colab carries
    assert any(r.startswith("notebook>=7") and 'extra == "browser"' in r for r in requires)
    description = info.get_payload()
    assert "![" in description and not re.search(r"!\[[^\]]*\]\((?!https?://)", description)
    assert "(https://github.com/ipy-gpumem/ipy_gpumem/raw/main/docs/chart-jupyterlab.png)" in description


@pytest.mark.slow
def test_the_sdist_ships_everything_the_tests_need(sdist):
    unpacked, _, _ = sdist
    for needed in ("conftest.py", "kernel_helpers.py", "browser_helpers.py", "thread_fixtures.py", "fixtures"):
        assert (unpacked / "tests" / needed).exists(), needed
    try:
        tracked = subprocess.run(["git", "ls-files", "tests"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=60).stdout.split()
    except OSError:  # no git: an unpacked sdist itself
        tracked = []
    missing = [path for path in tracked if not (unpacked / path).exists()]
    assert not missing, missing


@pytest.mark.slow
def test_pytest_collects_every_test_in_the_unpacked_sdist(sdist):
    unpacked, _, _ = sdist
    # the unpacked sdist's own configuration alone (CI's PYTEST_ADDOPTS would start xdist workers); collecting needs
    # no assertion rewriting (half the collection's CPU: every test module rewritten again in a fresh folder)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "--assert=plain"],
                               cwd=unpacked, capture_output=True, text=True, timeout=600, env=env)
    tail = collected.stdout[-3000:] + collected.stderr[-3000:]
    assert collected.returncode == 0, tail
    assert re.search(r"\d+ tests collected", collected.stdout) and " error" not in collected.stdout.splitlines()[-1], tail
