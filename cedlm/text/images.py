"""Image inputs of the V4.1 vision model: decoding (with limits), preprocessing into ViT patches,
the exact image-token count, and the expansion of image placeholders in a token sequence.

Preprocessing follows the published V4.1 image processor (`load_image`): the image (RGB) is
clamped to `max_wh_ratio` (if set), scaled up to at least `min_pixels`, rounded up to whole
patches, and shrunk (aspect kept) while its span would cost more than `max_image_tokens`; then
padded (centred, grey 127) to that pixel size (resized instead when the width clamp applied),
normalised to [-1, 1] (rounded to BF16 as the reference does) and cut into row-major patches.
A grid of n_vit_h x n_vit_w patches gives n_llm = ceil(n_vit / downsample_ratio) per axis and

    num_image_tokens(n_llm_h, n_llm_w) = n_llm_h * (n_llm_w + 1) + 2

span positions (start, one newline per row, end). `image_token_count(width, height, vc)` gives
it from the pixel size alone (planner, KV accounting, API). In a prompt, each single image
placeholder token becomes that many `image_token_id` positions (`expand_image_tokens`).

Decoding accepts PNG and JPEG only; `ImageError` (a ValueError; the server answers 400) names
the limit for oversized input, too many pixels (decompression bombs: the header's size is checked
before any pixel is decoded), corrupt or truncated data.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cedlm.config.vision import VisionConfig

FORMATS = ("PNG", "JPEG")


class ImageError(ValueError):
    """A bad image input (HTTP 400)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024         # encoded size
    max_pixels: int = 40_000_000              # width * height from the header (bomb guard)
    max_images: int = 16                      # per request
    max_request_pixels: int = 64_000_000      # all of a request's images, from their headers


# ---------------------------------------------------------------- token geometry (reference formulas)
def llm_grid(best_height: int, best_width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    return (math.ceil((best_height // patch_size) / downsample_ratio),
            math.ceil((best_width // patch_size) / downsample_ratio))


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def _solve_resize(height, width, p, r, max_n):
    """The largest aspect-kept pixel size whose span fits in max_n tokens."""
    ratio = height / width
    max_w = math.sqrt((max_n - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    cell = p * r
    if max_w < 1.0:                                   # very tall: one column
        return (max_n - 2) // 2 * cell, cell
    if max_h < 1.0:                                   # very wide: one row
        return cell, (max_n - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def _target(width: float, height: float, vc: VisionConfig):
    """(size after the ratio clamp / min-pixels scale, (best_h, best_w) pixel size)."""
    p = vc.patch_size
    if vc.max_wh_ratio is not None and width > height * vc.max_wh_ratio:
        width = height * vc.max_wh_ratio
    if 0 < width * height < vc.min_pixels:
        s = (vc.min_pixels / (width * height)) ** 0.5
        width, height = int(width * s), int(height * s)
    bw, bh = math.ceil(width / p) * p, math.ceil(height / p) * p
    lh, lw = llm_grid(bh, bw, p, vc.downsample_ratio)
    if num_image_tokens(lh, lw) > vc.max_image_tokens:
        bh, bw = _solve_resize(height, width, p, vc.downsample_ratio, vc.max_image_tokens)
    return bh, bw


def image_grid(width: int, height: int, vc: VisionConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((n_vit_h, n_vit_w), (n_llm_h, n_llm_w)) of an image of this pixel size."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image: size {width}x{height} is empty")
    bh, bw = _target(width, height, vc)
    p = vc.patch_size
    return (bh // p, bw // p), llm_grid(bh, bw, p, vc.downsample_ratio)


def image_token_count(width: int, height: int, vc: VisionConfig) -> int:
    """Exact number of prompt positions an image of this pixel size occupies."""
    return num_image_tokens(*image_grid(width, height, vc)[1])


# ---------------------------------------------------------------- decoding
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?)(?P<b64>;base64)?,", re.I)


def decode_data_url(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes of a `data:` URL (base64 or percent-encoded)."""
    m = _DATA_URL.match(url)
    if not m:
        raise ImageError("image_url: not a data: URL (data:image/png;base64,...)")
    payload = url[m.end():]
    if m.group("b64"):
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise ImageError(f"image_url: the image is larger than the limit of {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("image_url: the data: URL is not valid base64") from None
    from urllib.parse import unquote_to_bytes
    return unquote_to_bytes(payload)


def image_size(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[int, int]:
    """(width, height) from the header alone (no pixel is decoded), with `decode_image`'s checks
    of bytes, format and pixels; ImageError naming the limit or the problem."""
    im = _open(data, limits)
    return im.size


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()):
    """PNG/JPEG bytes -> an RGB PIL image, or ImageError naming the limit or the problem."""
    im = _open(data, limits)
    try:
        im.load()
        return im.convert("RGB")
    except Exception as e:                          # noqa: BLE001 - truncated / corrupt pixel data
        raise ImageError(f"image: the {im.format} data is truncated or corrupt ({type(e).__name__})") from None


def _open(data: bytes, limits: ImageLimits):
    """The PIL image, opened lazily (header read, pixels not decoded), its size checked."""
    from PIL import Image
    if len(data) > limits.max_bytes:
        raise ImageError(f"image: {len(data)} bytes exceed the limit of {limits.max_bytes} bytes")
    if not data:
        raise ImageError("image: empty data")
    try:
        with warnings.catch_warnings():             # the size is checked below, with our limit
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageError(f"image: too many pixels (decompression bomb); the limit is "
                         f"{limits.max_pixels} pixels") from None
    except Exception:                               # noqa: BLE001 - any PIL failure is a bad image
        raise ImageError("image: cannot identify the image data (corrupt, or not PNG/JPEG)") from None
    if im.format not in FORMATS:
        raise ImageError(f"image: format {im.format} is not supported (PNG, JPEG)")
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageError(f"image: size {w}x{h} is empty")
    if w * h > limits.max_pixels:
        raise ImageError(f"image: {w}x{h} = {w * h} pixels exceed the limit of {limits.max_pixels} "
                         f"pixels (max_image_pixels)")
    return im


# ---------------------------------------------------------------- preprocessing
@dataclass
class PreparedImage:
    """One image ready for the tower: patches [n_vit_h*n_vit_w, 3, p, p] (fp32 of BF16 values)."""
    patches: torch.Tensor
    vit_grid: tuple[int, int]
    llm_grid: tuple[int, int]
    digest: bytes                                   # content hash (prefix-cache keys)
    embeds: torch.Tensor | None = None              # the tower's output, when run before the engine

    @property
    def num_tokens(self) -> int:
        return num_image_tokens(*self.llm_grid)


def _pad_to(image, size: tuple[int, int]):
    """Aspect-kept resize into `size` (w, h), centred on grey 127 (PIL's ImageOps.pad)."""
    from PIL import ImageOps
    return ImageOps.pad(image, size, color=(127, 127, 127))


def preprocess(image, vc: VisionConfig) -> PreparedImage:
    """A PIL image -> PreparedImage (the reference transform)."""
    image = image.convert("RGB")
    w, h = image.size
    (vh, vw), lg = image_grid(w, h, vc)
    p = vc.patch_size
    bw, bh = vw * p, vh * p
    if vc.max_wh_ratio is not None and w >= vc.max_wh_ratio * h:
        image = image.resize((bw, bh))
    else:
        image = _pad_to(image, (bw, bh))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16).float()
    patches = x.reshape(3, vh, p, vw, p).permute(1, 3, 0, 2, 4).reshape(vh * vw, 3, p, p).contiguous()
    hsh = hashlib.blake2b(digest_size=16)
    hsh.update(np.asarray([vh, vw], dtype="<i4").tobytes())
    hsh.update(patches.numpy().tobytes())
    return PreparedImage(patches, (vh, vw), lg, hsh.digest())


def load_image(source, vc: VisionConfig, limits: ImageLimits = ImageLimits()) -> PreparedImage:
    """bytes / a data: URL / a file path / a PIL image -> PreparedImage."""
    from pathlib import Path
    if isinstance(source, PreparedImage):
        return source
    if isinstance(source, str) and source.startswith("data:"):
        source = decode_data_url(source, limits)
    elif isinstance(source, (str, Path)):
        source = Path(source).read_bytes()
    if isinstance(source, (bytes, bytearray)):
        source = decode_image(bytes(source), limits)
    if not hasattr(source, "convert"):
        raise ImageError(f"image: expected bytes, a data: URL, a path or a PIL image, got {type(source).__name__}")
    return preprocess(source, vc)


# ---------------------------------------------------------------- placeholders
def expand_image_tokens(ids: list[int], images: list[PreparedImage], image_token_id: int):
    """Each placeholder (one `image_token_id`) -> its span of `num_tokens` image_token_id's.

    Returns (new ids, spans) with spans[i] = (start position, length) of image i."""
    n = sum(1 for t in ids if t == image_token_id)
    if n != len(images):
        raise ImageError(f"images: the prompt has {n} image placeholder(s) for {len(images)} image(s)")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            L = images[k].num_tokens
            spans.append((len(out), L))
            out.extend([image_token_id] * L)
            k += 1
        else:
            out.append(int(t))
    return out, spans


def message_images(messages: list[dict]) -> list:
    """The image sources of chat messages, in the order the chat encoder renders their
    placeholders: `{"type": "image_url", "image_url": {"url": ...}}` (or a bare URL string) and
    `{"type": "image", "image": <PIL image | bytes | path | data: URL>}` blocks, including those
    inside `tool_result` blocks."""
    out: list = []

    def walk(blocks):
        if not isinstance(blocks, list):
            return
        for b in blocks:
            if not isinstance(b, dict):
                continue
            t = b.get("type")
            if t == "image_url":
                u = b.get("image_url")
                out.append(u.get("url") if isinstance(u, dict) else u)
            elif t == "image":
                out.append(b.get("image", b.get("url")))
            elif t == "tool_result":
                walk(b.get("content"))
    for m in messages:
        if isinstance(m, dict):
            walk(m.get("content"))
    return out
