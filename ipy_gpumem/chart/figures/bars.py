"""What the column figures share (a cell's lines, the history, the estimate): bars that float from one level to the next, their category-axis layout, and hover text.

A column goes from a level to the next one: red where memory grew, green where it shrank, grey
where it stayed; its hover is the caller's, already made plotly text (``display.escape.plotly_text``);
the layout escapes its own titles.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

from ...display.escape import plotly_text
from ..svg.base import DOWN_COLOR, IMG_INK, UP_COLOR
from .timeline import UIREVISION

__all__ = ["change_bars", "column_layout", "END_BARS_COLOR"]

#: The before / after (or before / peak) columns: neutral, under the coloured ones.
END_BARS_COLOR = "rgba(140,140,140,0.45)"
#: A column that did not move is drawn this tall (in the figure's unit), so it can still be hovered.
_FLAT = 0.0005


def change_bars(columns: Iterable[Tuple[str, int, int, str]], scale, words: Sequence[str] = ("grew", "shrank")) -> list:
    """One bar trace per direction (``words``: what growing and shrinking are called, then "no change"),
    from ``(tick, start, end, hover)`` columns in bytes (``hover`` as plotly text: escaped by the caller);
    ``scale`` turns bytes into the figure's unit.
    Directions without a column get no trace."""
    grew, shrank = words
    groups = {grew: ([], [], [], []), shrank: ([], [], [], []), "no change": ([], [], [], [])}
    for tick, start, end, hover in columns:
        xs, bases, ys, texts = groups[grew if end > start else shrank if end < start else "no change"]
        xs.append(tick)
        bases.append(scale(min(start, end)))
        ys.append(max(scale(abs(end - start)), _FLAT))
        texts.append(hover)
    colours = {grew: UP_COLOR, shrank: DOWN_COLOR, "no change": IMG_INK}
    return [{"type": "bar", "name": kind, "x": xs, "base": bases, "y": ys, "hovertext": texts, "hoverinfo": "text",
             "marker": {"color": colours[kind], "opacity": 0.8}}
            for kind, (xs, bases, ys, texts) in groups.items() if xs]


def column_layout(title: str, ticks: Sequence[str], ytitle: str, height: int, legend_y: float,
                  shapes: Sequence = (), notes: Sequence = (), xtitle: Optional[str] = None) -> dict:
    """The layout of a column figure: its columns in ``ticks`` order on a category axis, overlaid bars,
    a legend under the plot, the transparent grey look of every figure here. The titles are plain text
    (escaped here); ``ticks`` are the traces' own x values, so they are ours, never the user's."""
    axis = {"gridcolor": "rgba(140,140,140,0.2)", "linecolor": "rgba(140,140,140,0.5)", "color": IMG_INK}
    xaxis = dict(axis, type="category", categoryorder="array", categoryarray=list(ticks), tickfont={"size": 9})
    if xtitle is not None:
        xaxis["title"] = {"text": plotly_text(xtitle), "font": {"size": 10}}
    return {
        "title": {"text": plotly_text(title), "x": 0, "xanchor": "left", "font": {"size": 12}},
        "barmode": "overlay", "height": int(height), "autosize": True, "uirevision": UIREVISION,
        "margin": {"l": 56, "r": 12, "t": 30, "b": 8}, "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "var(--jp-ui-font-family, sans-serif)", "size": 11, "color": IMG_INK},
        "legend": {"orientation": "h", "x": 0, "y": legend_y, "yanchor": "top", "font": {"size": 10}},
        "xaxis": xaxis, "yaxis": dict(axis, title={"text": plotly_text(ytitle), "font": {"size": 10}}),
        "shapes": list(shapes), "annotations": list(notes), "hovermode": "closest",
    }
