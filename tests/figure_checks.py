"""What the figure tests check on a drawn matplotlib figure."""

from __future__ import annotations

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
    """The data drawn inside any legend's box: (the artist's label or type, x, y) in display
    coordinates for each point of a line, scatter or error bar in view of its axes; an empty
    list where no legend covers data."""
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
            name = artist.get_label() or type(artist).__name__
            covered += [(name, float(x), float(y)) for x, y in xy[inside]]
    return covered


def _inside(xy: np.ndarray, extents) -> np.ndarray:
    x0, y0, x1, y1 = extents
    return (xy[:, 0] >= x0) & (xy[:, 0] <= x1) & (xy[:, 1] >= y0) & (xy[:, 1] <= y1)
