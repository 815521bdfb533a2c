"""Drive JupyterLab in headless Chromium (Playwright) for tests/whole/test_browser.py.

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


def write_lab_settings(config_dir: str, save_widget_state: bool = False) -> None:
    """User settings for a quiet, deterministic lab: no news toast, no update check; widget state saved
    with the notebook only when asked (off, as JupyterLab and Notebook 7 ship)."""
    settings = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false", "checkForUpdates": False},
        "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": save_widget_state},
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
        # Kernels on Unix sockets (named after their connection files in the runtime folder), not on TCP ports
        # picked by binding and releasing them, which a kernel another test starts at once can take (see
        # kernel_helpers.on_private_sockets); only where the socket's path fits in the 107 bytes Unix allows.
        if len(os.path.join(self.env_dirs["JUPYTER_RUNTIME_DIR"], "kernel-%s-ipc-99999" % ("0" * 36))) <= 107:
            cmd.append("--KernelManager.transport=ipc")
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

#: A stand-in for a busy machine, labelled as such: anywidget (0.9.16 and later) gives a model 2 s
#: (``AbortSignal.timeout(2000)``, which nothing else in JupyterLab or Notebook 7 uses) to load its
#: JavaScript, then drops every message to that model for good. On CI's two busy cores the page is often
#: still loading plotly.js then; here the 2 s end at once, so the live chart is tested the way it failed.
ANYWIDGET_DEADLINE_PASSED_JS = """(() => {
  const timeout = AbortSignal.timeout.bind(AbortSignal);
  AbortSignal.timeout = (ms) => timeout(ms === 2000 ? 0 : ms);
})();"""

#: The page as a user sees it: per cell its prompt and the plotly figures ipy_gpumem names
#: (``layout.meta``): drawn, their points (the longest series), their traces (name, uid, legend visibility),
#: the x range, their width and their output's, whether plotly's renderer shows a cached PNG instead, whether
#: their output is hidden; the pictures shown until a live figure is drawn; the figures in JupyterLab's
#: sidebar; each output's text (not a figure's); error outputs, stderr and widget errors ("Error displaying
#: widget: model not found").
CHARTS_JS = r"""(path) => {
  const app = window.jupyterapp;
  const panel = app && app.shell ? app.shell.currentWidget : null;
  const out = {prompts: [], errors: [], figures: [], pictures: [], sidebar: [], outputs: [], kernel: null};
  if (!panel || !panel.content || (path && (!panel.context || panel.context.path !== path))) return out;
  const session = panel.sessionContext && panel.sessionContext.session;
  if (session && session.kernel) out.kernel = session.kernel.status;
  const figure = (gd, cell) => {
    const box = (gd.querySelector('.svg-container') || gd).getBoundingClientRect();
    const output = gd.closest('.jp-OutputArea-child');
    const full = gd._fullLayout || {};
    const series = (gd.data || []).filter((t) => String(t.uid || '').startsWith('series-'));
    const png = gd.parentElement && gd.parentElement.querySelector('img.plot-img');
    return {cell, meta: gd.layout ? String(gd.layout.meta || '') : '', drawn: !!gd.querySelector('.main-svg'),
            points: series.reduce((n, t) => Math.max(n, (t.x || []).length), 0),
            traces: (gd.data || []).map((t) => ({name: String(t.name || ''), uid: String(t.uid || ''),
                                                 visible: t.visible === undefined ? true : t.visible})),
            range: full.xaxis && full.xaxis.range ? [...full.xaxis.range] : null,
            autorange: full.xaxis ? full.xaxis.autorange : null, width: Math.round(box.width),
            outputWidth: gd.closest('.jp-OutputArea-output') ? Math.round(gd.closest('.jp-OutputArea-output').getBoundingClientRect().width) : 0,
            png: !!(png && png.getBoundingClientRect().width > 0),
            hidden: !!(output && output.style.display === 'none') || box.width === 0,
            inSidebar: !!gd.closest('.jupyterlab-sidecar'), inRight: !!gd.closest('#jp-right-stack')};
  };
  const ours = (gd) => gd.layout && String(gd.layout.meta || '').startsWith('ipy-gpumem-');
  panel.content.widgets.forEach((cell, i) => {
    const prompt = cell.node.querySelector('.jp-InputArea-prompt');
    out.prompts.push(prompt ? prompt.textContent.trim() : null);
    const outputs = cell.model && cell.model.outputs ? cell.model.outputs.toJSON() : [];
    outputs.forEach((o) => {
      const strip = (text) => String(text).replace(/\u001b\[[0-9;]*m/g, '');
      if (o.output_type === 'error') out.errors.push({cell: i, text: strip(`${o.ename}: ${o.evalue}`)});
      if (o.output_type === 'stream' && o.name === 'stderr') out.errors.push({cell: i, text: strip(o.text)});
    });
    cell.node.querySelectorAll('.js-plotly-plot').forEach((gd) => { if (ours(gd)) out.figures.push(figure(gd, i)); });
    cell.node.querySelectorAll('div[class^="ipy-gpumem-"][class*="-picture"] img').forEach((img) => {
      out.pictures.push({cell: i, visible: img.getBoundingClientRect().width > 0});
    });
    cell.node.querySelectorAll('.jp-OutputArea-output').forEach((o) => {
      if (/Error displaying widget|model not found/.test(o.textContent)) out.errors.push({cell: i, text: o.textContent.slice(0, 300)});
      if (!o.querySelector('.js-plotly-plot')) out.outputs.push({cell: i, text: o.textContent.slice(0, 400)});
    });
  });
  document.querySelectorAll('.jupyterlab-sidecar').forEach((sc) => {
    const box = sc.getBoundingClientRect();
    out.sidebar.push({inRight: !!sc.closest('#jp-right-stack'), width: Math.round(box.width), visible: box.width > 0,
                      figures: [...sc.querySelectorAll('.js-plotly-plot')].filter(ours).map((gd) => figure(gd, null))});
  });
  return out;
}"""


def run_command_js(command: str) -> str:
    """A page function that starts a JupyterLab command without awaiting it (run-all resolves when cells end)."""
    return f"() => {{ window.jupyterapp.commands.execute({command!r}); return true; }}"


#: Starts a watch of the page at every animation frame, read back with ``TIMES_JS``: per cell (by index) when
#: a chart of ipy_gpumem was first visible in its outputs (its picture or its figure, ``shown``; its width and
#: the output's then), when its figure was first drawn and visible (``figure``); the same for JupyterLab's
#: sidebar (``side``, ``sideFigure``, with the sidebar's width); and the kernel's own time of each
#: ``execute_reply`` by execution count (``replies``: the cell's end, before the page had the time to show
#: anything). Times are ``Date.now()`` milliseconds, the kernel's clock on the same machine.
WATCH_JS = r"""() => {
  const T = window.__gpumemTimes = {shown: {}, figure: {}, side: null, sideFigure: null, replies: {}};
  const visible = (el) => el.getBoundingClientRect().width > 0;
  const ours = (gd) => gd.layout && String(gd.layout.meta || '').startsWith('ipy-gpumem-') && gd.querySelector('.main-svg');
  const chart = (root) => {
    const picture = [...root.querySelectorAll('div[class^="ipy-gpumem-"][class*="-picture"] img')].find(
      (img) => img.complete && img.naturalWidth > 0 && visible(img));
    const gd = [...root.querySelectorAll('.js-plotly-plot')].find((g) => ours(g) && visible(g));
    return {el: gd || picture || null, figure: gd || null};
  };
  const width = (el) => Math.round(el.getBoundingClientRect().width);
  const tick = () => {
    const panel = window.jupyterapp.shell.currentWidget;
    if (panel && panel.content) panel.content.widgets.forEach((cell, i) => {
      const seen = chart(cell.node);
      const area = cell.node.querySelector('.jp-OutputArea-output');
      if (seen.el && !(i in T.shown)) T.shown[i] = {at: Date.now(), width: width(seen.el), output: area ? width(area) : 0};
      if (seen.figure && !(i in T.figure)) T.figure[i] = {at: Date.now(), width: width(seen.figure)};
    });
    const sidecar = document.querySelector('.jupyterlab-sidecar');
    if (sidecar) {
      const seen = chart(sidecar);
      if (seen.el && !T.side) T.side = {at: Date.now(), width: width(seen.el), sidebar: width(sidecar)};
      if (seen.figure && !T.sideFigure) T.sideFigure = {at: Date.now(), width: width(seen.figure), sidebar: width(sidecar)};
    }
    requestAnimationFrame(tick);
  };
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  kernel.anyMessage.connect((_, args) => {
    const msg = args.msg;
    if (msg.header.msg_type === 'execute_reply') T.replies[msg.content.execution_count] = Date.parse(msg.header.date.slice(0, 23) + 'Z');
  });
  tick();
  return true;
}"""
TIMES_JS = "() => window.__gpumemTimes"

#: The words the tables under ``selector`` break across lines: an identifier or dotted name of three
#: characters or more ("opt.zero_grad", "backward") laid out on more than one line (a Range over its
#: characters has boxes on two rows); ``words`` counts those looked at.
BROKEN_WORDS_JS = r"""(selector) => {
  const broken = [];
  let words = 0;
  document.querySelectorAll(selector).forEach((root) => root.querySelectorAll('td, th').forEach((td) => {
    const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.textContent.matchAll(/[A-Za-z_][A-Za-z0-9_.]{2,}/g)) {
        words += 1;
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const rows = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
        if (rows.size > 1) broken.push(m[0]);
      }
    }
  }));
  return {broken, words};
}"""
