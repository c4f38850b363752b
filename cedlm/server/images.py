"""Images in chat requests: `image_url` content parts -> prepared images for the engine.

OpenAI-style parts `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
(PNG or JPEG, decoded with Pillow by `cedlm.text.images`). Remote `http(s)` URLs are refused
with a 400 unless the operator started the server with `--allow-remote-images`; then they are
fetched by `remote_images.fetch`: public addresses only (checked after DNS, and connected to as
checked), one deadline and the same byte limit, and one generic 400 for every failure (a client
cannot probe which hosts or ports exist). The image count is checked before anything is fetched
or decoded, and each image's pixel count from its header before its pixels are decoded. Every
bad image is a 400 naming the part and the limit (size, pixels, count, format, corrupt/truncated
data); a model without a vision tower answers 400 for any image. Decoding runs off the event
loop (`ServerState.tokenize`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from cedlm.server.errors import APIError
from cedlm.server.remote_images import FetchError, fetch, public_address
from cedlm.text.images import ImageError, ImageLimits, decode_data_url, decode_image, message_images, preprocess


@dataclass
class ImageOptions:
    vision: object | None = None                  # the model's VisionConfig (None: no vision tower)
    limits: ImageLimits = field(default_factory=ImageLimits)
    allow_remote: bool = False                     # fetch http(s) image URLs (operator flag)
    fetch_timeout: float = 10.0                    # seconds for one fetch, DNS to the last byte
    address_ok: Callable = public_address          # which resolved addresses a fetch may connect to


def options_for(model, allow_remote: bool = False, limits: ImageLimits | None = None) -> ImageOptions:
    from cedlm.config.vision import vision_config_of
    vc = vision_config_of(model.cfg) if getattr(model, "image_token_id", None) is not None else None
    return ImageOptions(vc, limits or ImageLimits(), allow_remote)


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
    out = []
    for i, src in enumerate(sources):
        try:
            out.append(preprocess(decode_image(_source_bytes(src, opts), opts.limits), opts.vision))
        except ImageError as e:
            raise APIError(400, f"messages: image {i}: {e}", param="messages") from None
    return out


def expanded_len(n_ids: int, images: list) -> int:
    """Prompt length once each of the images' placeholders becomes its span."""
    return n_ids - len(images) + sum(im.num_tokens for im in images)
