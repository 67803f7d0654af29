"""Demo image-caption dataset: every RGI emoji in several art styles with CLDR captions.

Sources (SPEC section 5; all from package registries):

* ``noto``: Debian ``fonts-noto-color-emoji``, rendered with Pillow (size 109, ``embedded_color``).
* ``google`` / ``twitter``: npm ``emoji-datasource-google`` / ``-twitter`` 64 px PNGs.
* ``openmoji``: npm ``openmoji`` colour SVGs rendered with cairosvg.
* names, groups, subgroups: ``/usr/share/unicode/emoji/emoji-test.txt`` (Debian ``unicode-data``);
  keywords: CLDR ``annotations/en.xml`` + ``annotationsDerived/en.xml`` (``unicode-cldr-core``).

Each style goes to ``OUT/emoji/STYLE/emoji-STYLE-NNNNNN.tar``; the same emoji has the same key in
every style (its code points, e.g. ``1f469_200d_1f4bb``), so one style can be held out for
zero-shot evaluation. ``OUT/emoji/classes.json`` lists the groups and subgroups (labels
``KEY.json`` -> ``group_id`` / ``subgroup_id``).
"""
from __future__ import annotations

import io
import json
import os
import random
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from PIL import Image
from tqdm import tqdm

from diffmm.data.sources import DEFAULT_NPM_DIR, MissingSource, ensure_apt, ensure_npm
from diffmm.data.writer import ShardWriter

EMOJI_TEST = "/usr/share/unicode/emoji/emoji-test.txt"
CLDR_DIR = "/usr/share/unicode/cldr/common"
NOTO_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
STYLES = ("noto", "google", "twitter", "openmoji")
SKIN_TONES = {0x1F3FB, 0x1F3FC, 0x1F3FD, 0x1F3FE, 0x1F3FF}
SKIP_GROUPS = ("Component",)   # bare skin-tone / hair swatches
NPM_PACKAGES = {"google": "emoji-datasource-google", "twitter": "emoji-datasource-twitter", "openmoji": "openmoji"}


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


def parse_cldr_keywords(cldr_dir: str = CLDR_DIR, lang: str = "en") -> dict[str, list[str]]:
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


def render_noto(text: str, font) -> Image.Image | None:
    """Render one emoji with the Noto colour font onto a transparent square, or None if not one glyph."""
    from PIL import ImageDraw

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
    """Images of one art style, looked up by :attr:`Emoji.bare`."""

    def __init__(self, style: str, npm_dir: str = DEFAULT_NPM_DIR, install: bool = True) -> None:
        self.style = style
        self.files: dict[str, str] = {}
        if style == "noto":
            from PIL import ImageFont

            ensure_apt("fonts-noto-color-emoji", NOTO_FONT, install)
            self.font = ImageFont.truetype(NOTO_FONT, 109, layout_engine=ImageFont.Layout.RAQM)
        elif style in ("google", "twitter"):
            root = ensure_npm(NPM_PACKAGES[style], npm_dir, install)
            with open(os.path.join(root, "emoji.json"), encoding="utf-8") as f:
                entries = json.load(f)
            img_dir = os.path.join(root, "img", style, "64")
            for e in entries:
                for v in [e, *e.get("skin_variations", {}).values()]:
                    path = os.path.join(img_dir, v["image"])
                    if os.path.exists(path):
                        self.files.setdefault(v["unified"].upper().replace("-FE0F", ""), path)
        elif style == "openmoji":
            root = ensure_npm(NPM_PACKAGES[style], npm_dir, install)
            svg_dir = os.path.join(root, "color", "svg")
            for name in os.listdir(svg_dir):
                if name.endswith(".svg"):
                    self.files.setdefault(name[:-4].upper().replace("-FE0F", ""), os.path.join(svg_dir, name))
        else:
            raise ValueError(f"unknown emoji style {style!r}; choose from {STYLES}")

    def image(self, emoji: Emoji, size: int) -> Image.Image | None:
        """The emoji in this style on white at ``size`` px, or None if the style lacks it."""
        if self.style == "noto":
            img = render_noto(emoji.text, self.font)
            return None if img is None else on_white(img, size)
        path = self.files.get(emoji.bare)
        if path is None:
            return None
        if path.endswith(".svg"):
            import cairosvg

            png = cairosvg.svg2png(url=path, output_width=size, output_height=size)
            return on_white(Image.open(io.BytesIO(png)), size)
        with Image.open(path) as img:
            return on_white(img, size)


def build_emoji(out_dir: str, styles=STYLES, size: int = 64, skin_tones: bool = False, maxcount: int = 1000,
                npm_dir: str = DEFAULT_NPM_DIR, install: bool = True, progress: bool = True,
                emoji_test: str = EMOJI_TEST, cldr_dir: str = CLDR_DIR) -> dict:
    """Build the emoji shards under ``out_dir/emoji``; returns the counts (also in ``classes.json``)."""
    ensure_apt("unicode-data", emoji_test, install)
    ensure_apt("unicode-cldr-core", os.path.join(cldr_dir, "annotations", "en.xml"), install)
    emojis = parse_emoji_test(emoji_test, skin_tones)
    keywords = parse_cldr_keywords(cldr_dir)
    for e in emojis:
        e.keywords = keywords.get(e.text.replace("\ufe0f", ""), [])
    groups = sorted({e.group for e in emojis}, key=[e.group for e in emojis].index)
    subgroups = sorted({e.subgroup for e in emojis}, key=[e.subgroup for e in emojis].index)
    order = list(range(len(emojis)))
    random.Random(0).shuffle(order)   # shards mix groups; same order in every style
    root = os.path.join(out_dir, "emoji")
    counts: dict = {"emoji": len(emojis), "styles": {}}
    for style in styles:
        try:
            source = StyleSource(style, npm_dir, install)
        except MissingSource as e:
            raise MissingSource(f"emoji style {style}: {e}") from None
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
    return counts
