"""Images of a request: placeholder expansion, the vision tower run, and what the caches see.

A prompt carries one image placeholder (`image_token_id`) per image; `expand` turns each into its
span (`cedlm.text.images.expand_image_tokens`) and returns one `RequestImage` per image: where
its span starts, how long it is, the prepared patches and a content digest. The tower runs once
per request (`span_embeds`, at its first prefill, unless the server ran it before submitting:
`PreparedImage.embeds`; a preempted request keeps them), and the
sequence state gets `[(start, embeddings)]` for prefill and replay to splice in. The prefix cache
mixes `(start, length, digest)` of every span that touches a block into that block's hash
(`cedlm.cache.prefix.block_hashes`), so the same token ids with different images never share
blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cedlm.text.images import PreparedImage, expand_image_tokens, load_image


@dataclass
class RequestImage:
    image: PreparedImage
    start: int                     # first span position in the prompt
    length: int                    # span positions (= image.num_tokens)
    embeds: torch.Tensor | None = None


def prepare_images(model, images) -> list[PreparedImage]:
    """Images in any form `load_image` takes (PreparedImage, PIL image, bytes, data: URL, path)."""
    from cedlm.config.vision import vision_config_of
    if model.image_token_id is None:
        raise ValueError("images: this model has no vision tower (its config has no vision_config / "
                         "image_token_id)")
    vc = vision_config_of(model.cfg)
    return [load_image(im, vc) for im in images]


def expand(model, prompt_ids: list[int], images) -> tuple[list[int], list[RequestImage]]:
    """(expanded ids, RequestImages) of a prompt with one placeholder per image."""
    prepared = prepare_images(model, images)
    ids, spans = expand_image_tokens(list(prompt_ids), prepared, model.image_token_id)
    return ids, [RequestImage(im, s, n, im.embeds) for im, (s, n) in zip(prepared, spans)]


@torch.no_grad()
def span_embeds(model, images: list[RequestImage]) -> list[tuple[int, torch.Tensor]]:
    """[(start, span embeddings)] for a sequence state; runs the tower for images not yet run."""
    from cedlm.engine.loader import model_device
    from cedlm.model.vision import encode_image
    dev = model_device(model)                  # the patches are prepared on the host
    out = []
    for im in images:
        if im.embeds is None:
            im.embeds = encode_image(model, im.image.patches.to(dev, non_blocking=True),
                                     im.image.vit_grid, im.image.llm_grid)
        out.append((im.start, im.embeds))
    return out

