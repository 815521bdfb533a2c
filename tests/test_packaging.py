"""Packaging: the license shipped, a PEP 517 build backend, a PyPI description without broken images."""
import configparser
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert config["metadata"]["license"] == "BSD-3-Clause" and config["metadata"]["license_files"] == "LICENSE"
    requires = config["options"]["install_requires"]
    assert "torch" not in requires  # the user's, with the CUDA build they chose
    assert "nvidia-ml-py>=12.535.77" in requires
    extras = config["options.extras_require"]
    assert {"widgets", "sidebar", "test"} <= set(extras)


def test_the_readme_install_section_names_every_extra():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    install = readme[readme.index("## Install"):readme.index("## Develop")]
    for needed in ("ipy_gpumem[widgets]", "sidebar", "pandas"):
        assert needed in install, needed
