"""Shards from user data: an image folder + captions table, class subfolders, or text files."""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import random
from typing import Iterator, Sequence

from PIL import Image
from tqdm import tqdm

from diffmm.data.writer import ShardWriter, sanitize_key

KEEP_AS_IS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
IMAGE_COLUMNS = ("image", "file", "filename", "filepath", "path", "url")
CAPTION_COLUMNS = ("caption", "text", "title", "txt")


def image_field(path: str) -> tuple[str, bytes]:
    """(field, bytes) for an image file: jpg/png/webp as they are, other formats re-encoded to png."""
    ext = os.path.splitext(path)[1].lower()
    if ext in KEEP_AS_IS:
        with open(path, "rb") as f:
            return KEEP_AS_IS[ext], f.read()
    buf = io.BytesIO()
    with Image.open(path) as img:
        img.convert("RGBA" if "A" in img.getbands() else "RGB").save(buf, "PNG")
    return "png", buf.getvalue()


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
                  skip_missing: bool = False, progress: bool = True) -> ShardWriter:
    """Write image-caption shards from ``image_dir`` and a captions table.

    Keys are the row numbers (``000000042``), in table order. Extra columns go into ``KEY.json``.

    Raises:
        FileNotFoundError: a listed image is missing (unless ``skip_missing``), naming the row and path.
    """
    rows = read_table(captions)
    if not rows:
        raise ValueError(f"{captions}: no rows")
    icol = _pick_column(rows, image_column, IMAGE_COLUMNS, "image", captions)
    ccol = _pick_column(rows, caption_column, CAPTION_COLUMNS, "caption", captions)
    missing = 0
    with ShardWriter(out_dir, prefix, maxcount, maxsize) as writer:
        for i, row in enumerate(tqdm(rows, desc=f"from-captions {prefix}", unit="img", disable=not progress)):
            path = os.path.join(image_dir, str(row[icol]))
            if not os.path.isfile(path):
                if skip_missing:
                    missing += 1
                    continue
                raise FileNotFoundError(f"{captions} row {i + 1}: image {path} not found (use --skip-missing to skip)")
            caption = row[ccol]
            if caption is None or not str(caption).strip():
                raise ValueError(f"{captions} row {i + 1}: empty {ccol!r}")
            field, data = image_field(path)
            meta = {k: v for k, v in row.items() if k not in (icol, ccol)}
            meta.update(source=str(row[icol]), caption=str(caption))
            writer.write(f"{i:09d}", {field: data, "txt": str(caption), "json": json.dumps(meta, default=str)})
    writer.skipped_missing = missing  # type: ignore[attr-defined]
    return writer


def class_caption(name: str, template: str = "a photo of a {}.") -> str:
    """Caption for a class folder name (underscores and dashes become spaces)."""
    return template.format(name.replace("_", " ").replace("-", " "))


def from_folders(root: str, out_dir: str, prefix: str = "shard", maxcount: int = 10000, maxsize: int = 1 << 30,
                 template: str = "a photo of a {}.", shuffle: bool = True, seed: int = 0,
                 progress: bool = True) -> ShardWriter:
    """Write shards from ``root/CLASS/*.jpg``: ``KEY.{img}``, ``KEY.cls`` (index of the sorted class
    names), ``KEY.txt`` (caption from ``template``), ``KEY.json``; plus ``classes.json`` in ``out_dir``.

    Samples are shuffled with ``seed`` (shards then mix classes); keys are ``CLASS_FILESTEM``.
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
    with ShardWriter(out_dir, prefix, maxcount, maxsize) as writer:
        for label, cls, path in tqdm(items, desc=f"from-folders {prefix}", unit="img", disable=not progress):
            field, data = image_field(path)
            key = sanitize_key(f"{cls}_{os.path.splitext(os.path.basename(path))[0]}")
            meta = {"label": label, "class": names[label], "source": os.path.relpath(path, root)}
            writer.write(key, {field: data, "cls": str(label), "txt": class_caption(cls, template),
                               "json": json.dumps(meta)})
    with open(os.path.join(out_dir, "classes.json"), "w") as f:
        json.dump({"classes": names, "folders": classes, "templates": [template]}, f, indent=1)
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
