"""What the figure tests check on a drawn matplotlib figure."""

from __future__ import annotations


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
        legend = ax.get_legend()
        for item in items:
            if item.get_visible() and item.get_text():
                boxes.append((item.get_text()[:40], item.get_window_extent(renderer)))
        if legend is not None:
            boxes.append(("legend", legend.get_window_extent(renderer)))
    overlaps = []
    for i, (name_a, a) in enumerate(boxes):
        for name_b, b in boxes[i + 1 :]:
            if a.width and b.width and a.overlaps(b):
                overlaps.append((name_a, name_b))
    return overlaps
