"""Montage PNGs: demo samples (the same emoji in each art style, Fashion-MNIST classes) and zero-shot predictions."""
from __future__ import annotations

import glob
import io
import json
import os
import textwrap

from PIL import Image, ImageDraw, ImageFont

from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import iter_tar_samples

from diffmm_demo.datasets import STYLES


def _first_samples(pattern: str, n: int, keys: list[str] | None = None) -> list[dict]:
    stats = DataStats("montage")
    out: list[dict] = []
    for url in sorted(glob.glob(pattern)):
        for s in iter_tar_samples(url, stats):
            if keys is None or s["__key__"] in keys:
                out.append(s)
            if keys is None and len(out) >= n:
                return out
    if keys is not None:
        by_key = {s["__key__"]: s for s in out}
        return [by_key[k] for k in keys if k in by_key]
    return out


def _image(sample: dict) -> Image.Image:
    field = next(f for f in ("png", "jpg", "webp") if f in sample)
    return Image.open(io.BytesIO(sample[field])).convert("RGB")


def draw_demo_montage(data: str = "data", out: str = "docs/img/demo_montage.png", n_cols: int = 8,
                      cell: int = 96) -> str:
    """Draw the same emoji in each style and one Fashion-MNIST image per class into a PNG; prints and returns its path.

    Args:
        data: the demo data folder.
        out: the PNG to write.
        n_cols: samples per row.
        cell: side of one cell in px.

    Raises:
        FileNotFoundError: no emoji or Fashion-MNIST shards under ``data``.
    """
    font = ImageFont.load_default(size=11)
    rows: list[tuple[str, list[tuple[Image.Image, str]]]] = []
    emoji_dir = os.path.join(data, "emoji")
    styles = sorted(d for d in os.listdir(emoji_dir)) if os.path.isdir(emoji_dir) else []
    styles = [s for s in STYLES if s in styles]
    if styles:
        first = _first_samples(os.path.join(emoji_dir, styles[0], "*.tar"), n_cols)
        keys = [s["__key__"] for s in first]
        for style in styles:
            samples = _first_samples(os.path.join(emoji_dir, style, "*.tar"), n_cols, keys)
            rows.append((f"emoji/{style}", [(_image(s), s["txt"].decode()) for s in samples]))
    fm = os.path.join(data, "fashion-mnist", "test", "*.tar")
    if glob.glob(fm):
        picked: dict[int, dict] = {}
        for s in _first_samples(fm, 200):
            picked.setdefault(int(s["cls"]), s)
        cells = [(_image(picked[c]), json.loads(picked[c]["json"])["class"]) for c in sorted(picked)][:n_cols]
        rows.append(("fashion-mnist", cells))
    if not rows:
        raise FileNotFoundError(f"{data}: no emoji or fashion-mnist shards to draw "
                                "(build them with python -m diffmm_demo data all)")
    label_w, text_h = 110, 40
    sheet = Image.new("RGB", (label_w + n_cols * cell, len(rows) * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (label, cells) in enumerate(rows):
        y = r * (cell + text_h)
        draw.text((4, y + cell // 2), label, fill="black", font=font)
        for c, (img, caption) in enumerate(cells):
            x = label_w + c * cell
            sheet.paste(img.resize((cell - 8, cell - 8), Image.NEAREST if img.width < 40 else Image.LANCZOS),
                        (x + 4, y + 4))
            short = caption.replace("an emoji of ", "")
            draw.multiline_text((x + 2, y + cell - 2), "\n".join(textwrap.wrap(short, 16)[:3]), fill="black",
                                font=font, spacing=1)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    sheet.save(out)
    print(f"wrote {out}")
    return out


def draw_predictions(cells: list[tuple[Image.Image, str, str, float]], out: str, title: str, n_cols: int = 8,
                     cell: int = 96) -> str:
    """A grid of images with the predicted label and its probability under each (green: right, red: wrong) and the
    true label below; ``cells`` = (image, true label, predicted label, probability). Returns ``out``."""
    font = ImageFont.load_default(size=11)
    text_h, title_h = 44, 22
    rows = (len(cells) + n_cols - 1) // n_cols
    sheet = Image.new("RGB", (n_cols * cell, title_h + rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((4, 4), title, fill="black", font=font)
    for i, (img, true, pred, prob) in enumerate(cells):
        x, y = (i % n_cols) * cell, title_h + (i // n_cols) * (cell + text_h)
        sheet.paste(img.convert("RGB").resize((cell - 16, cell - 16), Image.LANCZOS), (x + 8, y + 4))
        draw.multiline_text((x + 2, y + cell - 10), "\n".join(textwrap.wrap(f"{pred} {100 * prob:.0f}%", 17)[:2]),
                            fill=(0, 130, 0) if pred == true else (200, 0, 0), font=font, spacing=1)
        draw.text((x + 2, y + cell + 18), textwrap.shorten(f"({true})", 17, placeholder="…)"), fill="gray", font=font)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    sheet.save(out)
    return out
