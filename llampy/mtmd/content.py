"""OpenAI-style message content with images: ``image_url`` parts become the media marker in the text, their images
bytes beside it (llama-server's oaicompat_content_load_media); the parts' text joins as llama.cpp joins it."""
from __future__ import annotations

import base64
import binascii

from .context import DEFAULT_MEDIA_MARKER, MediaError

MAX_IMAGE_BYTES = 64 << 20


def image_bytes_from_url(url: str, allow_remote: bool = False, timeout: float = 20.0) -> bytes:
    """A data URL's (or bare base64's) bytes; an http(s) URL only with ``allow_remote`` (the server's
    --allow-remote-images), fetched with a timeout and a size limit."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string")
    if url.startswith(("http://", "https://")):
        if not allow_remote:
            raise MediaError("remote image URLs are not fetched: send the image as a base64 data URL "
                             "(data:image/png;base64,...) or start the server with --allow-remote-images")
        return _fetch(url, timeout)
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep:
            raise MediaError("invalid data URL: no comma before the data")
        if not head.startswith("data:image/"):
            raise MediaError(f"invalid data URL: {head[:40]!r} is not an image type")
        if not head.endswith(";base64"):
            raise MediaError("invalid data URL: the image must be base64 encoded")
        return _b64(data)
    if "://" in url[:16]:
        raise MediaError(f"unsupported image URL scheme: {url.split('://', 1)[0]!r}")
    return _b64(url)                 # llama-server takes a bare base64 string too


def _b64(data: str) -> bytes:
    try:
        raw = base64.b64decode(data.strip(), validate=False)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 image data") from None
    if not raw:
        raise MediaError("invalid base64 image data: empty")
    return raw


def _fetch(url: str, timeout: float) -> bytes:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            raw = r.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise MediaError(f"cannot fetch the image {url}: {getattr(e, 'reason', e)}") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise MediaError(f"the image at {url} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return raw


def has_images(messages) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in messages)


def flatten_messages(messages, marker: str = DEFAULT_MEDIA_MARKER, allow_remote: bool = False):
    """(messages with string contents, the images' bytes in order). A list content's text parts are joined with
    newlines, except next to an image, which becomes ``marker``."""
    out, images = [], []
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if not isinstance(c, list):
            out.append(m)
            continue
        text, last_media = "", False
        for part in c:
            if not isinstance(part, dict):
                raise MediaError("content parts must be objects")
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text", ""), str):
                    raise MediaError("a text part's text must be a string")
                if text and not last_media:
                    text += "\n"
                text += part.get("text", "")
                last_media = False
            elif kind == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                images.append(image_bytes_from_url(url, allow_remote))
                text += marker
                last_media = True
            else:
                raise MediaError(f"unsupported content part type: {kind!r}")
        out.append({**m, "content": text})
    return out, images
