"""A loss curve as a PNG, in pure Python (zlib and struct): the demo needs no plotting library.

    write_line_plot("loss.png", steps, losses, title="MLM LOSS", x_label="GLOBAL STEP")

Draws axes, light grid lines at round values, their numbers (a built-in 5x7 font of digits, a few
capitals and punctuation) and the curve. Enough to see a loss go down; use matplotlib on the CSV
for anything finer.
"""

import math
import struct
import zlib

# 5x7 glyphs, seven rows of five ('#' = ink)
_GLYPHS = {
    "0": [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
    "1": ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "2": [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
    "3": ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
    "4": ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
    "5": ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
    "6": ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
    "7": ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
    "8": [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
    "9": [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
    ".": ["     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "],
    "-": ["     ", "     ", "     ", " ### ", "     ", "     ", "     "],
    " ": ["     ", "     ", "     ", "     ", "     ", "     ", "     "],
    "A": [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "B": ["#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "],
    "E": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"],
    "G": [" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ### "],
    "L": ["#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"],
    "M": ["#   #", "## ##", "# # #", "#   #", "#   #", "#   #", "#   #"],
    "O": [" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "P": ["#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "],
    "S": [" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "],
    "T": ["#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "],
}
_BACKGROUND, _INK, _GRID, _LINE = (255, 255, 255), (40, 40, 40), (225, 225, 225), (31, 119, 180)


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(_BACKGROUND) * width * height)

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = 3 * (y * self.width + x)
            self.pixels[offset : offset + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, thickness: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            x, y = round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps)
            for dx in range(thickness):
                for dy in range(thickness):
                    self.dot(x + dx - thickness // 2, y + dy - thickness // 2, color)

    def text(self, x: int, y: int, text: str, color=_INK, scale: int = 1) -> None:
        """Top-left at (x, y); characters without a glyph are drawn as spaces."""
        for index, char in enumerate(text.upper()):
            glyph = _GLYPHS.get(char, _GLYPHS[" "])
            for row in range(7):
                for col in range(5):
                    if glyph[row][col] == "#":
                        for sx in range(scale):
                            for sy in range(scale):
                                self.dot(x + (index * 6 + col) * scale + sx, y + row * scale + sy, color)

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int(math.ceil((high - first) / step)) + 1)]


def _label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def write_line_plot(
    path: str,
    xs: list[float],
    ys: list[float],
    title: str = "",
    x_label: str = "",
    width: int = 720,
    height: int = 440,
) -> None:
    if not xs or len(xs) != len(ys):
        raise ValueError(f"need as many x as y values, and at least one; got {len(xs)} and {len(ys)}")
    canvas = _Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    x_ticks, y_ticks = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    x_low, x_high, y_low, y_high = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (
            round(left + (x - x_low) / (x_high - x_low) * (right - left)),
            round(bottom - (y - y_low) / (y_high - y_low) * (bottom - top)),
        )

    for value in y_ticks:
        _, py = to_px(x_low, value)
        canvas.line(left, py, right, py, _GRID)
        text = _label(value, y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0)
        canvas.text(left - 8 - 6 * len(text), py - 3, text)
    for value in x_ticks:
        px, _ = to_px(value, y_low)
        canvas.line(px, top, px, bottom, _GRID)
        text = _label(value, x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0)
        canvas.text(px - 3 * len(text), bottom + 8, text)
    canvas.line(left, top, left, bottom, _INK)
    canvas.line(left, bottom, right, bottom, _INK)
    points = [to_px(x, y) for x, y in zip(xs, ys)]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        canvas.line(x0, y0, x1, y1, _LINE, thickness=2)
    for x, y in points if len(points) == 1 else ():
        canvas.line(x - 2, y, x + 2, y, _LINE, thickness=3)
    canvas.text((width - 12 * len(title)) // 2, 12, title, scale=2)
    canvas.text((left + right - 6 * len(x_label)) // 2, height - 22, x_label)
    with open(path, "wb") as f:
        f.write(canvas.png())
