"""Zero-shot image sets that are not emoji: a colour icon set from an npm ``@iconify-json/*`` package, and Tux Paint's
stamps from a Debian package (:func:`build_stamps`).

Default: ``@iconify-json/streamline-ultimate-color`` (Streamline "Ultimate color", CC BY 4.0, 998 icons in 31
publisher categories). Each icon's label is the category the publisher's ``metadata.json`` files it under; the class
name is that category split at capitals and lower-cased (``FoodDrinks`` -> ``food drinks``), with no hand mapping.
Categories with fewer than ``min_images`` icons are dropped; icon sets iconify files under ``Emoji`` are refused.
Icons are rendered with cairosvg on white, into ``OUT/NAME/<class_folder>/<icon>.png`` (the layout ``diffmm eval
zeroshot --data`` reads) and ``OUT/NAME/classes.json`` (``classes`` in folder order, templates, source, counts).
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from typing import Optional

from PIL import Image
from tqdm import tqdm

from diffmm_demo.datasets import on_white
from diffmm_demo.system_data import NPM_DIR, TUXPAINT_STAMPS, require_debian_file, require_npm_package

ICON_SET = "streamline-ultimate-color"
#: the stamp set's folder under the data folder
STAMPS = "stamps-tuxpaint"
STAMP_TEMPLATES = ("an emoji of {}.", "a picture of {}.")
ICON_TEMPLATES = ("an emoji of {}.", "an icon of {}.")


def class_name(category: str) -> str:
    """A publisher category as a class name: ``FoodDrinks`` -> ``food drinks``, ``Sport`` -> ``sport``."""
    return " ".join(re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", category)).lower() or category.lower()


def render_icon(icon: dict, defaults: dict, size: int) -> Image.Image:
    """One iconify icon (``body`` plus optional ``left``/``top``/``width``/``height``) on white at ``size`` px."""
    import cairosvg  # optional: pip install cairosvg

    box = [icon.get(k, defaults.get(k, d)) for k, d in (("left", 0), ("top", 0), ("width", 16), ("height", 16))]
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
           f'viewBox="{" ".join(map(str, box))}">{icon["body"]}</svg>')
    png = cairosvg.svg2png(bytestring=svg.encode("utf-8"), output_width=size, output_height=size)
    return on_white(Image.open(io.BytesIO(png)), size)


def build_icons(out: str = "data", icon_set: str = ICON_SET, name: Optional[str] = None, size: int = 64,
                min_images: int = 10, npm_dir: str = NPM_DIR, progress: bool = True) -> dict:
    """Build a zero-shot image set of colour icons labelled by publisher category; prints and returns its classes.json.

    Args:
        out: data folder.
        icon_set: the iconify prefix; the npm package is ``@iconify-json/ICON_SET``.
        name: the dataset folder (default: ``icons-ICON_SET``).
        size: image side in px.
        min_images: drop publisher categories with fewer icons.
        npm_dir: where the npm package is installed.
        progress: show a progress bar.

    Raises:
        FileNotFoundError: the npm package is missing (naming it).
        ValueError: the set is emoji, or has no category with ``min_images`` icons.
    """
    package = f"@iconify-json/{icon_set}"
    root = require_npm_package(package, npm_dir)

    def load(file: str) -> dict:
        with open(os.path.join(root, file), encoding="utf-8") as f:
            return json.load(f)

    icons, info, pkg = load("icons.json"), load("info.json"), load("package.json")
    if "emoji" in f"{icon_set} {info.get('category', '')}".lower():
        raise ValueError(f"{package} is an emoji set ({info.get('category')}); choose a non-emoji icon set")
    has_meta = os.path.exists(os.path.join(root, "metadata.json"))
    categories = load("metadata.json").get("categories", {}) if has_meta else {}
    kept = {c: sorted(n for n in names if n in icons["icons"] and not icons["icons"][n].get("hidden"))
            for c, names in categories.items()}
    kept = {c: names for c, names in kept.items() if len(names) >= min_images}
    if not kept:
        raise ValueError(f"{package}: no publisher category has {min_images} or more icons")
    folders = {c: class_name(c).replace(" ", "_") for c in kept}
    if len(set(folders.values())) != len(folders):
        raise ValueError(f"{package}: categories {sorted(kept)} give repeated class names")
    order = sorted(kept, key=folders.get)  # ImageFolderSource labels follow the sorted folder names
    name = name or f"icons-{icon_set}"
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out)  # build aside, then swap in: no half-built folder
    try:
        for c in tqdm(order, desc=name, unit="class", disable=not progress):
            os.makedirs(os.path.join(tmp, folders[c]))
            for n in kept[c]:
                render_icon(icons["icons"][n], icons, size).save(os.path.join(tmp, folders[c], f"{n}.png"))
        counts = {class_name(c): len(kept[c]) for c in order}
        meta = {"classes": [class_name(c) for c in order], "categories": order, "templates": list(ICON_TEMPLATES),
                "source": f"npm {package}@{pkg.get('version')}", "license": info.get("license", {}).get("spdx"),
                "author": info.get("author", {}).get("name"), "image_size": size, "images": sum(counts.values()),
                "dropped_categories": sorted(set(categories) - set(kept)), "counts": counts}
        with open(os.path.join(tmp, "classes.json"), "w") as f:
            json.dump(meta, f, indent=1)
        target = os.path.join(out, name)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{name}: {meta['images']} images, {len(order)} classes from {meta['source']} -> {target}")
    return meta


def on_white_square(img: Image.Image, size: int) -> Image.Image:
    """An image (any aspect, any mode) centred on a white square, resized to ``size`` x ``size`` RGB."""
    img = img.convert("RGBA")
    side = max(img.size)
    bg = Image.new("RGBA", (side, side), (255, 255, 255, 255))
    bg.alpha_composite(img, ((side - img.size[0]) // 2, (side - img.size[1]) // 2))
    return bg.convert("RGB").resize((size, size), Image.BICUBIC)


def _swap_in(tmp: str, target: str) -> None:
    old = tmp + "-old"
    if os.path.exists(target):
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def build_stamps(out: str = "data", root: str = TUXPAINT_STAMPS, size: int = 128, min_images: int = 3,
                 progress: bool = True) -> dict:
    """Build a zero-shot image set from Tux Paint's stamps (Debian ``tuxpaint-stamps-default``): every PNG stamp,
    labelled by the publisher's top-level category folder (``animals``, ``food``, ``vehicles``, ...; no hand
    mapping), centred on white at ``size`` px, into ``OUT/stamps-tuxpaint/<category>/<stamp>.png`` with
    ``classes.json`` (classes, templates, counts, the majority share, each stamp's English description and
    subcategory). Prints and returns the classes.json.

    Args:
        out: data folder.
        root: the stamps folder of the Debian package.
        size: image side in px.
        min_images: drop categories with fewer PNG stamps.
        progress: show a progress bar.

    Raises:
        FileNotFoundError: the Debian package is missing (naming it).
        ValueError: no category has ``min_images`` PNG stamps.
    """
    require_debian_file(root, "tuxpaint-stamps-default")
    found: dict[str, list[str]] = {}
    for dirpath, _, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            found.setdefault(rel.split(os.sep)[0], []).extend(
                os.path.join(dirpath, f) for f in files if f.endswith(".png"))
    kept = {c: sorted(paths) for c, paths in sorted(found.items()) if len(paths) >= min_images}
    if not kept:
        raise ValueError(f"{root}: no category folder has {min_images} or more PNG stamps")
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{STAMPS}.tmp-", dir=out)  # build aside, then swap in: no half-built folder
    stamps, skipped = {}, {}
    try:
        for c in tqdm(kept, desc=STAMPS, unit="class", disable=not progress):
            os.makedirs(os.path.join(tmp, c))
            for path in kept[c]:
                rel = os.path.relpath(path, root)
                name = os.path.splitext(rel)[0].replace(os.sep, "__")
                try:
                    with Image.open(path) as img:
                        on_white_square(img, size).save(os.path.join(tmp, c, name + ".png"))
                except (OSError, ValueError) as e:  # a damaged stamp is counted, not fatal
                    skipped[rel] = str(e).splitlines()[0]
                    continue
                txt = os.path.splitext(path)[0] + ".txt"
                desc = None
                if os.path.exists(txt):
                    with open(txt, encoding="utf-8", errors="replace") as f:
                        desc = f.readline().strip() or None
                parts = rel.split(os.sep)
                stamps[f"{c}/{name}.png"] = {"description": desc, "subcategory": parts[1] if len(parts) > 2 else c}
        counts = {c: sum(k.startswith(c + "/") for k in stamps) for c in kept}
        meta = {"classes": list(kept), "templates": list(STAMP_TEMPLATES), "source": "Debian tuxpaint-stamps-default",
                "license": "GPL-2 (/usr/share/doc/tuxpaint-stamps-default/copyright)",
                "image_size": size, "images": len(stamps), "counts": counts,
                "majority_share": max(counts.values()) / max(1, len(stamps)),
                "dropped_categories": sorted(set(found) - set(kept)), "skipped": skipped, "stamps": stamps}
        with open(os.path.join(tmp, "classes.json"), "w") as f:
            json.dump(meta, f, indent=1)
        _swap_in(tmp, os.path.join(out, STAMPS))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{STAMPS}: {meta['images']} images, {len(kept)} classes from {meta['source']} -> "
          f"{os.path.join(out, STAMPS)}")
    return meta
