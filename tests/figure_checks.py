"""What the figure tests check on a drawn matplotlib figure."""

from __future__ import annotations

import re

import numpy as np
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.lines import Line2D


def _legends(fig) -> list:
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]


def text_overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of visible texts (titles, axis labels, tick labels, legends, notes) whose boxes
    overlap once drawn; an empty list for a clean figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = []
    for ax in fig.axes:
        items = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for ticks, (lo, hi), coord in (
            (ax.get_xticklabels(), sorted(ax.get_xlim()), 0),
            (ax.get_yticklabels(), sorted(ax.get_ylim()), 1),
        ):  # labels of ticks outside the view are not drawn
            items += [t for t in ticks if t.get_text() and lo <= t.get_position()[coord] <= hi]
        for item in items:
            if item.get_visible() and item.get_text():
                boxes.append((item.get_text()[:40], item.get_window_extent(renderer)))
    if fig._suptitle is not None and fig._suptitle.get_text():
        boxes.append((fig._suptitle.get_text()[:40], fig._suptitle.get_window_extent(renderer)))
    boxes += [("legend", legend.get_window_extent(renderer)) for legend in _legends(fig)]
    overlaps = []
    for i, (name_a, a) in enumerate(boxes):
        for name_b, b in boxes[i + 1 :]:
            if a.width and b.width and a.overlaps(b):
                overlaps.append((name_a, name_b))
    return overlaps


def _along(xy: np.ndarray) -> np.ndarray:
    """The points ``xy`` (P, 2) and 9 more along each segment between them."""
    if len(xy) < 2:
        return xy
    t = np.linspace(0, 1, 11)[:, None, None]
    return (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)


def _drawn_points(artist) -> np.ndarray:
    """Display coordinates (P, 2) of the data an artist draws: a line's vertices and points along
    its segments, a scatter's points, an error bar's bars. Filled bands are left out."""
    if isinstance(artist, Line2D):
        xy = artist.get_transform().transform(artist.get_xydata())
        return xy if artist.get_linestyle() in ("None", "") else _along(xy)
    if isinstance(artist, PathCollection):
        return artist.get_offset_transform().transform(artist.get_offsets())
    if isinstance(artist, LineCollection):
        bars = [_along(artist.get_transform().transform(s)) for s in artist.get_segments()]
        return np.concatenate(bars) if bars else np.zeros((0, 2))
    return np.zeros((0, 2))


def legend_covers_data(fig) -> list[tuple[str, float, float]]:
    """The data drawn inside any legend's box: (the artist's label, or its type where it has
    none, x, y) in display coordinates for each point of a line, scatter or error bar in view
    of its axes; an empty list where no legend covers data."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [legend.get_window_extent(renderer).extents for legend in _legends(fig)]
    covered = []
    for ax in fig.axes:
        for artist in [*ax.lines, *ax.collections]:
            if not artist.get_visible():
                continue
            xy = _drawn_points(artist)
            inside = _inside(xy, ax.bbox.extents) & np.any(
                [_inside(xy, box) for box in boxes] or [np.zeros(len(xy), bool)], axis=0
            )
            name = artist.get_label()
            name = type(artist).__name__ if name.startswith("_") else name
            covered += [(name, float(x), float(y)) for x, y in xy[inside]]
    return covered


def _inside(xy: np.ndarray, extents) -> np.ndarray:
    x0, y0, x1, y1 = extents
    return (xy[:, 0] >= x0) & (xy[:, 0] <= x1) & (xy[:, 1] >= y0) & (xy[:, 1] <= y1)


# the label styles of a log axis: human()'s counts (and decimal losses), sci()'s powers of ten
TICK_STYLES = (r"\d+(\.\d+)?[kMBT]?", r"\$(\d(\.\d)?\{\\times\})?10\^\{-?\d+\}\$")


def tick_problems(fig) -> list[str]:
    """What is wrong with the tick labels of each log axis: a labelled minor tick, labels of
    more than one style (10k beside 2x10^4) or of none of ``TICK_STYLES``, fewer than 2
    labelled ticks in view, or two ticks with one label. An empty list for a clean figure."""
    fig.canvas.draw()
    problems = []
    for i, ax in enumerate(fig.axes):
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if not ax.axison or axis.get_scale() != "log":
                continue
            where = f"axes {i} ({ax.get_title()[:30]!r}) {name}"
            lo, hi = sorted(axis.get_view_interval())
            major, minor = (
                [
                    text
                    for text in formatter.format_ticks([t for t in locator() if lo <= t <= hi])
                    if text
                ]
                for locator, formatter in (
                    (axis.get_major_locator(), axis.get_major_formatter()),
                    (axis.get_minor_locator(), axis.get_minor_formatter()),
                )
            )
            if minor:
                problems.append(f"{where}: minor ticks labelled {minor}")
            styles = {s for text in major for s in TICK_STYLES if re.fullmatch(s, text)}
            unmatched = [t for t in major if not any(re.fullmatch(s, t) for s in TICK_STYLES)]
            if len(styles) > 1 or unmatched:
                problems.append(f"{where}: labels of mixed or unknown styles {major}")
            if len(major) < 2 or len(set(major)) < len(major):
                problems.append(f"{where}: labels {major}")
    return problems
