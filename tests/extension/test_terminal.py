"""Terminal IPython in a real terminal (tmux): a typed ``%%gpumem`` cell waits for its body, as ``%%time`` does.

prompt_toolkit asks IPython's ``check_complete`` whether Enter runs the cell; a cleanup
transformer that answered it would blank the header and make ``%%gpumem --lines`` + Enter run at
once with an empty body. Skipped where tmux is not installed (CI installs it).
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow
TMUX = shutil.which("tmux")


def _pane(session):
    return subprocess.run([TMUX, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _wait_for(session, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = _pane(session)
        if predicate(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"terminal never showed what was expected; it shows:\n{text}")


def _keys(session, *keys):
    subprocess.run([TMUX, "send-keys", "-t", session, *keys], check=True)


@pytest.mark.skipif(TMUX is None, reason="needs tmux")
def test_a_typed_gpumem_cell_waits_for_its_body(tmp_path):
    session = f"ipy-gpumem-{os.getpid()}"
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"), TERM="xterm-256color", PYTHONWARNINGS="ignore")
    command = (f"{sys.executable} -m IPython --no-banner --colors=NoColor --no-confirm-exit "
               "--TerminalInteractiveShell.autoindent=False --ext=ipy_gpumem")
    subprocess.run([TMUX, "new-session", "-d", "-s", session, "-x", "160", "-y", "48", command], check=True, env=env)
    try:
        _wait_for(session, lambda t: "In [1]:" in t)
        _keys(session, "%%gpumem --lines -o rec", "Enter")
        # Still typing the cell: a continuation prompt, no report, no next prompt.
        shown = _wait_for(session, lambda t: "...:" in t)
        time.sleep(1.0)
        shown = _pane(session)
        assert "%%gpumem [" not in shown and "In [2]:" not in shown, shown
        _keys(session, "answer = 41 + 1", "Enter")
        time.sleep(0.5)
        assert "In [2]:" not in _pane(session)
        # Empty lines end a cell-magic cell, as with %%time (IPython 9's prompt wants two).
        for _ in range(3):
            _keys(session, "Enter")
            time.sleep(0.7)
            if "In [2]:" in _pane(session):
                break
        shown = _wait_for(session, lambda t: "In [2]:" in t)
        assert "%%gpumem [1]" in shown and "answer = 41 + 1" in shown, shown
        _keys(session, "print(answer, len(rec.lines))", "Enter")
        _wait_for(session, lambda t: "42 1" in t)
    finally:
        subprocess.run([TMUX, "kill-session", "-t", session], capture_output=True)
