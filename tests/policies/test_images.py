"""policies.images / policies.image_formats: every format PIL writes is decoded as PIL decodes it
or refused naming the accepted formats; truncated files and bombs are refused from their
structure, before PIL opens them, whatever PIL's own settings; an animation's first frame only is
decoded. Every image is made here with PIL itself."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import GifImagePlugin, Image, ImageFile

from policies import image_formats
from policies.images import decode_image
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError, RequestTooLargeError

LIMITS = LimitsConfig()
ACCEPTED = "accepted: PNG, JPEG, WEBP, GIF, BMP"
Image.init()


def noise(mode: str = "RGB", size: tuple[int, int] = (24, 16), seed: int = 0) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def reference(data: bytes) -> np.ndarray:
    """PIL's own decode of the (first frame of the) file, as RGB."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture
def pil_never_opens(monkeypatch) -> list[str]:
    """Calls to PIL's `Image.open` (a refusal from the structure makes none), with PIL's own
    defences turned off as another library may turn them off."""
    opened: list[str] = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append("open") or real_open(*a, **k))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    return opened


def _written_formats() -> list[tuple[str, bytes]]:
    written = []
    for fmt in sorted(Image.SAVE):
        for mode in ("RGB", "L", "1", "P"):
            try:
                written.append((fmt, encode(noise(mode), fmt)))
                break
            except Exception:  # (BUFR, GRIB, HDF5, WMF: stubs PIL cannot write)
                continue
    return written


@pytest.mark.parametrize(("fmt", "data"), _written_formats(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_format_pil_writes_is_decoded_as_pil_decodes_it_or_refused_naming_the_accepted_ones(fmt, data):
    if fmt in ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"):  # (MPO is a JPEG file: its first image)
        np.testing.assert_array_equal(np.asarray(decode_image(data, LIMITS)), reference(data))
    else:
        with pytest.raises(InvalidRequestError, match=ACCEPTED) as refused:
            decode_image(data, LIMITS)
        assert refused.value.field == "messages"


ACCEPTED_VARIANTS = {
    "png-1": lambda: encode(noise("1"), "PNG"),
    "png-LA": lambda: encode(noise("LA"), "PNG"),
    "png-P": lambda: encode(noise("P"), "PNG"),
    "png-RGBA": lambda: encode(noise("RGBA"), "PNG"),
    "png-I;16": lambda: encode(noise("L").convert("I;16"), "PNG"),
    "png-interlaced": lambda: _interlaced_png(),
    "jpeg-L": lambda: encode(noise("L"), "JPEG"),
    "jpeg-CMYK": lambda: encode(noise("CMYK"), "JPEG"),
    "jpeg-progressive": lambda: encode(noise("RGB", (64, 48)), "JPEG", progressive=True),
    "webp-lossless-RGBA": lambda: encode(noise("RGBA"), "WEBP", lossless=True),
    "webp-lossy": lambda: encode(noise("RGB"), "WEBP", quality=50),
    "gif-L": lambda: encode(noise("L"), "GIF"),
    "bmp-1": lambda: encode(noise("1"), "BMP"),
    "bmp-P": lambda: encode(noise("P"), "BMP"),
    "bmp-RGBA": lambda: encode(noise("RGBA"), "BMP"),
}


def _interlaced_png() -> bytes:
    """An Adam7-interlaced PNG (PIL writes none): the raw pass rows, compressed."""
    image = np.asarray(noise("RGB", (37, 23)))
    rows = b""
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)):
        sub = image[y0::dy, x0::dx]
        if sub.size:
            rows += b"".join(b"\x00" + row.tobytes() for row in sub)
    return png_file(37, 23, zlib.compress(rows), interlace=1)


@pytest.mark.parametrize("variant", sorted(ACCEPTED_VARIANTS))
def test_accepted_formats_in_their_modes_decode_as_pil_decodes_them(variant):
    data = ACCEPTED_VARIANTS[variant]()
    np.testing.assert_array_equal(np.asarray(decode_image(data, LIMITS)), reference(data))


def test_animations_decode_their_first_frame_only(monkeypatch):
    frames = [noise("RGB", (32, 24))] + [Image.new("RGB", (32, 24), (i % 251, i % 7, 9)) for i in range(1, 3000)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert image_formats.read_header(gif, LIMITS.max_image_pixels).num_frames == 3000
    seeks: list[int] = []
    real_seek = GifImagePlugin.GifImageFile.seek
    monkeypatch.setattr(GifImagePlugin.GifImageFile, "seek", lambda self, frame: seeks.append(frame) or real_seek(self, frame))
    np.testing.assert_array_equal(np.asarray(decode_image(gif, LIMITS)), reference(encode(frames[0], "GIF")))
    assert set(seeks) <= {0}  # no later frame was even walked to
    for fmt in ("WEBP", "PNG"):  # animated WebP, APNG
        animation = encode(frames[0], fmt, save_all=True, append_images=frames[1:4], lossless=True)
        assert image_formats.read_header(animation, LIMITS.max_image_pixels).num_frames == 4
        np.testing.assert_array_equal(np.asarray(decode_image(animation, LIMITS)), np.asarray(frames[0]))


def test_tiff_even_multi_page_and_ico_are_refused_by_name(pil_never_opens):
    pages = encode(noise(), "TIFF", save_all=True, append_images=[noise(seed=1), noise(seed=2)], compression="tiff_deflate")
    for data, name in ((pages, "TIFF"), (encode(noise(), "ICO", sizes=[(16, 16), (24, 24)]), "ICO")):
        with pytest.raises(InvalidRequestError, match=f"in {name} format is not accepted \\({ACCEPTED}\\)"):
            decode_image(data, LIMITS)
    assert pil_never_opens == []


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_file(width: int, height: int, idat: bytes, *, interlace: int = 0) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_truncated_files_are_refused_before_pil_opens_them_even_where_pil_would_pad_them(fmt, pil_never_opens):
    whole = encode(noise("RGB", (64, 48)), fmt)
    for cut in (len(whole) // 2, len(whole) - 2):
        with pytest.raises(InvalidRequestError, match="truncated") as refused:
            decode_image(whole[:cut], LIMITS)
        assert refused.value.field == "messages"
    assert pil_never_opens == []


def _huge_headers() -> dict[str, bytes]:
    gif = encode(noise("P", (4, 4)), "GIF")
    frame = gif.index(b"\x2c", 13)
    webp = encode(noise("RGBA", (4, 4)), "WEBP", lossless=True, icc_profile=b"icc")  # (a profile: written with a VP8X header)
    at = webp.index(b"VP8X") + 8
    jpeg = encode(noise(), "JPEG")
    sof = jpeg.index(b"\xff\xc0") + 5
    return {
        "png 100000x100000": png_file(100_000, 100_000, zlib.compress(b"\0" * 4096)),
        "gif screen 65535x65535": gif[:6] + struct.pack("<HH", 65535, 65535) + gif[10:],
        "gif first frame 65535x65535 on a 4x4 screen": gif[: frame + 5] + struct.pack("<HH", 65535, 65535) + gif[frame + 9 :],
        "webp canvas 16384x16384": webp[: at + 4] + (16383).to_bytes(3, "little") * 2 + webp[at + 10 :],
        "jpeg 65500x65500": jpeg[:sof] + struct.pack(">HH", 65500, 65500) + jpeg[sof + 4 :],
    }


@pytest.mark.parametrize("name", sorted(_huge_headers()))
def test_huge_declared_sizes_are_refused_from_the_header_before_pil_opens_them(name, pil_never_opens):
    with pytest.raises(RequestTooLargeError, match="max_image_pixels") as refused:
        decode_image(_huge_headers()[name], LIMITS)
    assert refused.value.field == "messages"
    assert pil_never_opens == []


def test_a_png_whose_data_inflates_past_its_size_is_refused_without_inflating_it_all(pil_never_opens):
    bomb = png_file(64, 48, zlib.compress(b"\0" * (256 << 20), 9))  # 256 MiB of zeros in ~250 KB, for a 9 KB image
    with pytest.raises(InvalidRequestError, match="more data than its size"):
        decode_image(bomb, LIMITS)
    short = png_file(64, 48, zlib.compress(b"\0" * 100))
    with pytest.raises(InvalidRequestError, match="less data than its size"):
        decode_image(short, LIMITS)
    assert pil_never_opens == []


def test_a_jpeg_with_too_many_scans_and_a_run_length_bmp_are_refused_before_pil_opens_them(pil_never_opens):
    jpeg = encode(noise("RGB", (64, 48)), "JPEG", progressive=True)
    last_scan = jpeg.rindex(b"\xff\xda")
    many = jpeg[:last_scan] + jpeg[last_scan:-2] * (image_formats.MAX_JPEG_SCANS + 1) + b"\xff\xd9"
    with pytest.raises(InvalidRequestError, match=f"more than {image_formats.MAX_JPEG_SCANS} scans"):
        decode_image(many, LIMITS)
    # An RLE8 BMP (PIL decodes those in pure Python): its header says compression 1.
    bmp = bytearray(encode(noise("P"), "BMP"))
    bmp[30:34] = struct.pack("<I", 1)
    with pytest.raises(InvalidRequestError, match="compression 1 is not accepted"):
        decode_image(bytes(bmp), LIMITS)
    assert pil_never_opens == []


def test_garbage_and_empty_files_are_typed_refusals():
    for data in (b"", b"\x89PNG", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBP", b"BM", b"\xff\xd8\xff", b"hello world"):
        with pytest.raises(InvalidRequestError):
            decode_image(data, LIMITS)
