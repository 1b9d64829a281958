"""An image's format, size and frame count read from its own bytes before any decoder sees it
(pure Python: no PIL, nothing decompressed).

`read_header(data)` walks the file's structure (PNG chunks, JPEG markers and scans, GIF blocks,
WebP RIFF chunks, BMP headers) and returns what it declares, or refuses it with a typed error:
a format not accepted (TIFF, ICO and the rest, named where known), a file cut short (a chunk,
block or segment running past its end, no end marker), or a structure a decoder would spend
unbounded time on (a JPEG with more than `MAX_JPEG_SCANS` scans, a run-length-coded BMP, whose
decoder is pure Python). A decoder then sees only complete files whose size is known, so a
decompression bomb is refused by its header, and a truncated file is refused here even where
`ImageFile.LOAD_TRUNCATED_IMAGES` would let PIL pad it. Only the first frame of an animation
(GIF, APNG, WebP) is ever decoded: more frames cost only their bytes (`limits.max_image_bytes`).
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from protocols.errors import InvalidRequestError, RequestTooLargeError

ACCEPTED = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# A progressive JPEG has about 10 scans; each scan may pass over every block of the image.
MAX_JPEG_SCANS = 100

# Formats PIL (or a browser) reads that are refused, by their first bytes: named in the refusal.
_REFUSED_MAGIC = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),
    (b"MM\x00+", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x02\x00", "CUR"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"qoif", "QOI"),
    (b"DDS ", "DDS"),
    (b"icns", "ICNS"),
    (b"%PDF", "PDF"),
    (b"%!PS", "EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"\x01\xda", "SGI"),
    (b"BLP", "BLP"),
    (b"DanM", "MSP"),
    (b"LinS", "MSP"),
    (b"Image type", "IM"),
    (b"#define", "XBM"),
)
_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
# The end of a JPEG scan: 0xFF followed by neither a stuffed 0x00 nor a restart marker.
_JPEG_SCAN_END = re.compile(rb"\xff(?![\x00\xd0-\xd7])")


@dataclass(frozen=True)
class ImageHeader:
    format: str
    width: int
    height: int
    num_frames: int

    @property
    def num_pixels(self) -> int:
        return self.width * self.height


class _Damaged(Exception):
    """The file's structure is wrong (a reader's own refusal; `read_header` types it)."""


def read_header(data: bytes, max_pixels: int) -> ImageHeader:
    """The image's format, size (what the first frame decodes to) and frames, from its
    structure. Raises `InvalidRequestError`, or `RequestTooLargeError` for more than
    `max_pixels` pixels (checked as soon as the size is read), field "messages"."""
    name = format_name(data)
    reader = _READERS.get(name)
    if reader is None:
        raise InvalidRequestError(f"an image in {name} format is not accepted (accepted: {', '.join(ACCEPTED)})", field="messages")
    try:
        header = reader(data, max_pixels)
    except (struct.error, IndexError):  # a field read past the end of the data
        raise InvalidRequestError(f"an image ({name}) is truncated: it could not be decoded", field="messages") from None
    except _Damaged as exc:
        raise InvalidRequestError(f"an image is not a readable {name} file: {exc}", field="messages") from None
    if header.width < 1 or header.height < 1:
        raise InvalidRequestError(f"an image ({name}) has no pixels", field="messages")
    return header


def format_name(data: bytes) -> str:
    """The format the first bytes name: one of `ACCEPTED`, a refused format's name, or "an unknown"."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith(b"BM"):
        return "BMP"
    if data[4:8] == b"ftyp":
        return "HEIF/AVIF"
    if len(data) > 2 and data[0:1] == b"P" and data[1:2] in b"1234567" and data[2:3].isspace():
        return "PNM"
    return next((name for magic, name in _REFUSED_MAGIC if data.startswith(magic)), "an unknown")


def _check_size(name: str, width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise RequestTooLargeError(f"an image ({name}) has {width}x{height} pixels, more than {max_pixels} (limits.max_image_pixels)", field="messages")


def _png(data: bytes, max_pixels: int) -> ImageHeader:
    if data[12:16] != b"IHDR":
        raise _Damaged("its first chunk is not IHDR")
    width, height, depth, color, _, _, interlace = struct.unpack_from(">IIBBBBB", data, 16)
    _check_size("PNG", width, height, max_pixels)
    pos, num_frames, idat = 8, 1, []
    while True:
        length, kind = struct.unpack_from(">I4s", data, pos)
        body, pos = pos + 8, pos + 12 + length  # length, type, data, CRC
        if pos > len(data):
            raise struct.error("past the end")
        if kind == b"IEND":
            break
        if kind == b"IDAT":
            idat.append(memoryview(data)[body : body + length])
        elif kind == b"acTL":  # APNG: the animation's frame count
            num_frames = struct.unpack_from(">I", data, body)[0]
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(color)
    if channels is None or depth not in (1, 2, 4, 8, 16):
        raise _Damaged(f"colour type {color} at depth {depth}")
    _check_png_data(idat, _png_data_bytes(width, height, channels * depth, interlace))
    return ImageHeader("PNG", width, height, num_frames)


def _png_data_bytes(width: int, height: int, bits: int, interlace: int) -> int:
    """The bytes an image's filtered rows inflate to (each row: a filter byte, then its pixels)."""
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)) if interlace else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            total += rows * (1 + -(-columns * bits // 8))
    return total


def _check_png_data(idat: list[memoryview], expected: int) -> None:
    """The image data inflates to exactly the rows its header declares: inflated in pieces and
    dropped, never more than `expected` + 1 MiB, so a zlib bomb costs no more than a true image."""
    inflater, num_bytes = zlib.decompressobj(), 0
    try:
        for piece in idat:
            pending = bytes(piece)
            while pending and not inflater.eof:
                num_bytes += len(inflater.decompress(pending, 1 << 20))
                if num_bytes > expected:
                    raise _Damaged(f"its image data inflates to more data than its size ({expected} bytes)")
                pending = inflater.unconsumed_tail
    except zlib.error as exc:
        raise _Damaged(f"its image data is not a zlib stream ({exc})") from None
    if num_bytes < expected:
        raise _Damaged(f"its image data inflates to less data than its size ({num_bytes} of {expected} bytes)")


def _jpeg(data: bytes, max_pixels: int) -> ImageHeader:
    pos, size, num_scans = 2, None, 0
    while True:
        if data[pos] != 0xFF:
            raise _Damaged("a segment does not start with a marker")
        while data[pos] == 0xFF:  # (fill bytes may precede a marker)
            pos += 1
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI (bytes after it, as some cameras append, are never decoded)
            break
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:
            continue
        length = struct.unpack_from(">H", data, pos)[0]
        if length < 2 or pos + length > len(data):
            raise struct.error("past the end")
        if marker in _JPEG_SOF and size is None:
            height, width = struct.unpack_from(">HH", data, pos + 3)
            size = (width, height)
            _check_size("JPEG", width, height, max_pixels)
        pos += length
        if marker == 0xDA:
            num_scans += 1
            if size is None:
                raise _Damaged("a scan comes before the frame header")
            if num_scans > MAX_JPEG_SCANS:
                raise _Damaged(f"it has more than {MAX_JPEG_SCANS} scans")
            found = _JPEG_SCAN_END.search(data, pos)
            if found is None:
                raise struct.error("past the end")
            pos = found.start()
    if size is None or num_scans == 0:
        raise _Damaged("it has no frame header or no scan")
    return ImageHeader("JPEG", size[0], size[1], 1)


def _gif(data: bytes, max_pixels: int) -> ImageHeader:
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    num_frames = 0
    while pos < len(data) and data[pos] != 0x3B:  # (a file ending at a block's end has no trailer: tolerated)
        if data[pos] == 0x21:  # extension: label, sub-blocks
            pos = _gif_sub_blocks(data, pos + 2)
        elif data[pos] == 0x2C:  # image: descriptor, local colour table, LZW code size, sub-blocks
            left, top, frame_width, frame_height, frame_flags = struct.unpack_from("<HHHHB", data, pos + 1)
            if num_frames == 0:  # PIL grows the image to hold a first frame larger than the screen
                width, height = max(width, left + frame_width), max(height, top + frame_height)
                _check_size("GIF", width, height, max_pixels)
            pos += 11 + (3 << ((frame_flags & 7) + 1) if frame_flags & 0x80 else 0)
            pos = _gif_sub_blocks(data, pos)
            num_frames += 1
        else:
            raise _Damaged(f"an unknown block 0x{data[pos]:02x}")
    if pos > len(data):
        raise struct.error("past the end")
    if num_frames == 0:
        raise _Damaged("it has no image")
    return ImageHeader("GIF", width, height, num_frames)


def _gif_sub_blocks(data: bytes, pos: int) -> int:
    while (size := data[pos]) != 0:
        pos += 1 + size
    return pos + 1


def _webp(data: bytes, max_pixels: int) -> ImageHeader:
    end = 8 + struct.unpack_from("<I", data, 4)[0]
    if end > len(data):
        raise struct.error("past the end")
    pos, canvas, first, num_frames = 12, None, None, 0
    while pos + 8 <= end:
        kind, length = struct.unpack_from("<4sI", data, pos)
        body = pos + 8
        pos = body + length + (length & 1)
        if body + length > end:
            raise struct.error("past the end")
        if kind == b"VP8X":
            canvas = (1 + int.from_bytes(data[body + 4 : body + 7], "little"), 1 + int.from_bytes(data[body + 7 : body + 10], "little"))
        elif kind == b"VP8 " and first is None:
            if data[body + 3 : body + 6] != b"\x9d\x01\x2a":
                raise _Damaged("a lossy frame has no start code")
            width, height = struct.unpack_from("<HH", data, body + 6)
            first = (width & 0x3FFF, height & 0x3FFF)
        elif kind == b"VP8L" and first is None:
            if data[body] != 0x2F:
                raise _Damaged("a lossless frame has no signature")
            bits = struct.unpack_from("<I", data, body + 1)[0]
            first = (1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF))
        elif kind == b"ANMF":
            num_frames += 1
    size = canvas or first
    if size is None:
        raise _Damaged("it has no image")
    _check_size("WEBP", size[0], size[1], max_pixels)
    return ImageHeader("WEBP", size[0], size[1], max(1, num_frames))


def _bmp(data: bytes, max_pixels: int) -> ImageHeader:
    offset, header_size = struct.unpack_from("<II", data, 10)
    if header_size == 12:  # OS/2 core header
        width, height, _, bits = struct.unpack_from("<HHHH", data, 18)
        compression = 0
    elif header_size in (40, 52, 56, 64, 108, 124):
        width, height, _, bits, compression = struct.unpack_from("<iiHHI", data, 18)
    else:
        raise _Damaged(f"an unknown header of {header_size} bytes")
    if compression not in (0, 3, 6):  # uncompressed or bit fields: RLE and embedded JPEG/PNG are refused
        raise _Damaged(f"compression {compression} is not accepted (only uncompressed BMP)")
    if bits not in (1, 2, 4, 8, 16, 24, 32):
        raise _Damaged(f"{bits} bits per pixel")
    height = abs(height)  # (negative: stored top-down)
    _check_size("BMP", width, height, max_pixels)
    if offset + (width * bits + 31) // 32 * 4 * height > len(data):
        raise struct.error("past the end")
    return ImageHeader("BMP", width, height, 1)


_READERS: dict[str, Callable[[bytes, int], ImageHeader]] = {"PNG": _png, "JPEG": _jpeg, "GIF": _gif, "WEBP": _webp, "BMP": _bmp}
