"""Images in chat requests: `image_url` content parts -> prepared images for the engine.

OpenAI-style parts `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
(PNG or JPEG, decoded with Pillow by `cedlm.text.images`). Remote `http(s)` URLs are refused
with a 400 unless the operator started the server with `--allow-remote-images`; then they are
fetched by `remote_images.fetch`: public addresses only (checked after DNS, and connected to as
checked), one deadline and the same byte limit, and one generic 400 for every failure (a client
cannot probe which hosts or ports exist). The image count is checked before anything is fetched
or decoded, then every image's pixel count from its header, each against `max_pixels` and all
of them together against `max_request_pixels`, before any pixel is decoded. Every bad image is
a 400 naming the part and the limit (size, pixels, count, format, corrupt/truncated data); a
model without a vision tower answers 400 for any image.

Image work has its own lane (`chat_images_async`): decoding, preprocessing and the vision tower run
in the server's image thread (`IMAGE_THREADS`), never on the event loop, in the shared thread
pool or on the engine thread: the tower's span embeddings go to the engine with the image
(`PreparedImage.embeds`), so a request with many large images costs one core of image work and
stalls no other stream.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from cedlm.server.errors import APIError
from cedlm.server.remote_images import FetchError, fetch, public_address
from cedlm.text.images import (ImageError, ImageLimits, decode_data_url, decode_image, image_size, message_images,
                               preprocess)

IMAGE_THREADS = 1


@dataclass
class ImageOptions:
    vision: object | None = None                  # the model's VisionConfig (None: no vision tower)
    limits: ImageLimits = field(default_factory=ImageLimits)
    allow_remote: bool = False                     # fetch http(s) image URLs (operator flag)
    fetch_timeout: float = 10.0                    # seconds for one fetch, DNS to the last byte
    address_ok: Callable = public_address          # which resolved addresses a fetch may connect to
    encode: Callable | None = None                 # PreparedImage -> span embeddings (the vision tower)
    executor: ThreadPoolExecutor | None = None     # the image lane (started on first use)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def lane(self) -> ThreadPoolExecutor:
        with self._lock:
            if self.executor is None:
                import torch
                n = torch.get_num_threads()    # the engine's setting, in the image thread too
                self.executor = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="cedlm-image",
                                                   initializer=torch.set_num_threads, initargs=(n,))
            return self.executor


def options_for(model, allow_remote: bool = False, limits: ImageLimits | None = None) -> ImageOptions:
    from cedlm.config.vision import vision_config_of
    vc = vision_config_of(model.cfg) if getattr(model, "image_token_id", None) is not None else None
    return ImageOptions(vc, limits or ImageLimits(), allow_remote,
                        encode=(lambda im: _tower(model, im)) if vc is not None else None)


def _tower(model, im):
    """The span embeddings of a prepared image, as the engine computes them (engine/images.py)."""
    import torch

    from cedlm.engine.loader import model_device
    from cedlm.model.vision import encode_image
    with torch.no_grad():
        return encode_image(model, im.patches.to(model_device(model), non_blocking=True), im.vit_grid,
                            im.llm_grid)


async def chat_images_async(opts: ImageOptions | None, messages: list[dict]) -> list:
    """`chat_images` in the image lane, off the event loop and the shared pool; a request without
    images never waits there."""
    if opts is None or opts.vision is None or not message_images(messages):
        return chat_images(opts, messages)         # nothing to decode: [] or the 400, at once
    return await asyncio.wrap_future(opts.lane().submit(chat_images, opts, messages))


def _fetch(url: str, opts: ImageOptions) -> bytes:
    try:
        return fetch(url, opts.limits.max_bytes, opts.fetch_timeout, opts.address_ok)
    except FetchError as e:
        raise ImageError(str(e)) from None


def _source_bytes(url, opts: ImageOptions) -> bytes:
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url: must be a non-empty string")
    low = url[:8].lower()
    if low.startswith("data:"):
        return decode_data_url(url, opts.limits)
    if low.startswith(("http://", "https://")):
        if not opts.allow_remote:
            raise ImageError("image_url: remote http(s) image URLs are disabled on this server (the "
                             "operator can enable them with --allow-remote-images); send the image "
                             "inline as a data: URL (data:image/png;base64,...)")
        return _fetch(url, opts)
    raise ImageError("image_url.url: only data: URLs (and http(s) when enabled) are accepted")


def chat_images(opts: ImageOptions | None, messages: list[dict]) -> list:
    """PreparedImages of a chat request's image parts, in placeholder order; APIError 400."""
    sources = message_images(messages)
    if not sources:
        return []
    if opts is None or opts.vision is None:
        raise APIError(400, "messages: this model has no vision tower; image content parts are not "
                            "supported", param="messages")
    if len(sources) > opts.limits.max_images:
        raise APIError(400, f"messages: {len(sources)} images exceed the limit of "
                            f"{opts.limits.max_images} per request", param="messages")
    data, total = [], 0
    for i, src in enumerate(sources):                # sizes from the headers, before any decoding
        try:
            raw = _source_bytes(src, opts)
            w, h = image_size(raw, opts.limits)
        except ImageError as e:
            raise APIError(400, f"messages: image {i}: {e}", param="messages") from None
        data.append(raw)
        total += w * h
        if total > opts.limits.max_request_pixels:
            raise APIError(400, f"messages: the images have more than {opts.limits.max_request_pixels} pixels "
                                f"in all (the limit per request, max_request_pixels; {total} up to image {i})",
                           param="messages")
    out = []
    for i, raw in enumerate(data):
        try:
            im = preprocess(decode_image(raw, opts.limits), opts.vision)
        except ImageError as e:
            raise APIError(400, f"messages: image {i}: {e}", param="messages") from None
        data[i] = None                               # the encoded bytes are not needed any more
        if opts.encode is not None:
            im.embeds = opts.encode(im)
        out.append(im)
    return out


def expanded_len(n_ids: int, images: list) -> int:
    """Prompt length once each of the images' placeholders becomes its span."""
    return n_ids - len(images) + sum(im.num_tokens for im in images)
