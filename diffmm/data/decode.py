"""Sample fields to Python values (image, text, label), or a counted skip when a field cannot be used.

Fields hold a tar member's bytes as the tar reader yields them, or a value that a pipeline stage
(``wds.decode("pil")``, see :mod:`diffmm.data.stages`) has decoded already: a PIL image, a ``str``,
an ``int`` or a parsed JSON ``dict``. Both are accepted.
"""
from __future__ import annotations

import io
import json
import warnings
from typing import Any, Optional

from PIL import Image

from diffmm.data.stats import DataStats

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
#: default cap on decoded image size (pixels): Pillow's own decompression-bomb threshold
MAX_IMAGE_PIXELS = int(Image.MAX_IMAGE_PIXELS or 89_478_485)


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
    pillow_limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check would warn (or raise at 2x its limit): ours below replaces it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if max_pixels is None or (pillow_limit and 2 * pillow_limit < max_pixels):
                Image.MAX_IMAGE_PIXELS = None  # the caller asked for more than Pillow allows
            img = Image.open(io.BytesIO(value))
            w, h = img.size
            if max_pixels is not None and w * h > max_pixels:
                stats.skip("image_too_large", where, f"{field}: {w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")
                return None
            img.load()
    except Image.DecompressionBombError as e:
        stats.skip("image_too_large", where, f"{field}: {e}")
        return None
    except Exception as e:  # PIL raises many types for bad bytes
        stats.skip("corrupt_image", where, f"{field}: {type(e).__name__}: {e}")
        return None
    finally:
        Image.MAX_IMAGE_PIXELS = pillow_limit
    return img


def decode_text(sample: dict, field: str, stats: DataStats, where: str) -> Optional[str]:
    """The UTF-8 text of ``sample[field]`` (a caption, a document), or ``None`` after counting
    ``missing_text`` / ``bad_utf8``."""
    value = sample.get(field)
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, bytearray)):
        stats.skip("missing_text", where, f"no {field!r} field" if value is None else f"{field}: {type(value).__name__}")
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        stats.skip("bad_utf8", where, str(e))
        return None


def parse_label(sample: dict, field: str) -> int:
    """An int label: ``"cls"`` reads ``KEY.cls``; ``"json:NAME"`` reads ``NAME`` from ``KEY.json``.

    Raises:
        KeyError, ValueError, UnicodeDecodeError: the field is missing or not an integer.
    """
    if field.startswith("json:"):
        meta = sample["json"]
        return int((meta if isinstance(meta, dict) else json.loads(meta))[field[len("json:"):]])
    value = sample[field]
    return int(value.decode("utf-8").strip() if isinstance(value, (bytes, bytearray)) else value)
