"""Pictures of topologies as PNG files, with or without matplotlib.

matplotlib is not a dependency. When it is installed it draws the graph
(labels, arrows); when it is not, a small numpy rasterizer puts members on a
circle and edges as straight lines, and zlib + struct write the PNG. That is
enough to eyeball a graph from `gossiptrain topology --png` anywhere.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

BACKGROUND = (255, 255, 255)
EDGE = (170, 170, 170)
ARROW = (70, 70, 70)  # the quarter of a directed edge next to its target
NODE = (31, 119, 180)


def circle_layout(n: int, size: int) -> np.ndarray:
    """(n, 2) pixel centres (x, y): member 0 at the top, then clockwise."""
    centre = size / 2
    radius = size / 2 - size * 0.08
    angle = 2 * np.pi * np.arange(n) / max(n, 1) - np.pi / 2  # (n,)
    return np.stack([centre + radius * np.cos(angle), centre + radius * np.sin(angle)], axis=1)  # (n, 2)


def node_radius(n: int, size: int) -> int:
    """Disc radius in pixels: a third of the spacing on the circle, within [2, 12]."""
    spacing = 2 * np.pi * (size / 2 - size * 0.08) / max(n, 1)
    return int(min(12, max(2, spacing / 3)))


def render(adjacency: np.ndarray, size: int = 480, directed: bool = False) -> np.ndarray:
    """(size, size, 3) uint8 RGB picture of the graph; direction shown by a darker end."""
    a = np.asarray(adjacency, dtype=bool).copy()  # (n, n)
    np.fill_diagonal(a, False)
    n = a.shape[0]
    image = np.empty((size, size, 3), dtype=np.uint8)  # (H, W, 3)
    image[:] = BACKGROUND
    xy = circle_layout(n, size)  # (n, 2)
    # Undirected: each edge once. Directed: both arcs, each with its own head.
    for i, j in zip(*np.nonzero(a if directed else np.triu(a | a.T, k=1))):
        _line(image, xy[i], xy[j], EDGE)
        if directed:
            _line(image, xy[i] + 0.75 * (xy[j] - xy[i]), xy[j], ARROW)
    r = node_radius(n, size)
    for x, y in xy:
        _disc(image, x, y, r, NODE)
    return image


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image: 8-bit RGB, no filtering, one IDAT chunk."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {image.shape} {image.dtype}")
    h, w, _ = image.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), image.reshape(h, w * 3)], axis=1)  # (H, 1 + 3W)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, truecolour, deflate, no filter, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def save_png(
    adjacency: np.ndarray, path: str, *, directed: bool = False, title: str | None = None, size: int = 480
) -> str:
    """Write the graph to `path`; returns which drawer was used: "matplotlib" or "builtin"."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # type: ignore[import-not-found, unused-ignore]
        from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        with open(path, "wb") as f:
            f.write(encode_png(render(adjacency, size, directed)))
        return "builtin"
    a = np.asarray(adjacency, dtype=bool).copy()  # (n, n)
    np.fill_diagonal(a, False)
    n = a.shape[0]
    xy = circle_layout(n, size)  # (n, 2)
    # Figure + Agg canvas, not pyplot: no global backend switch, no GUI.
    fig = Figure(figsize=(size / 100, size / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(0, size)
    ax.set_ylim(size, 0)  # pixel coordinates: y grows downwards, member 0 on top
    r = node_radius(n, size)
    marker = 1.6 * r  # disc diameter in points
    for i, j in zip(*np.nonzero(a if directed else np.triu(a | a.T, k=1))):
        if directed:
            # Stop arrows at the disc's rim, or the node hides the head.
            style = {"arrowstyle": "->", "color": "0.45", "shrinkA": marker / 2, "shrinkB": marker / 2 + 1}
            ax.annotate("", xy=tuple(xy[j]), xytext=tuple(xy[i]), arrowprops=style)
        else:
            ax.plot(xy[[i, j], 0], xy[[i, j], 1], color="0.67", linewidth=0.8, zorder=1)
    ax.scatter(xy[:, 0], xy[:, 1], s=marker**2, color=[c / 255 for c in NODE], zorder=3)
    if r >= 6:
        for k, (x, y) in enumerate(xy):
            ax.text(x, y, str(k), ha="center", va="center", fontsize=max(5, r - 3), color="white", zorder=4)
    if title:
        fig.text(0.01, 0.99, title, va="top", fontsize=9)
    fig.savefig(path, format="png")
    return "matplotlib"


def _line(image: np.ndarray, start: np.ndarray, end: np.ndarray, colour: tuple[int, int, int]) -> None:
    # One sample per pixel step along the longer axis leaves no gaps.
    steps = int(math.ceil(np.abs(end - start).max())) + 1
    t = np.linspace(0.0, 1.0, steps)[:, None]  # (steps, 1)
    points = np.rint(start + t * (end - start)).astype(int)  # (steps, 2) x, y
    h, w, _ = image.shape
    points = points[(points[:, 0] >= 0) & (points[:, 0] < w) & (points[:, 1] >= 0) & (points[:, 1] < h)]
    image[points[:, 1], points[:, 0]] = colour


def _disc(image: np.ndarray, x: float, y: float, r: int, colour: tuple[int, int, int]) -> None:
    h, w, _ = image.shape
    x0, x1 = max(0, int(x) - r), min(w, int(x) + r + 2)
    y0, y1 = max(0, int(y) - r), min(h, int(y) + r + 2)
    yy, xx = np.ogrid[y0:y1, x0:x1]  # (dy, 1), (1, dx)
    image[y0:y1, x0:x1][(xx - x) ** 2 + (yy - y) ** 2 <= r * r] = colour
