"""Command line: ``python -m ipy_gpumem demo`` runs the quickstart notebook in a real kernel and writes HTML."""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.join(os.path.dirname(HERE), "notebooks")


def run_notebook(path: str, out_dir: str, timeout: int = 600) -> str:
    """Execute ``path`` in a fresh kernel of this interpreter; write the .ipynb and .html to ``out_dir``."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(path, as_version=4)
    os.makedirs(out_dir, exist_ok=True)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": out_dir}})
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable  # this interpreter, whatever kernelspecs are installed
    sockets = None
    if os.name == "posix":
        # Unix sockets in a folder only we can open, rather than TCP ports any local user can reach (the
        # kernel warns about those on every start: "running over TCP without encryption").
        import tempfile

        sockets = tempfile.mkdtemp(prefix="ipy_gpumem-demo-")
        client.km.transport, client.km.ip = "ipc", os.path.join(sockets, "kernel")
    try:
        client.execute()
    finally:
        if sockets is not None:
            import shutil

            shutil.rmtree(sockets, ignore_errors=True)
    stem = os.path.splitext(os.path.basename(path))[0]
    nbformat.write(nb, os.path.join(out_dir, stem + ".ipynb"))
    html, _ = HTMLExporter().from_notebook_node(nb)
    html_path = os.path.join(out_dir, stem + ".html")
    with open(html_path, "w", encoding="utf-8") as fh:
        fh.write(html)
    return html_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ipy_gpumem", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="execute a demo notebook (CPU is fine) and write it out as HTML")
    demo.add_argument("notebook", nargs="?", default="quickstart",
                      help="quickstart (default), oom_walkthrough, or a path to a .ipynb")
    demo.add_argument("--out", default="demo-out", help="where to write the executed notebook and HTML (default: demo-out)")
    demo.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default: 600)")
    args = parser.parse_args(argv)
    if args.command != "demo":
        parser.print_help()
        return 2
    path = args.notebook
    if not path.endswith(".ipynb"):
        path = os.path.join(NOTEBOOKS, path + ".ipynb")
    if not os.path.exists(path):
        print(f"ipy_gpumem demo: no notebook at {path} (run it from a checkout of the repository, "
              "or pass the path of a .ipynb)", file=sys.stderr)
        return 1
    try:
        import nbclient  # noqa: F401
        import nbconvert  # noqa: F401
    except ImportError:
        print("ipy_gpumem demo needs nbclient and nbconvert: pip install 'ipy_gpumem[demo]'", file=sys.stderr)
        return 1
    start = time.perf_counter()
    html = run_notebook(path, args.out, args.timeout)
    print(f"executed {os.path.basename(path)} in {time.perf_counter() - start:.1f} s -> {html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
