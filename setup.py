"""Packaging: the metadata is in setup.cfg; this only turns README.md into a description PyPI can show.

PyPI renders the long description on its own site, where a relative image (``docs/...png``)
resolves to nothing. With a project URL in setup.cfg (``[metadata] url``) relative images point
at the file in the repository; without one they become their alt text and say where the file is.
"""
import configparser
import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
_IMAGE = re.compile(r"!\[([^\]]*)\]\((?!https?://)([^)\s]+)\)")


def pypi_description(markdown: str, base_url: str = "") -> str:
    """``markdown`` with every relative image made absolute against ``base_url``, or, without a
    base URL, replaced by its alt text and the file's path in the source distribution."""
    if base_url:
        return _IMAGE.sub(lambda m: f"![{m.group(1)}]({base_url.rstrip('/')}/{m.group(2)})", markdown)
    return _IMAGE.sub(lambda m: f"*{m.group(1)} (screenshot: `{m.group(2)}` in the source distribution)*", markdown)


def _base_url() -> str:
    config = configparser.ConfigParser()
    config.read(os.path.join(HERE, "setup.cfg"), encoding="utf-8")
    url = config.get("metadata", "url", fallback="").strip()
    return f"{url}/raw/main" if url else ""


if __name__ == "__main__":
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as fh:
        setup(long_description=pypi_description(fh.read(), _base_url()), long_description_content_type="text/markdown")
