"""The demo datasets, built offline from Debian and npm packages (``make demo-data`` installs them).

* **emoji** (image-caption pairs): every fully-qualified emoji in four art styles, captioned from
  Unicode names and CLDR keywords. ``noto``: Debian ``fonts-noto-color-emoji`` rendered with
  Pillow (size 109, ``embedded_color``, raqm layout for ZWJ sequences); ``google`` / ``twitter``:
  npm ``emoji-datasource-google`` / ``-twitter`` 64 px PNGs; ``openmoji``: npm ``openmoji`` colour
  SVGs rendered with cairosvg. Names, groups and subgroups come from ``emoji-test.txt`` (Debian
  ``unicode-data``), keywords from CLDR ``annotations/en.xml`` + ``annotationsDerived/en.xml``
  (``unicode-cldr-core``). Each style goes to ``OUT/emoji/STYLE/emoji-STYLE-NNNNNN.tar``; the same
  emoji has the same key in every style (its code points, e.g. ``1f469_200d_1f4bb``), so one style
  can be held out for zero-shot evaluation; ``OUT/emoji/classes.json`` lists the groups and
  subgroups (labels ``KEY.json`` -> ``group_id`` / ``subgroup_id``).
* **fashion-mnist** (zero-shot classification): Debian ``dataset-fashion-mnist`` IDX files ->
  ``OUT/fashion-mnist/{train,test}/`` with ``KEY.png`` (28x28 grayscale), ``KEY.cls``, ``KEY.txt``
  (``a photo of a CLASS.``), ``KEY.json``, and ``classes.json`` (class names, prompt templates).
* **python-docs** (LM text): the Python 3.11 documentation reST sources (Debian ``python3.11-doc``)
  -> ``OUT/python-docs/{train,val}/`` (one page per sample; about 1 page in 20 goes to ``val``,
  chosen by a hash of its path), a byte-level BPE trained on the train split (``tokenizer.json``)
  and ``tokens.json`` per split.

A missing source file raises one ``FileNotFoundError`` line naming it and the package to install.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from diffmm.data.shard_tools import iter_text_files, read_texts, write_shards_from_text
from diffmm.data.text import count_tokens
from diffmm.data.tokenizers import train_byte_level_bpe
from diffmm.data.writer import ShardWriter
from diffmm.eval.classnames import FASHION_MNIST_CLASSNAMES
from diffmm.eval.idx import IdxArray, find_idx_pair
from diffmm.eval.needle import PYTHON_DOCS

from diffmm_demo.system_data import (CLDR, EMOJI_TEST, FASHION_MNIST, NOTO_EMOJI_FONT, NPM_DIR, require_debian_file,
                                     require_npm_package)

STYLES = ("noto", "google", "twitter", "openmoji")
SKIN_TONES = {0x1F3FB, 0x1F3FC, 0x1F3FD, 0x1F3FE, 0x1F3FF}
SKIP_GROUPS = ("Component",)   # bare skin-tone / hair swatches
NPM_PACKAGES = {"google": "emoji-datasource-google", "twitter": "emoji-datasource-twitter", "openmoji": "openmoji"}
FASHION_TEMPLATES = ("a photo of a {}.", "a black and white photo of a {}.", "a low resolution photo of a {}.")


# ----------------------------------------------------------------------------------------------- emoji
@dataclass
class Emoji:
    """One fully-qualified emoji from emoji-test.txt."""

    codepoints: tuple[int, ...]
    name: str
    group: str
    subgroup: str
    keywords: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(map(chr, self.codepoints))

    @property
    def key(self) -> str:
        return "_".join(f"{c:x}" for c in self.codepoints)

    @property
    def bare(self) -> str:
        """Code points without U+FE0F, upper-case hex joined by '-' (lookup key across sources)."""
        return "-".join(f"{c:X}" for c in self.codepoints if c != 0xFE0F)

    def caption(self) -> str:
        """``an emoji of NAME`` plus up to four CLDR keywords whose words are not all in the name."""
        name_words = set(self.name.lower().replace(":", " ").replace(",", " ").split())
        extra = [k for k in self.keywords if not set(k.lower().split()) <= name_words][:4]
        return f"an emoji of {self.name}" + (f", {', '.join(extra)}" if extra else "")


def parse_emoji_test(path: str = EMOJI_TEST, skin_tones: bool = False) -> list[Emoji]:
    """Fully-qualified emoji with group and subgroup, in CLDR order (``Component`` group left out)."""
    out: list[Emoji] = []
    group = subgroup = ""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.startswith("# group:"):
                group = line.split(":", 1)[1].strip()
            elif line.startswith("# subgroup:"):
                subgroup = line.split(":", 1)[1].strip()
            elif line.strip() and not line.startswith("#"):
                try:
                    cps_part, rest = line.split(";", 1)
                    status, comment = rest.split("#", 1)
                    name = comment.strip().split(" ", 2)[2]
                    cps = tuple(int(c, 16) for c in cps_part.split())
                except (ValueError, IndexError):
                    raise ValueError(f"{path}:{n}: unexpected line {line.strip()!r}") from None
                if status.strip() != "fully-qualified" or group in SKIP_GROUPS:
                    continue
                if not skin_tones and SKIN_TONES.intersection(cps):
                    continue
                out.append(Emoji(cps, name, group, subgroup))
    if not out:
        raise ValueError(f"{path}: no fully-qualified emoji found")
    return out


def parse_cldr_keywords(cldr_dir: str = CLDR, lang: str = "en") -> dict[str, list[str]]:
    """Emoji (without U+FE0F) -> CLDR keywords, from ``annotations`` and ``annotationsDerived``."""
    out: dict[str, list[str]] = {}
    for sub in ("annotations", "annotationsDerived"):
        path = os.path.join(cldr_dir, sub, f"{lang}.xml")
        if not os.path.exists(path):
            continue
        for node in ET.parse(path).getroot().iter("annotation"):
            if node.get("type") == "tts" or not node.text:
                continue
            out.setdefault(node.get("cp", ""), [k.strip() for k in node.text.split("|") if k.strip()])
    return out


def render_noto(text: str, font: ImageFont.FreeTypeFont) -> Optional[Image.Image]:
    """Render one emoji with the Noto colour font onto a transparent square, or None if not one glyph."""
    left, top, right, bottom = font.getbbox(text)
    if right - left > 1.2 * (bottom - top) or right - left <= 0:   # several glyphs: not in the font
        return None
    side = max(right - left, bottom - top)
    canvas = Image.new("RGBA", (side, side), (0, 0, 0, 0))
    ImageDraw.Draw(canvas).text(((side - (right - left)) // 2 - left, (side - (bottom - top)) // 2 - top),
                                text, font=font, embedded_color=True)
    return canvas if canvas.getbbox() else None


def on_white(img: Image.Image, size: int) -> Image.Image:
    """Composite an RGBA image onto white and resize to ``size`` x ``size`` (RGB)."""
    img = img.convert("RGBA")
    bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
    bg.alpha_composite(img)
    out = bg.convert("RGB")
    return out if out.size == (size, size) else out.resize((size, size), Image.LANCZOS)


class StyleSource:
    """Images of one art style, looked up by :attr:`Emoji.bare`.

    Raises:
        FileNotFoundError: the style's font or npm package is missing (naming the package).
    """

    def __init__(self, style: str, npm_dir: str = NPM_DIR) -> None:
        self.style = style
        self.files: dict[str, str] = {}
        if style == "noto":
            font = require_debian_file(NOTO_EMOJI_FONT, "fonts-noto-color-emoji")
            self.font = ImageFont.truetype(font, 109, layout_engine=ImageFont.Layout.RAQM)
        elif style in ("google", "twitter"):
            root = require_npm_package(NPM_PACKAGES[style], npm_dir)
            with open(os.path.join(root, "emoji.json"), encoding="utf-8") as f:
                entries = json.load(f)
            img_dir = os.path.join(root, "img", style, "64")
            for e in entries:
                for v in [e, *e.get("skin_variations", {}).values()]:
                    path = os.path.join(img_dir, v["image"])
                    if os.path.exists(path):
                        self.files.setdefault(v["unified"].upper().replace("-FE0F", ""), path)
        elif style == "openmoji":
            svg_dir = os.path.join(require_npm_package(NPM_PACKAGES[style], npm_dir), "color", "svg")
            for name in os.listdir(svg_dir):
                if name.endswith(".svg"):
                    self.files.setdefault(name[:-4].upper().replace("-FE0F", ""), os.path.join(svg_dir, name))
        else:
            raise ValueError(f"unknown emoji style {style!r}; choose from {STYLES}")

    def image(self, emoji: Emoji, size: int) -> Optional[Image.Image]:
        """The emoji in this style on white at ``size`` px, or None if the style lacks it."""
        if self.style == "noto":
            img = render_noto(emoji.text, self.font)
            return None if img is None else on_white(img, size)
        path = self.files.get(emoji.bare)
        if path is None:
            return None
        if path.endswith(".svg"):
            import cairosvg  # optional: only the openmoji style needs it (pip install cairosvg)

            png = cairosvg.svg2png(url=path, output_width=size, output_height=size)
            return on_white(Image.open(io.BytesIO(png)), size)
        with Image.open(path) as img:
            return on_white(img, size)


def build_emoji(out: str = "data", styles: Sequence[str] = STYLES, size: int = 64, skin_tones: bool = False,
                npm_dir: str = NPM_DIR, maxcount: int = 1000, progress: bool = True, emoji_test: str = EMOJI_TEST,
                cldr_dir: str = CLDR) -> dict:
    """Build the emoji shards under ``out/emoji``; prints and returns the counts (also in ``classes.json``).

    Args:
        out: data folder.
        styles: art styles to build (noto, google, twitter, openmoji).
        size: stored image side in px.
        skin_tones: also the skin-tone variants (~3,650 emoji instead of ~1,870).
        npm_dir: where the npm packages of the google, twitter and openmoji styles are installed.
        maxcount: samples per shard.
        progress: show a progress bar.
        emoji_test: Unicode's ``emoji-test.txt``.
        cldr_dir: the CLDR ``common`` folder.
    """
    require_debian_file(emoji_test, "unicode-data")
    require_debian_file(os.path.join(cldr_dir, "annotations", "en.xml"), "unicode-cldr-core")
    emojis = parse_emoji_test(emoji_test, skin_tones)
    keywords = parse_cldr_keywords(cldr_dir)
    for e in emojis:
        e.keywords = keywords.get(e.text.replace("\ufe0f", ""), [])
    groups = sorted({e.group for e in emojis}, key=[e.group for e in emojis].index)
    subgroups = sorted({e.subgroup for e in emojis}, key=[e.subgroup for e in emojis].index)
    order = list(range(len(emojis)))
    random.Random(0).shuffle(order)   # shards mix groups; same order in every style
    root = os.path.join(out, "emoji")
    counts: dict = {"emoji": len(emojis), "styles": {}}
    for style in styles:
        try:
            source = StyleSource(style, npm_dir)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"emoji style {style}: {e}") from None
        missing = 0
        with ShardWriter(os.path.join(root, style), f"emoji-{style}", maxcount=maxcount) as writer:
            for i in tqdm(order, desc=f"emoji {style}", unit="img", disable=not progress):
                e = emojis[i]
                img = source.image(e, size)
                if img is None:
                    missing += 1
                    continue
                buf = io.BytesIO()
                img.save(buf, "PNG", optimize=False)
                meta = {"name": e.name, "keywords": e.keywords, "group": e.group, "subgroup": e.subgroup,
                        "group_id": groups.index(e.group), "subgroup_id": subgroups.index(e.subgroup),
                        "codepoints": e.key, "style": style}
                writer.write(e.key, {"png": buf.getvalue(), "txt": e.caption(), "json": json.dumps(meta)})
        counts["styles"][style] = {"samples": writer.total, "missing_in_style": missing,
                                   "shards": len(writer.shards), "pattern": writer.pattern}
    path = os.path.join(root, "classes.json")
    if os.path.exists(path):  # keep the counts of styles built by an earlier run
        with open(path) as f:
            old = json.load(f).get("counts", {}).get("styles", {})
        counts["styles"] = {**{k: v for k, v in old.items() if k not in styles}, **counts["styles"]}
    info = {"groups": groups, "subgroups": subgroups, "templates": ["an emoji of {}."], "image_size": size,
            "skin_tones": skin_tones, "counts": counts}
    os.makedirs(root, exist_ok=True)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print("emoji: " + json.dumps(counts))
    return counts


# --------------------------------------------------------------------------------------- fashion-mnist
def build_fashion_mnist(out: str = "data", source_dir: str = FASHION_MNIST, train_limit: Optional[int] = 10000,
                        test_limit: Optional[int] = None, maxcount: int = 2000, progress: bool = True) -> dict:
    """Build the Fashion-MNIST shards under ``out/fashion-mnist``; prints and returns per-split counts.

    Args:
        out: data folder.
        source_dir: folder with the IDX files (``train-*``, ``t10k-*``; gzipped or not).
        train_limit: keep the first N training images (None: all 60,000).
        test_limit: keep the first N test images (None: all 10,000).
        maxcount: samples per shard.
        progress: show a progress bar.
    """
    if source_dir == FASHION_MNIST:
        require_debian_file(FASHION_MNIST, "dataset-fashion-mnist")
    root = os.path.join(out, "fashion-mnist")
    classes = FASHION_MNIST_CLASSNAMES
    counts: dict = {}
    for split, limit in (("train", train_limit), ("test", test_limit)):
        images_path, labels_path = find_idx_pair(source_dir, split)
        images, labels = IdxArray(images_path).read_all(), IdxArray(labels_path).read_all()
        if len(images) != len(labels):
            raise ValueError(f"{source_dir}: {split} has {len(images)} images but {len(labels)} labels")
        n = len(images) if limit is None else min(limit, len(images))
        with ShardWriter(os.path.join(root, split), f"fashion-mnist-{split}", maxcount=maxcount) as writer:
            for i in tqdm(range(n), desc=f"fashion-mnist {split}", unit="img", disable=not progress):
                label = int(labels[i])
                if not 0 <= label < len(classes):
                    raise ValueError(f"{labels_path}: label {label} at index {i} out of range")
                buf = io.BytesIO()
                Image.fromarray(np.ascontiguousarray(images[i])).save(buf, "PNG")
                meta = {"label": label, "class": classes[label], "index": i, "split": split}
                writer.write(f"{split}_{i:05d}", {"png": buf.getvalue(), "cls": str(label),
                                                  "txt": FASHION_TEMPLATES[0].format(classes[label]),
                                                  "json": json.dumps(meta)})
        hist = np.bincount(labels[:n], minlength=len(classes)).tolist()
        counts[split] = {"samples": writer.total, "shards": len(writer.shards), "pattern": writer.pattern,
                         "per_class": hist}
    with open(os.path.join(root, "classes.json"), "w") as f:
        json.dump({"classes": list(classes), "templates": list(FASHION_TEMPLATES), "counts": counts}, f, indent=1)
    print("fashion-mnist: " + json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "per_class"}
                                           for k, v in counts.items()}))
    return counts


# ----------------------------------------------------------------------------------------- python-docs
def is_val(rel_path: str, val_every: int = 20) -> bool:
    """Deterministic split: a page is in ``val`` when the hash of its relative path is 0 modulo ``val_every``."""
    return int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest(), 16) % val_every == 0


def build_python_docs(out: str = "data", source_dir: str = PYTHON_DOCS, vocab_size: int = 8192, val_every: int = 20,
                      maxcount: int = 100, progress: bool = True) -> dict:
    """Build the Python-docs text shards and tokenizer under ``out/python-docs``; prints and returns the counts.

    Args:
        out: data folder.
        source_dir: the reST sources (``*.txt`` files, in subfolders).
        vocab_size: BPE vocabulary size.
        val_every: about one page in this many goes to ``val``.
        maxcount: documents per shard.
        progress: show a progress bar.
    """
    if source_dir == PYTHON_DOCS:
        require_debian_file(os.path.join(PYTHON_DOCS, "contents.rst.txt"), "python3.11-doc")
    files = list(iter_text_files([os.path.join(source_dir, "**", "*.txt")]))
    splits: dict[str, list[str]] = {"train": [], "val": []}
    for p in files:
        splits["val" if is_val(os.path.relpath(p, source_dir), val_every) else "train"].append(p)
    root = os.path.join(out, "python-docs")
    writers = {}
    for split, paths in splits.items():
        if not paths:
            raise ValueError(f"{source_dir}: the {split} split is empty ({len(files)} files)")
        writers[split] = write_shards_from_text(os.path.join(root, split), paths, root=source_dir,
                                                prefix=f"pydocs-{split}", maxcount=maxcount, progress=progress)
    tok = train_byte_level_bpe(read_texts(splits["train"]), os.path.join(root, "tokenizer.json"), vocab_size=vocab_size)
    counts: dict = {}
    for split, writer in writers.items():
        per_shard = count_tokens(writer.shards, tok)
        n_bytes = sum(os.path.getsize(p) for p in splits[split])
        counts[split] = {"documents": writer.total, "shards": len(writer.shards), "pattern": writer.pattern,
                         "bytes": n_bytes, "tokens": sum(per_shard.values())}
    info = {"tokenizer": "tokenizer.json", "tokenizer_name": tok.name, "vocab_size": tok.vocab_size,
            "eos_token": tok.eos_token, "eos_id": tok.eos_id, "counts": counts}
    with open(os.path.join(root, "info.json"), "w") as f:
        json.dump(info, f, indent=1)
    print("python-docs: " + json.dumps(info))
    return info


def build_demo_data(out: str = "data", styles: Sequence[str] = STYLES, size: int = 64, skin_tones: bool = False,
                    npm_dir: str = NPM_DIR, train_limit: Optional[int] = 10000, vocab_size: int = 8192) -> dict:
    """Build all three demo datasets under ``out``; returns their counts by dataset.

    Args:
        out: data folder.
        styles: emoji art styles (noto, google, twitter, openmoji).
        size: stored emoji image side in px.
        skin_tones: also the emoji skin-tone variants.
        npm_dir: where the npm packages of the emoji art are installed.
        train_limit: first N Fashion-MNIST training images (None: all 60,000).
        vocab_size: BPE vocabulary size of the Python-docs tokenizer.
    """
    return {"emoji": build_emoji(out, styles, size, skin_tones, npm_dir),
            "fashion-mnist": build_fashion_mnist(out, train_limit=train_limit),
            "python-docs": build_python_docs(out, vocab_size=vocab_size)}
