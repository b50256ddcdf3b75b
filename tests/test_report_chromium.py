"""The HTML report renders in a real browser: headless Chromium, where it is installed (skipped otherwise).

CI does not need Chromium; a developer machine with it (``apt-get install chromium``) checks that
the page lays out, shows the verdict and draws the charts.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from harness.report import to_html
from tests.test_report_doc import make_doc

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p), None
)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio"]


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and the unfiltered rows of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(to_html(make_doc(failing=True)), encoding="utf-8")
    shot = tmp_path / "report.png"
    run = subprocess.run(
        [CHROMIUM, *FLAGS, "--window-size=900,2400", f"--screenshot={shot}", page.as_uri()],  # type: ignore[list-item]
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert shot.exists(), run.stderr.decode(errors="replace")[-2000:]
    width, height, rows = _png_pixels(shot)
    assert (width, height) == (900, 2400)
    # Not a blank page: the FAIL badge's red and the charts' bars (no replay orange, R3 blue) are drawn.
    bpp = len(rows[0]) // width
    pixels = {row[i : i + 3] for row in rows for i in range(0, len(row), bpp)}
    for name, rgb in (
        ("FAIL red", (0xB3, 0x26, 0x1E)),
        ("orange", (0xD9, 0x82, 0x2B)),
        ("blue", (0x2B, 0x6C, 0xB0)),
    ):
        assert bytes(rgb) in pixels, f"no {name} pixel in the screenshot"
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, "--dump-dom", page.as_uri()],  # type: ignore[list-item]
        capture_output=True,
        timeout=120,
        check=False,
        text=True,
    ).stdout
    assert "NOT right" in dom and dom.count("<svg") == 3
