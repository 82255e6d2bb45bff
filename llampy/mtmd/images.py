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


_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}
_PRECISION_BITS = 32 - 8 - 2     # 22 fractional bits: a uint8 times a weight, summed, stays in an int32


def _filter(algo: str, x: float) -> float:
    if algo == "lanczos":
        if -3.0 <= x < 3.0:
            return _sinc(x) * _sinc(x / 3.0)
        return 0.0
    x = abs(x)
    if algo == "bilinear":
        return 1.0 - x if x < 1.0 else 0.0
    a = -0.5                     # Pillow's bicubic (PyTorch's is -0.75)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _sinc(v: float) -> float:
    if v == 0.0:
        return 1.0
    pv = v * 3.141592653589793238462643383279502884
    return math.sin(pv) / pv


def _coeffs(n_in: int, n_out: int, algo: str):
    """One axis's filter as llama.cpp's resize_pillow precomputes it: per output pixel the first input index and
    fixed-point weights (0 past the pixels it reads), in double precision then rounded half away from zero."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = _SUPPORT[algo] * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    idx = np.zeros((n_out, ksize), np.int64)
    wts = np.zeros((n_out, ksize), np.int64)
    fxp = math.ldexp(1.0, _PRECISION_BITS)
    ss = 1.0 / filterscale
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in) - xmin
        w = [_filter(algo, (x + xmin - center + 0.5) * ss) for x in range(xmax)]
        ww = 0.0
        for v in w:
            ww += v
        for x in range(xmax):
            v = w[x] / ww if ww != 0.0 else w[x]
            wts[xx, x] = int(v * fxp + (-0.5 if v < 0 else 0.5))     # C's truncation toward zero
            idx[xx, x] = xmin + x
        idx[xx, xmax:] = xmin
    return idx, wts


def _pass(img: np.ndarray, n_out: int, algo: str, axis: int) -> np.ndarray:
    idx, wts = _coeffs(img.shape[axis], n_out, algo)
    src = img.astype(np.int64)
    acc = np.full(img.shape[:axis] + (n_out,) + img.shape[axis + 1:], 1 << (_PRECISION_BITS - 1), np.int64)
    for k in range(idx.shape[1]):
        taken = np.take(src, idx[:, k], axis=axis)
        shape = [1] * img.ndim
        shape[axis] = n_out
        acc += taken * wts[:, k].reshape(shape)
    return np.clip(acc >> _PRECISION_BITS, 0, 255).astype(np.uint8)


def resize(img: np.ndarray, width: int, height: int, algo: str = "bilinear") -> np.ndarray:
    """llama.cpp's resize_pillow (a port of Pillow's separable resampling, 22-bit fixed point): the horizontal pass
    then the vertical, each only where that side changes; computed here in the same integers."""
    if algo not in _SUPPORT:
        raise ValueError(f"unknown resize algorithm {algo!r}")
    if not (0 < width <= 65536 and 0 < height <= 65536):
        raise ImageError(f"resize target {width}x{height} is out of range (max 65536)")
    out = img
    if width != img.shape[1]:
        out = _pass(out, width, algo, 1)
    if height != img.shape[0]:
        out = _pass(out, height, algo, 0)
    return out.copy() if out is img else out


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


@dataclass
class Preprocessed:
    """An image's encoder inputs, float32 (H, W, 3) each, in llama.cpp's entry order: for tiled projectors the
    overview (the whole image at tile size) first, then the tiles row by row (``grid_x`` x ``grid_y``)."""
    images: list
    grid_x: int = 0
    grid_y: int = 0

    @property
    def tiled(self) -> bool:
        return self.grid_x > 0


def crop(img: np.ndarray, x: int, y: int, w: int, h: int) -> np.ndarray:
    return np.ascontiguousarray(img[y:y + h, x:x + w])


def _idefics3(img: np.ndarray, hp) -> tuple[np.ndarray, list, int, int]:
    """mtmd_image_preprocessor_idefics3: the image resized (ratio kept) so its longer side is the preprocessor
    size, stretched up to whole tiles, cut into tiles; the overview is the stretched image resized to one tile."""
    ts = hp.image_size
    h0, w0 = img.shape[:2]
    algo = hp.resize_algo
    if hp.preproc_image_size > 0:
        edge = hp.preproc_image_size
        aspect = w0 / h0                                  # double, as llama.cpp
        if w0 >= h0:
            rw, rh = edge, int(edge / aspect)
            rh += rh % 2
        else:
            rw, rh = int(edge * aspect), edge
            rw += rw % 2
        if rw <= 0 or rh <= 0:
            raise ImageError(f"image {w0}x{h0} is too thin to resize to a longest side of {edge}")
        gx, gy = (rw + ts - 1) // ts, (rh + ts - 1) // ts
        resized = resize(img, rw, rh, algo) if (rw, rh) != (w0, h0) else img
        refined = resize(resized, gx * ts, gy * ts, algo) if (gx * ts, gy * ts) != (rw, rh) else resized
        overview = resize(refined, ts, ts, algo) if refined.shape[:2] != (ts, ts) else refined.copy()
    else:
        # files without the preprocessor size: llava-uhd slicing, the refined size the image's own rounded to
        # whole tiles (calc_size_preserved_ratio), letterboxed; the overview from the original image, bicubic
        f32 = np.float32
        gx = max(1, math.floor(float(f32(w0) / f32(ts)) + 0.5))        # std::round: halves away from zero
        gy = max(1, math.floor(float(f32(h0) / f32(ts)) + 0.5))
        overview = resize(img, ts, ts, "bicubic") if (w0, h0) != (ts, ts) else img.copy()
        refined = resize_to(img, gx * ts, gy * ts, "bicubic", "ceil", (0, 0, 0))
    tiles = [crop(refined, x * ts, y * ts, ts, ts) for y in range(gy) for x in range(gx)]
    return overview, tiles, gx, gy


def size_preserved_ratio(w: int, h: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """img_tool::calc_size_preserved_ratio without a longest edge: each side rounded to a multiple of align (at least
    one), then scaled down into max_pixels (floor) or up into min_pixels (ceil), in float32 as llama.cpp."""
    f32 = np.float32
    fa = f32(align)

    def rnd(x):      # std::round of a float32: halves away from zero
        return int(math.floor(float(f32(x) / fa) + 0.5)) * align

    def ceil_(x):
        return int(math.ceil(float(f32(x) / fa))) * align

    def floor_(x):
        return int(math.floor(float(f32(x) / fa))) * align

    w_bar, h_bar = max(align, rnd(f32(w))), max(align, rnd(f32(h)))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = f32(math.sqrt(f32(f32(h) * f32(w)) / f32(max_pixels)))
        h_bar, w_bar = max(align, floor_(f32(f32(h) / beta))), max(align, floor_(f32(f32(w) / beta)))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = f32(math.sqrt(f32(f32(min_pixels) / f32(f32(h) * f32(w)))))
        h_bar, w_bar = ceil_(f32(f32(h) * beta)), ceil_(f32(f32(w) * beta))
    return w_bar, h_bar


def preprocess(bitmap: Bitmap, hparams) -> Preprocessed:
    """The encoder inputs of one image: for gemma3 one image_size square (letterboxed); for idefics3 an overview
    and the tiles."""
    hp = hparams
    if hp.proj_type == "gemma3":
        sq = resize_to(bitmap.data, hp.image_size, hp.image_size, hp.resize_algo, hp.resize_pad, hp.pad_color)
        return Preprocessed([normalize(sq, hp.image_mean, hp.image_std)])
    if hp.proj_type in ("qwen2vl_merger", "qwen2.5vl_merger"):
        # mtmd_image_preprocessor_dyn_size: the size kept near the image's own, aligned to 2x2 patches, its area
        # within the token limits, the image letterboxed into it
        h0, w0 = bitmap.data.shape[:2]
        tw, th = size_preserved_ratio(w0, h0, hp.patch_size * hp.n_merge, hp.min_pixels, hp.max_pixels)
        img = resize_to(bitmap.data, tw, th, hp.resize_algo, hp.resize_pad, hp.pad_color)
        return Preprocessed([normalize(img, hp.image_mean, hp.image_std)])
    if hp.proj_type == "idefics3":
        overview, tiles, gx, gy = _idefics3(bitmap.data, hp)
        return Preprocessed([normalize(t, hp.image_mean, hp.image_std) for t in [overview] + tiles], gx, gy)
    raise ImageError(f"image preprocessing for the {hp.proj_type} projector is not implemented")
