"""What the presenter and the modes read off an IPython shell, by its attributes (IPython is never imported here)."""
from __future__ import annotations

__all__ = ["ipython_refs", "cell_files"]


def ipython_refs(shell):
    """Which names of the shell's namespace still hold what IPython put there (``Out``, ``_5``, ...)."""
    from ..attribution.holders import ipython_refs as refs

    return refs(shell.user_ns, getattr(shell, "user_ns_hidden", None), getattr(shell, "displayhook", None))


def cell_files(shell, limit: int = 2000) -> dict:
    """The file name each cell of this session ran under (``/tmp/ipykernel_<pid>/<hash>.py``,
    ``<ipython-input-N-...>``) mapped to its execution count, so a snapshot's frames say ``In [7]``.

    Names come from the shell's own compiler (``get_code_name``), as the frames torch recorded
    got them; any failure gives what was found so far.
    """
    out: dict = {}
    try:
        name_of = shell.compile.get_code_name
        raw = shell.history_manager.input_hist_raw
        parsed = shell.history_manager.input_hist_parsed
        for number in range(max(1, len(parsed) - limit), len(parsed)):
            try:
                out[name_of(raw[number], parsed[number], number)] = number
            except Exception:  # noqa: BLE001 - one odd cell names nothing
                continue
    except Exception:  # noqa: BLE001 - an old IPython without get_code_name: frames keep their file names
        pass
    return out
