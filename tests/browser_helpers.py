"""Drive JupyterLab in headless Chromium (Playwright) for tests/test_browser.py.

The recipe is the one in the project notes (NOTES §9): the Debian ``chromium`` binary (no
``playwright install``), a JupyterLab server started from this interpreter on a port it picks
itself (read back from its log), a throw-away root, data, config, runtime and IPython directory
per run, and a kernelspec that runs ``sys.executable``, so the kernel is the environment under
test whatever other kernelspecs the machine has.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "artifacts", "browser")
KERNEL_NAME = "ipy-gpumem-browser-test"

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def find_chromium() -> Optional[str]:
    """The Chromium binary: $IPY_GPUMEM_CHROMIUM, else Debian's /usr/bin/chromium, else PATH."""
    for candidate in (os.environ.get("IPY_GPUMEM_CHROMIUM"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("chromium") or shutil.which("chromium-browser")


def write_kernelspec(data_dir: str, name: str = KERNEL_NAME) -> str:
    """A kernelspec that runs this very interpreter (the venv under test)."""
    kernel_dir = os.path.join(data_dir, "kernels", name)
    os.makedirs(kernel_dir, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",  # what users see; the name (not this) is checked
        "language": "python",
        "metadata": {"debugger": False},
    }
    with open(os.path.join(kernel_dir, "kernel.json"), "w") as fh:
        json.dump(spec, fh, indent=1)
    return name


def write_lab_settings(config_dir: str) -> None:
    """User settings for a quiet, deterministic lab: no news toast, no update check; and widget state
    saved with the notebook (off by default: on, the saved file shows what it would carry)."""
    settings = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false", "checkForUpdates": False},
        "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
        # Every cell drawn, in view or not (the default windowing leaves far cells unrendered).
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, value in settings.items():
        path = os.path.join(config_dir, "lab", "user-settings", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(value, fh)


def write_notebook(path: str, cells, kernel_name: str = KERNEL_NAME) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name, "display_name": kernel_name, "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(nb, path)


class LabServer:
    """``jupyter lab`` from this interpreter, in its own session (so its kernels go down with it)."""

    def __init__(self, base: str):
        self.base = base
        self.root = os.path.join(base, "root")
        self.env_dirs = {name: os.path.join(base, sub) for name, sub in (
            ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython"))}
        for path in [self.root, *self.env_dirs.values()]:
            os.makedirs(path, exist_ok=True)
        write_kernelspec(self.env_dirs["JUPYTER_DATA_DIR"])
        write_lab_settings(self.env_dirs["JUPYTER_CONFIG_DIR"])
        self.log_path = os.path.join(base, "server.log")
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def start(self, timeout: float = 90.0) -> None:
        env = dict(os.environ, **self.env_dirs)
        env.pop("JUPYTER_PATH", None)  # only our data dir and the venv's share/jupyter
        env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0",
               "--IdentityProvider.token=", "--ServerApp.password=", "--allow-root",
               "--LabApp.expose_app_in_browser=True", "--JupyterNotebookApp.expose_app_in_browser=True",
               f"--ServerApp.root_dir={self.root}",
               f"--MappingKernelManager.default_kernel_name={KERNEL_NAME}"]
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        pattern = re.compile(r"http://127\.0\.0\.1:(\d+)/lab")
        while time.monotonic() < deadline:
            match = pattern.search(self.log())
            if match:
                self.port = int(match.group(1))
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"jupyter lab did not report its URL in {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL to its session if it hangs."""
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the server and anything it left behind (kernels) share the session we created
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------------------------------------
# In-page probes (run with page.evaluate)
# ---------------------------------------------------------------------------------------------

#: True once the current main-area widget is notebook ``path`` and its kernel is idle.
KERNEL_READY_JS = """(path) => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  if (!w || !w.context || w.context.path !== path || !w.sessionContext) return false;
  const s = w.sessionContext.session;
  return !!(s && s.kernel && s.kernel.status === 'idle');
}"""

#: Starts "run all" without awaiting it (its promise resolves when every cell has finished).
RUN_ALL_JS = """() => {
  window.__gpumemRunAll = 'pending';
  window.jupyterapp.commands.execute('notebook:run-all-cells').then(
    (r) => { window.__gpumemRunAll = 'resolved:' + r; },
    (e) => { window.__gpumemRunAll = 'rejected:' + e; });
  return true;
}"""

#: Every plotly figure drawn in the notebook and the sidebar: where it is, how it got there (the live
#: widget, or plotly's renderer of a saved figure), its points (the longest line trace) and its x range.
FIGURES_JS = r"""(path) => {
  const app = window.jupyterapp;
  const panel = app && app.shell ? app.shell.currentWidget : null;
  const out = {kernel: null, prompts: [], errors: [], figures: [], images: [], sidecars: [], runAll: window.__gpumemRunAll};
  if (!panel || !panel.content) return out;
  const session = panel.sessionContext && panel.sessionContext.session;
  if (session && session.kernel) out.kernel = session.kernel.status;
  const figure = (gd, cell, trusted) => {
    const lines = (gd.data || []).filter((t) => t.mode === 'lines');
    // The box plotly sizes: a figure collapsed by a resize keeps an SVG of full height inside a 0 px box.
    const drawn = gd.querySelector('.svg-container');
    const box = (drawn || gd).getBoundingClientRect();
    const typed = gd.closest('[data-mime-type]');
    const full = gd._fullLayout || {};
    return {cell, points: lines.reduce((n, t) => Math.max(n, (t.x || []).length), 0), traces: (gd.data || []).length,
            names: (gd.data || []).map((t) => t.name || ''),
            range: gd.layout && gd.layout.xaxis && gd.layout.xaxis.range ? [...gd.layout.xaxis.range] : null,
            autorange: full.xaxis ? full.xaxis.autorange : null, width: Math.round(box.width),
            visible: box.width > 0 && box.height > 0, inSidecar: !!gd.closest('.jupyterlab-sidecar'),
            inRight: !!gd.closest('#jp-right-stack'),
            // plotly's renderer draws a saved figure (its output element is the plot); else it is the widget
            mime: gd.classList.contains('jp-RenderedPlotly') ? 'application/vnd.plotly.v1+json'
                  : (typed ? typed.getAttribute('data-mime-type') : 'application/vnd.jupyter.widget-view+json'),
            trusted: trusted === undefined ? null : trusted,
            title: full.title && full.title.text ? String(full.title.text).slice(0, 300) : ''};
  };
  panel.content.widgets.forEach((cell, i) => {
    const prompt = cell.node.querySelector('.jp-InputArea-prompt');
    out.prompts.push(prompt ? prompt.textContent.trim() : null);
    const outputs = cell.model && cell.model.outputs ? cell.model.outputs.toJSON() : [];
    outputs.filter((o) => o.output_type === 'error').forEach((o) => {
      const tb = (o.traceback || []).join('\n').replace(/\u001b\[[0-9;]*m/g, '');
      out.errors.push({cell: i, text: `${o.ename}: ${o.evalue}\n${tb.slice(-1500)}`});
    });
    const trusted = cell.model ? !!cell.model.trusted : null;
    // an image output, or the PNG plotly's renderer saved beside a figure and shows where it may not run
    cell.node.querySelectorAll('.jp-RenderedImage img, .jp-RenderedPlotly img.plot-img').forEach((img) => {
      const box = img.getBoundingClientRect();
      out.images.push({cell: i, visible: img.naturalWidth > 0 && box.width > 0 && box.height > 0, trusted,
                       width: Math.round(box.width)});
    });
    cell.node.querySelectorAll('.js-plotly-plot').forEach((gd) => {
      if (!gd.parentElement || !gd.parentElement.closest('.js-plotly-plot')) out.figures.push(figure(gd, i, trusted));
    });
  });
  document.querySelectorAll('.jupyterlab-sidecar').forEach((sc) => {
    const box = sc.getBoundingClientRect();
    out.sidecars.push({inRight: !!sc.closest('#jp-right-stack'), visible: box.width > 0,
                       figures: [...sc.querySelectorAll('.js-plotly-plot')].map((gd) => figure(gd, null))});
  });
  return out;
}"""
