"""Shards from user data: an image folder + captions table, class subfolders, or text files."""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import random
import warnings
from typing import Iterator, Sequence

from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from diffmm.data.writer import ShardWriter, sanitize_key

STORED_AS_IS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
IMAGE_COLUMNS = ("image", "file", "filename", "filepath", "path", "url")
CAPTION_COLUMNS = ("caption", "text", "title", "txt")


class BadImage(ValueError):
    """A file that is not a decodable image (or is larger than the pixel cap)."""


def image_field(path: str, max_pixels: int | None = None) -> tuple[str, bytes]:
    """(field, bytes) for an image file, checked by decoding it fully with Pillow.

    JPEG, PNG and WebP are stored as they are (the field follows the real format, not the file
    extension); other formats are re-encoded to PNG.

    Raises:
        BadImage: not an image Pillow can decode, or more than ``max_pixels`` pixels (default:
            Pillow's decompression-bomb threshold).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap follows
            img = Image.open(io.BytesIO(data))
        with img:
            w, h = img.size
            limit = max_pixels if max_pixels is not None else Image.MAX_IMAGE_PIXELS
            if limit and w * h > limit:
                raise BadImage(f"{path}: {w}x{h} image has more than {limit} pixels")
            img.load()
            fmt = img.format
            if fmt in STORED_AS_IS:
                return STORED_AS_IS[fmt], data
            buf = io.BytesIO()
            img.convert("RGBA" if "A" in img.getbands() else "RGB").save(buf, "PNG")
            return "png", buf.getvalue()
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(f"{path}: not an image format Pillow recognises") from None
    except Exception as e:  # Pillow raises many types for bad bytes
        raise BadImage(f"{path}: not a decodable image ({type(e).__name__}: {e})") from None


class SkipCounter:
    """Counts rows skipped by reason; ``str()`` is ``"3 rows skipped (missing image=2, bad image=1)"``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, reason: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __str__(self) -> str:
        if not self.counts:
            return ""
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        first = "; ".join(f"first {k}: {v}" for k, v in sorted(self.first.items()))
        return f"{self.total} rows skipped ({parts}); {first}"


def read_table(path: str) -> list[dict]:
    """Rows of a CSV, TSV, JSONL or parquet file as dicts (format from the extension)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".csv", ".tsv"):
        with open(path, newline="", encoding="utf-8") as f:
            return [dict(r) for r in csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ",")]
    if ext in (".jsonl", ".ndjson"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        return rows
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unknown captions format {ext!r}; use .csv, .tsv, .jsonl or .parquet")


def _pick_column(rows: list[dict], wanted: str | None, candidates: Sequence[str], what: str, path: str) -> str:
    columns = list(rows[0].keys()) if rows else []
    if wanted is not None:
        if wanted not in columns:
            raise KeyError(f"{path}: no {what} column {wanted!r}; columns are {columns}")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise KeyError(f"{path}: no {what} column (looked for {list(candidates)}); columns are {columns}; pass it explicitly")


def from_captions(image_dir: str, captions: str, out_dir: str, prefix: str = "shard", maxcount: int = 10000,
                  maxsize: int = 1 << 30, image_column: str | None = None, caption_column: str | None = None,
                  skip_missing: bool = False, progress: bool = True, skip_bad: bool = False,
                  max_pixels: int | None = None) -> ShardWriter:
    """Write image-caption shards from ``image_dir`` and a captions table.

    Keys are the row numbers (``000000042``), in table order. Extra columns go into ``KEY.json``.
    Every image is decoded before it is stored. The old shards of ``prefix`` in ``out_dir`` are
    replaced only when the whole table went through (see :class:`ShardWriter`).

    Args:
        skip_missing: skip rows whose image file is missing (counted).
        skip_bad: skip rows whose image is missing or not decodable, or whose caption is empty
            (counted by reason in ``writer.skipped``); without it such a row stops the run.
        max_pixels: largest image accepted (default: Pillow's decompression-bomb threshold).

    Raises:
        FileNotFoundError: a listed image is missing, naming the row and path.
        ValueError: an image is not decodable or a caption is empty, naming the row; or no row was usable.
    """
    rows = read_table(captions)
    if not rows:
        raise ValueError(f"{captions}: no rows")
    icol = _pick_column(rows, image_column, IMAGE_COLUMNS, "image", captions)
    ccol = _pick_column(rows, caption_column, CAPTION_COLUMNS, "caption", captions)
    skipped = SkipCounter()
    with ShardWriter(out_dir, prefix, maxcount, maxsize) as writer:
        for i, row in enumerate(tqdm(rows, desc=f"from-captions {prefix}", unit="img", disable=not progress)):
            where = f"{captions} row {i + 1}"
            path = os.path.join(image_dir, str(row[icol]))
            if not os.path.isfile(path):
                if skip_missing or skip_bad:
                    skipped.add("missing image", f"{where}: {path}")
                    continue
                raise FileNotFoundError(f"{where}: image {path} not found (use --skip-missing or --skip-bad to skip; "
                                        "the old shards are kept)")
            caption = row[ccol]
            if caption is None or not str(caption).strip():
                if skip_bad:
                    skipped.add("empty caption", where)
                    continue
                raise ValueError(f"{where}: empty {ccol!r} (use --skip-bad to skip; the old shards are kept)")
            try:
                field, data = image_field(path, max_pixels)
            except BadImage as e:
                if skip_bad:
                    skipped.add("bad image", f"{where}: {e}")
                    continue
                raise BadImage(f"{where}: {e} (use --skip-bad to skip; the old shards are kept)") from None
            meta = {k: v for k, v in row.items() if k not in (icol, ccol)}
            meta.update(source=str(row[icol]), caption=str(caption))
            writer.write(f"{i:09d}", {field: data, "txt": str(caption), "json": json.dumps(meta, default=str)})
        if writer.total == 0:
            raise ValueError(f"{captions}: no usable row ({skipped}); the old shards are kept")
    writer.skipped = skipped  # type: ignore[attr-defined]
    writer.skipped_missing = skipped.counts.get("missing image", 0)  # type: ignore[attr-defined]
    return writer


def class_caption(name: str, template: str = "a photo of a {}.") -> str:
    """Caption for a class folder name (underscores and dashes become spaces)."""
    return template.format(name.replace("_", " ").replace("-", " "))


def from_folders(root: str, out_dir: str, prefix: str = "shard", maxcount: int = 10000, maxsize: int = 1 << 30,
                 template: str = "a photo of a {}.", shuffle: bool = True, seed: int = 0,
                 progress: bool = True, skip_bad: bool = False, max_pixels: int | None = None) -> ShardWriter:
    """Write shards from ``root/CLASS/*.jpg``: ``KEY.{img}``, ``KEY.cls`` (index of the sorted class
    names), ``KEY.txt`` (caption from ``template``), ``KEY.json``; plus ``classes.json`` in ``out_dir``.

    Samples are shuffled with ``seed`` (shards then mix classes); keys are ``CLASS_FILESTEM``. Every
    image is decoded first: an undecodable one stops the run (old shards kept) unless ``skip_bad``
    (then it is counted in ``writer.skipped``).
    """
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise ValueError(f"{root}: no class subfolders")
    items = []
    for label, cls in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(root, cls))):
            if name.lower().endswith(IMAGE_EXTS):
                items.append((label, cls, os.path.join(root, cls, name)))
    if not items:
        raise ValueError(f"{root}: no images ({', '.join(IMAGE_EXTS)}) in the class subfolders")
    if shuffle:
        random.Random(seed).shuffle(items)
    names = [c.replace("_", " ").replace("-", " ") for c in classes]
    skipped = SkipCounter()
    with ShardWriter(out_dir, prefix, maxcount, maxsize) as writer:
        for label, cls, path in tqdm(items, desc=f"from-folders {prefix}", unit="img", disable=not progress):
            try:
                field, data = image_field(path, max_pixels)
            except BadImage as e:
                if skip_bad:
                    skipped.add("bad image", str(e))
                    continue
                raise BadImage(f"{e} (use --skip-bad to skip; the old shards are kept)") from None
            key = sanitize_key(f"{cls}_{os.path.splitext(os.path.basename(path))[0]}")
            meta = {"label": label, "class": names[label], "source": os.path.relpath(path, root)}
            writer.write(key, {field: data, "cls": str(label), "txt": class_caption(cls, template),
                               "json": json.dumps(meta)})
        if writer.total == 0:
            raise ValueError(f"{root}: no usable image ({skipped}); the old shards are kept")
    with open(os.path.join(out_dir, "classes.json"), "w") as f:
        json.dump({"classes": names, "folders": classes, "templates": [template]}, f, indent=1)
    writer.skipped = skipped  # type: ignore[attr-defined]
    return writer


def iter_text_files(patterns: Sequence[str]) -> Iterator[str]:
    """Files matching glob ``patterns`` (``**`` allowed) or inside given folders, sorted, no duplicates."""
    seen: set[str] = set()
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = [p for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True) if os.path.isfile(p)]
        else:
            found = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
            if not found:
                raise FileNotFoundError(f"no files match {pattern!r}")
        for p in sorted(found):
            if p not in seen:
                seen.add(p)
                yield p


def from_text(patterns: Sequence[str], out_dir: str, prefix: str = "shard", maxcount: int = 1000,
              maxsize: int = 1 << 28, root: str | None = None, progress: bool = True) -> ShardWriter:
    """Write text shards, one document (``KEY.txt`` + ``KEY.json``) per file; keys from the path relative to ``root``.

    Files that are not valid UTF-8 raise an error naming the file.
    """
    files = list(iter_text_files(patterns))
    if not files:
        raise FileNotFoundError(f"no text files in {list(patterns)}")
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in files])
    with ShardWriter(out_dir, prefix, maxcount, maxsize) as writer:
        for i, path in enumerate(tqdm(files, desc=f"from-text {prefix}", unit="doc", disable=not progress)):
            with open(path, "rb") as f:
                raw = f.read()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e})") from None
            rel = os.path.relpath(os.path.abspath(path), root)
            writer.write(f"{i:06d}_{sanitize_key(rel)[:80]}", {"txt": raw, "json": json.dumps({"source": rel})})
    return writer
