"""Images in: bytes decoded to RGB8 by Pillow (PNG, JPEG, BMP, GIF, WebP: what it reads), then resized as llama.cpp's
preprocessor does for the projector (mtmd-image.cpp) and normalised with the file's mean and std.

Pillow is the ``images`` extra (the server's install includes it); without it, loading an image says so.
"""
from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np

# a decoded RGB8 image larger than this is refused before its pixels are decoded (a small file can declare a huge
# size: a decompression bomb); 2^26 pixels is 192 MiB of RGB8, past any encoder's input
MAX_PIXELS = 1 << 26


class ImageError(ValueError):
    """The bytes are not an image llampy can use."""


@dataclass
class Bitmap:
    """An RGB8 image (llama.cpp's mtmd_bitmap): ``data`` uint8 (H, W, 3); ``id`` the hash of the bytes it came from,
    the key of the encoded-image cache."""
    data: np.ndarray
    id: str

    @property
    def nx(self) -> int:
        return self.data.shape[1]

    @property
    def ny(self) -> int:
        return self.data.shape[0]


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ImageError("images need Pillow: pip install 'llampy[images]'") from None
    return Image


def bitmap_from_bytes(data: bytes, max_pixels: int = MAX_PIXELS) -> Bitmap:
    """Decode an image file's bytes to RGB8 (an alpha channel is dropped, as stb_image drops it for llama.cpp)."""
    Image = _pillow()
    if not data:
        raise ImageError("failed to decode image: no bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)    # the size is checked below
            im = Image.open(io.BytesIO(data))
        w, h = im.size                   # the header only: nothing is decoded yet
    except Image.DecompressionBombError:
        raise ImageError(f"image too large: its declared size exceeds Pillow's limit of {Image.MAX_IMAGE_PIXELS * 2} "
                         f"pixels (a decompression bomb?)") from None
    except Image.UnidentifiedImageError:
        raise ImageError("failed to decode image: not an image format Pillow reads (PNG, JPEG, BMP, GIF, WebP, ...)") \
            from None
    except Exception as e:          # Pillow raises many kinds for bytes it cannot read
        raise ImageError(f"failed to decode image: {_why(e)}") from None
    if w <= 0 or h <= 0:
        raise ImageError(f"failed to decode image: it declares a size of {w}x{h}")
    if w * h > max_pixels:
        raise ImageError(f"image too large: {w}x{h} pixels declared (at most {max_pixels} are decoded; a "
                         f"decompression bomb?)")
    try:
        im.load()
        rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as e:
        raise ImageError(f"failed to decode image: {_why(e)}") from None
    return Bitmap(np.ascontiguousarray(rgb), hashlib.sha256(data).hexdigest())


def bitmap_from_file(path) -> Bitmap:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ImageError(f"cannot read image {path}: {e.strerror or e}") from None
    try:
        return bitmap_from_bytes(data)
    except ImageError as e:
        raise ImageError(f"{path}: {e}") from None


def _why(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


_ALGO = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}


def resize(img: np.ndarray, width: int, height: int, algo: str = "bilinear") -> np.ndarray:
    """Pillow's resampling (llama.cpp's resize_pillow is a port of it: separable passes, 22-bit fixed point)."""
    if img.shape[1] == width and img.shape[0] == height:
        return img.copy()
    Image = _pillow()
    out = Image.fromarray(img, "RGB").resize((width, height), getattr(Image.Resampling, _ALGO[algo]))
    return np.asarray(out, dtype=np.uint8)


def resize_to(img: np.ndarray, width: int, height: int, algo: str, pad: str = "ceil",
              pad_color=(0, 0, 0)) -> np.ndarray:
    """img_tool::resize: unchanged at the target size; with pad 'none' stretched to it; with 'ceil' scaled to fit
    (each side ceil(side * scale), scale = the smaller ratio, in float32) and centred on pad_color."""
    h0, w0 = img.shape[:2]
    if (w0, h0) == (width, height):
        return img.copy()
    if pad == "none":
        return resize(img, width, height, algo)
    f32 = np.float32
    scale = min(f32(width) / f32(w0), f32(height) / f32(h0))
    nw = min(int(math.ceil(f32(w0) * scale)), width)
    nh = min(int(math.ceil(f32(h0) * scale)), height)
    small = resize(img, nw, nh, algo)
    out = np.empty((height, width, 3), np.uint8)
    out[...] = np.asarray(pad_color, np.uint8)
    ox, oy = (width - nw) // 2, (height - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = small
    return out


def normalize(img: np.ndarray, mean, std) -> np.ndarray:
    """clip_image_f32: x / 255 then (x - mean) / std per channel, in float32 as llama.cpp computes it."""
    f32 = np.float32
    x = img.astype(f32) / f32(255.0)
    m = np.asarray(mean, f32)
    s = np.asarray(std, f32)
    return ((x - m) / s).astype(f32)


def preprocess(bitmap: Bitmap, hparams) -> list[np.ndarray]:
    """The encoder inputs of one image, float32 (H, W, 3) each: for gemma3 one image_size square."""
    hp = hparams
    if hp.proj_type == "gemma3":
        sq = resize_to(bitmap.data, hp.image_size, hp.image_size, hp.resize_algo, hp.resize_pad, hp.pad_color)
        return [normalize(sq, hp.image_mean, hp.image_std)]
    raise ImageError(f"image preprocessing for the {hp.proj_type} projector is not implemented")
