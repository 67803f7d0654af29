"""Sample fields to Python values (image, text, label), or a counted skip when a field cannot be used.

Fields hold a tar member's bytes as the tar reader yields them, or a value that a pipeline stage
(``wds.decode("pil")``, see :mod:`diffmm.data.stages`) has decoded already: a PIL image, a ``str``,
an ``int`` or a parsed JSON ``dict``. Both are accepted.
"""
from __future__ import annotations

import io
import json
import warnings
from typing import Any, Optional, Sequence

from PIL import Image

from diffmm.data.stats import DataStats

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
#: default cap on decoded image size (pixels): Pillow's own decompression-bomb threshold
MAX_IMAGE_PIXELS = int(Image.MAX_IMAGE_PIXELS or 89_478_485)


class BadImage(ValueError):
    """Bytes that are not an image Pillow can decode."""


class ImageTooLarge(BadImage):
    """An image with more pixels than the cap (a decompression bomb, or just too large)."""


def decode_image(sample: dict, stats: DataStats, where: str, max_pixels: Optional[int] = MAX_IMAGE_PIXELS) -> Any:
    """The sample's image, fully decoded, or ``None`` after counting a skip.

    Images with more than ``max_pixels`` pixels (width x height from the header, checked before any
    decoding) are skipped as ``image_too_large``; ``None`` lifts the cap. A PIL image that a stage
    decoded is checked against the same cap; any other decoded value (a tensor, an array) is
    returned as it is, for a transform that takes it.
    """
    field = next((f for f in IMAGE_FIELDS if f in sample), None)
    if field is None:
        stats.skip("missing_image", where, f"fields {sorted(k for k in sample if not k.startswith('__'))}")
        return None
    value = sample[field]
    if not isinstance(value, (bytes, bytearray)):
        if isinstance(value, Image.Image) and max_pixels is not None and value.width * value.height > max_pixels:
            stats.skip("image_too_large", where, f"{field}: {value.width}x{value.height} pixels > "
                                                 f"max_image_pixels={max_pixels}")
            return None
        return value
    try:
        return load_image(value, max_pixels)
    except ImageTooLarge as e:
        stats.skip("image_too_large", where, f"{field}: {e}")
    except BadImage as e:
        stats.skip("corrupt_image", where, f"{field}: {e}")
    return None


def load_image(data: bytes, max_pixels: Optional[int] = MAX_IMAGE_PIXELS) -> Image.Image:
    """Image bytes fully decoded by Pillow.

    Images with more than ``max_pixels`` pixels (width x height from the header, checked before any
    decoding) are refused; ``None`` lifts the cap (Pillow's own bomb check is replaced by this one).

    Raises:
        ImageTooLarge: more than ``max_pixels`` pixels.
        BadImage: not an image Pillow can decode.
    """
    pillow_limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check would warn (or raise at 2x its limit): ours below replaces it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if max_pixels is None or (pillow_limit and 2 * pillow_limit < max_pixels):
                Image.MAX_IMAGE_PIXELS = None  # the caller asked for more than Pillow allows
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if max_pixels is not None and w * h > max_pixels:
                raise ImageTooLarge(f"{w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")
            img.load()
            return img
    except BadImage:
        raise
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(str(e)) from None
    except Exception as e:  # PIL raises many types for bad bytes
        raise BadImage(f"not a decodable image ({type(e).__name__}: {e})") from None
    finally:
        Image.MAX_IMAGE_PIXELS = pillow_limit


def decode_text(sample: dict, field: str, stats: DataStats, where: str) -> Optional[str]:
    """The UTF-8 text of ``sample[field]`` (a caption, a document), or ``None`` after counting
    ``missing_text`` / ``bad_utf8`` / ``empty_text`` (nothing but white space)."""
    value = sample.get(field)
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray)):
        stats.skip("missing_text", where,
                   f"no {field!r} field" if value is None else f"{field}: {type(value).__name__}")
        return None
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as e:
        stats.skip("bad_utf8", where, str(e))
        return None
    if not text.strip():
        stats.skip("empty_text", where, f"{field}: empty")
        return None
    return text


def label_key(name: str) -> str:
    """A class name as labels match it: case, ``_`` and runs of spaces ignored."""
    return " ".join(name.replace("_", " ").lower().split())


def class_index(classnames: Sequence[str]) -> dict[str, Optional[int]]:
    """``label_key(name) -> index`` of class names (None for a key two names share)."""
    index: dict[str, Optional[int]] = {}
    for i, name in enumerate(classnames):
        index[label_key(name)] = None if label_key(name) in index else i
    return index


def parse_label(sample: dict, field: str, names: Optional[dict[str, Optional[int]]] = None) -> int:
    """An int label: ``"cls"`` reads ``KEY.cls``; ``"json:NAME"`` reads ``NAME`` from ``KEY.json``. A label that
    is not an integer is a class name, looked up in ``names`` (:func:`class_index`), as ImageFolder and
    CLIP_benchmark label by name.

    Raises:
        KeyError, ValueError, UnicodeDecodeError: the field is missing, or neither an integer nor a class name.
    """
    if field.startswith("json:"):
        meta = sample["json"]
        value = (meta if isinstance(meta, dict) else json.loads(meta))[field[len("json:"):]]
    else:
        value = sample[field]
        value = value.decode("utf-8").strip() if isinstance(value, (bytes, bytearray)) else value
    try:
        return int(value)
    except (TypeError, ValueError):
        if names is None:
            raise ValueError(f"{value!r} is not an integer label; give the class names to label by name") from None
    found = names.get(label_key(value), -1) if isinstance(value, str) else -1
    if found is None or found < 0:
        which = "exactly one" if found is None else "any"
        raise ValueError(f"{value!r} is neither an integer label nor {which} of the class names (case, _ and spaces "
                         f"ignored)")
    return found
