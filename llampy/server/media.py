"""Images in requests (llama-server with --mmproj): ``image_url`` parts of chat messages and llama.cpp's
``multimodal_data`` on /completion become the engine's prompt of text tokens and image positions. Every failure is
a 400 that names it; without a projector an image is refused on every route."""
from __future__ import annotations

from .oai import APIError

NO_PROJECTOR = ("image input is not supported - hint: if this is unexpected, you may need to provide the mmproj "
                "(start the server with --mmproj FILE)")


def _media_errors():
    from ..mtmd import ImageError, MediaError
    return ImageError, MediaError


def media_messages(server, msgs: list) -> tuple[list, list]:
    """(messages with string contents, the images as bitmaps in order); messages without images unchanged."""
    from ..mtmd.content import flatten_messages, has_images
    if not has_images(msgs):
        return msgs, []
    if server.mtmd is None:
        raise APIError(400, NO_PROJECTOR, "messages")
    ImageError, MediaError = _media_errors()
    try:
        flat, raw = flatten_messages(msgs, server.mtmd.media_marker, server.allow_remote_images)
        return flat, [_bitmap(b) for b in raw]
    except (ImageError, MediaError) as e:
        raise APIError(400, str(e), "messages") from None


def _bitmap(data: bytes):
    from ..mtmd import bitmap_from_bytes
    return bitmap_from_bytes(data)


def media_tokens(server, text: str, bitmaps: list, add_special: bool, param: str = "messages") -> list:
    """The prompt with its images, flattened (text tokens and ``ImagePos``); checks that each image fits the batch
    the engine decodes it in. Runs the tokenizer: call it off the event loop."""
    ImageError, MediaError = _media_errors()
    try:
        chunks = server.mtmd.tokenize(text, bitmaps, add_special=add_special)
    except (ImageError, MediaError) as e:
        raise APIError(400, str(e), param) from None
    n_ub = server.engine.ctx.n_ubatch
    for ch in chunks:
        if ch.type == "image" and ch.n_tokens > n_ub:
            raise APIError(400, f"an image of {ch.n_tokens} tokens does not fit in the server's batch of {n_ub}",
                           param)
    toks = server.mtmd.flatten(chunks)
    v = server.model.vocab
    if not add_special and v.add_bos and v.bos is not None and (not toks or toks[0] != v.bos):
        toks = [v.bos] + toks         # a chat template's text holds BOS where the model wants it
    return toks


def completion_prompt(server, prompt) -> tuple[str, list] | None:
    """llama-server's {"prompt_string": ..., "multimodal_data": [base64, ...]} prompt object: (text, bitmaps); None
    for any other prompt."""
    if not isinstance(prompt, dict):
        return None
    text = prompt.get("prompt_string")
    if not isinstance(text, str):
        raise APIError(400, "a prompt object needs a string 'prompt_string'", "prompt")
    data = prompt.get("multimodal_data")
    if data is None:
        return text, []
    if server.mtmd is None:
        raise APIError(400, "Multimodal data provided, but model does not support multimodal requests. "
                            + NO_PROJECTOR, "prompt")
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise APIError(400, "'multimodal_data' must be a list of base64 strings", "prompt")
    from ..mtmd.content import image_bytes_from_url
    ImageError, MediaError = _media_errors()
    try:
        return text, [_bitmap(image_bytes_from_url(d)) for d in data]
    except (ImageError, MediaError) as e:
        raise APIError(400, str(e), "prompt") from None
