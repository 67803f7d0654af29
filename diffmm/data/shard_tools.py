"""The shard tools behind ``diffmm shards``: write shards from your data, check them, index them.

Each public function is one subcommand: it takes typed arguments, shows a progress bar, prints a
one-line report and returns what it made. Bad input raises one ``FileNotFoundError``, ``KeyError`` or
``ValueError`` line naming the row or file; a writer that stops keeps the old shards as they were
(see :class:`~diffmm.data.writer.ShardWriter`).
"""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import random
import re
from typing import Iterator, Literal, Optional, Sequence

from tqdm import tqdm

from diffmm.data.decode import MAX_IMAGE_PIXELS, BadImage, decode_image, decode_text, load_image
from diffmm.data.sizes import stated_counts, write_sizes
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import MAX_MEMBER_BYTES, PIPE_TIMEOUT, ReadLimits, iter_tar_samples
from diffmm.data.text import TOKENS_FILE, count_tokens
from diffmm.data.tokenizers import LMTokenizer, load_lm_tokenizer, train_byte_level_bpe
from diffmm.data.urls import check_shards_exist, expand_sources
from diffmm.data.writer import ShardWriter, sanitize_key

STORED_AS_IS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
IMAGE_COLUMNS = ("image", "file", "filename", "filepath", "path", "url")
CAPTION_COLUMNS = ("caption", "text", "title", "txt")


def parse_size(size: int | str) -> int:
    """Bytes from ``4096``, ``"500MB"``, ``"1GB"`` or ``"1GiB"`` (units are powers of 1024).

    Raises:
        ValueError: not a size.
    """
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", size.lower())
    if not m:
        raise ValueError(f"bad size {size!r} (e.g. 500MB, 1GB, 4096)")
    unit = (m.group(2) or "").rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


def image_field(path: str, max_pixels: Optional[int] = None) -> tuple[str, bytes]:
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
        img = load_image(data, MAX_IMAGE_PIXELS if max_pixels is None else max_pixels)
    except BadImage as e:
        raise type(e)(f"{path}: {e}") from None
    with img:
        if img.format in STORED_AS_IS:
            return STORED_AS_IS[img.format], data
        buf = io.BytesIO()
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


def _pick_column(rows: list[dict], wanted: Optional[str], candidates: Sequence[str], what: str, path: str) -> str:
    columns = list(rows[0].keys()) if rows else []
    if wanted is not None:
        if wanted not in columns:
            raise KeyError(f"{path}: no {what} column {wanted!r}; columns are {columns}")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise KeyError(f"{path}: no {what} column (looked for {list(candidates)}); columns are {columns}; "
                   "pass it explicitly")


def _skip_or_raise(writer: ShardWriter, skip: bool, reason: str, error: Exception,
                   flags: str = "--skip_bad true") -> None:
    """Count a bad input row in ``writer.skipped`` when skipping, else raise ``error``, saying how to skip it (the
    writer then keeps the old shards)."""
    if not skip:
        raise type(error)(f"{error} (use {flags} to skip; the old shards are kept)") from None
    writer.skipped.add(reason, str(error))


def _report(writer: ShardWriter, what: str, extra: str = "") -> None:
    skipped = f"; {writer.skipped}" if writer.skipped.total else ""
    print(f"wrote {writer.total} {what} in {len(writer.shards)} shards: {writer.pattern}{extra}{skipped}")


def write_shards_from_captions(image_dir: str, captions: str, out: str, *, image_column: Optional[str] = None,
                               caption_column: Optional[str] = None, skip_missing: bool = False,
                               skip_bad: bool = False, max_image_pixels: Optional[int] = None, prefix: str = "shard",
                               maxcount: int = 10000, maxsize: int | str = "1GB",
                               progress: bool = True) -> ShardWriter:
    """Image-caption shards from an image folder and a captions table (CSV, TSV, JSONL or parquet).

    Keys are the row numbers (``000000042``), in table order; ``KEY.txt`` holds the caption and
    ``KEY.json`` the other columns. Every image is decoded before it is stored.

    Args:
        image_dir: folder the table's image paths are relative to.
        captions: the table, with an image path column and a caption column.
        out: output folder.
        image_column: default: the first of image, file, filename, filepath, path, url.
        caption_column: default: the first of caption, text, title, txt.
        skip_missing: skip rows whose image file is missing (counted).
        skip_bad: skip rows with a missing or undecodable image or an empty caption (counted in
            ``writer.skipped``); without it such a row stops the run, keeping the old shards.
        max_image_pixels: reject larger images (default: Pillow's decompression-bomb threshold, ~89M).
        prefix: shard file name prefix, a plain name without '/' or '..'.
        maxcount: samples per shard.
        maxsize: bytes per shard, e.g. 500MB.
        progress: show a progress bar.

    Raises:
        FileNotFoundError: a listed image is missing, naming the row and path.
        KeyError: no image or caption column.
        ValueError: an image is not decodable or a caption is empty, naming the row; or no row was usable.
    """
    rows = read_table(captions)
    if not rows:
        raise ValueError(f"{captions}: no rows")
    icol = _pick_column(rows, image_column, IMAGE_COLUMNS, "image", captions)
    ccol = _pick_column(rows, caption_column, CAPTION_COLUMNS, "caption", captions)
    with ShardWriter(out, prefix, maxcount, parse_size(maxsize)) as writer:
        for i, row in enumerate(tqdm(rows, desc=f"from-captions {prefix}", unit="img", disable=not progress)):
            where = f"{captions} row {i + 1}"
            path = os.path.join(image_dir, str(row[icol]))
            if not os.path.isfile(path):
                _skip_or_raise(writer, skip_missing or skip_bad, "missing image",
                               FileNotFoundError(f"{where}: image {path} not found"),
                               "--skip_missing true or --skip_bad true")
                continue
            caption = row[ccol]
            if caption is None or not str(caption).strip():
                _skip_or_raise(writer, skip_bad, "empty caption", ValueError(f"{where}: empty {ccol!r}"))
                continue
            try:
                field, data = image_field(path, max_image_pixels)
            except BadImage as e:
                _skip_or_raise(writer, skip_bad, "bad image", type(e)(f"{where}: {e}"))
                continue
            meta = {k: v for k, v in row.items() if k not in (icol, ccol)}
            meta.update(source=str(row[icol]), caption=str(caption))
            writer.write(f"{i:09d}", {field: data, "txt": str(caption), "json": json.dumps(meta, default=str)})
        if writer.total == 0:
            raise ValueError(f"{captions}: no usable row ({writer.skipped}); the old shards are kept")
    _report(writer, "samples")
    return writer


def write_shards_from_folders(root: str, out: str, *, template: str = "a photo of a {}.", shuffle: bool = True,
                              seed: int = 0, skip_bad: bool = False, max_image_pixels: Optional[int] = None,
                              prefix: str = "shard", maxcount: int = 10000, maxsize: int | str = "1GB",
                              progress: bool = True) -> ShardWriter:
    """Labelled shards from ``root/CLASS/*.jpg``, and ``classes.json`` in ``out``.

    Each sample holds the image, ``KEY.cls`` (the index of its class among the sorted folder
    names), ``KEY.txt`` (the caption from ``template``) and ``KEY.json``; keys are ``CLASS_FILESTEM``.

    Args:
        root: folder with one subfolder of images per class.
        out: output folder.
        template: caption template for the class name.
        shuffle: shuffle the samples with ``seed`` (shards then mix classes); else keep class order.
        seed: shuffle seed.
        skip_bad: skip undecodable images (counted in ``writer.skipped``); without it one stops the
            run, keeping the old shards.
        max_image_pixels: reject larger images (default: Pillow's decompression-bomb threshold, ~89M).
        prefix: shard file name prefix, a plain name without '/' or '..'.
        maxcount: samples per shard.
        maxsize: bytes per shard, e.g. 500MB.
        progress: show a progress bar.

    Raises:
        ValueError: no class folders or images, or an undecodable image (naming it).
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
    names = [c.replace("_", " ").replace("-", " ") for c in classes]   # class names: folder names, words spaced
    with ShardWriter(out, prefix, maxcount, parse_size(maxsize)) as writer:
        for label, cls, path in tqdm(items, desc=f"from-folders {prefix}", unit="img", disable=not progress):
            try:
                field, data = image_field(path, max_image_pixels)
            except BadImage as e:
                _skip_or_raise(writer, skip_bad, "bad image", e)
                continue
            key = sanitize_key(f"{cls}_{os.path.splitext(os.path.basename(path))[0]}")
            meta = {"label": label, "class": names[label], "source": os.path.relpath(path, root)}
            writer.write(key, {field: data, "cls": str(label), "txt": template.format(names[label]),
                               "json": json.dumps(meta)})
        if writer.total == 0:
            raise ValueError(f"{root}: no usable image ({writer.skipped}); the old shards are kept")
    with open(os.path.join(out, "classes.json"), "w") as f:
        json.dump({"classes": names, "folders": classes, "templates": [template]}, f, indent=1)
    _report(writer, "samples", f"; classes in {out}/classes.json")
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


def read_texts(paths: Sequence[str]) -> Iterator[str]:
    """The contents of UTF-8 text files, one at a time (for tokenizer training)."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def write_shards_from_text(out: str, files: Sequence[str], *, tokenizer: Optional[str] = None,
                           train_tokenizer: Optional[int] = None, root: Optional[str] = None, prefix: str = "shard",
                           maxcount: int = 1000, maxsize: int | str = "1GB", progress: bool = True) -> ShardWriter:
    """Text shards, one document (``KEY.txt`` + ``KEY.json``) per file; keys from the path relative to ``root``.

    Args:
        out: output folder.
        files: files, folders or glob patterns (quote ``**`` globs on a command line).
        tokenizer: also write ``tokens.json`` (the token counts of every shard) for this tokenizer
            (``clip`` or a ``tokenizer.json``).
        train_tokenizer: train a byte-level BPE of this vocabulary size on the files, save it as
            ``out/tokenizer.json`` and write its ``tokens.json``.
        root: keys are paths relative to this folder (default: the files' common folder).
        prefix: shard file name prefix, a plain name without '/' or '..'.
        maxcount: documents per shard.
        maxsize: bytes per shard, e.g. 500MB.
        progress: show a progress bar.

    Raises:
        FileNotFoundError: a pattern matches no file.
        ValueError: a file is not UTF-8 text (naming it).
    """
    paths = list(iter_text_files(files))
    if not paths:
        raise FileNotFoundError(f"no text files in {list(files)}")
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    with ShardWriter(out, prefix, maxcount, parse_size(maxsize)) as writer:
        for i, path in enumerate(tqdm(paths, desc=f"from-text {prefix}", unit="doc", disable=not progress)):
            with open(path, "rb") as f:
                raw = f.read()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e})") from None
            rel = os.path.relpath(os.path.abspath(path), root)
            writer.write(f"{i:06d}_{sanitize_key(rel)[:80]}", {"txt": raw, "json": json.dumps({"source": rel})})
    _report(writer, "documents")
    tok: Optional[LMTokenizer] = None
    if train_tokenizer:
        tok = train_byte_level_bpe(read_texts(paths), os.path.join(out, "tokenizer.json"), train_tokenizer)
        print(f"trained byte-level BPE (vocab {tok.vocab_size}): {tok.path}")
    elif tokenizer:
        tok = load_lm_tokenizer(tokenizer)
    if tok is not None:
        tokens = sum(count_tokens(writer.shards, tok).values())
        print(f"{tokens} tokens ({tok.name}) -> {os.path.join(out, TOKENS_FILE)}")
    return writer


def expand_shard_urls(urls: Sequence[str]) -> list[str]:
    """Shard files from files, brace patterns and globs (in order, without repeats).

    Raises:
        FileNotFoundError: one line listing the local shards that do not exist.
    """
    out = list(dict.fromkeys(u for s in expand_sources(list(urls)) for u in s.urls))
    check_shards_exist(out)
    return out


def check_shards(urls: Sequence[str], *, kind: Literal["image-text", "text"] = "image-text",
                 max_member_bytes: Optional[int | str] = MAX_MEMBER_BYTES,
                 max_image_pixels: Optional[int] = MAX_IMAGE_PIXELS,
                 pipe_timeout: Optional[float] = PIPE_TIMEOUT) -> bool:
    """Read every sample of the shards and print the counters (samples in/out, skips, shard problems).

    Args:
        urls: shards: files, brace patterns or globs, e.g. ``'data/cc3m/*.tar'``.
        kind: ``image-text`` decodes images and captions; ``text`` only the ``.txt`` documents.
        max_member_bytes: skip samples with a larger tar member, e.g. 64MB (``None``: no cap).
        max_image_pixels: skip larger images (``None``: no cap).
        pipe_timeout: kill a ``pipe:`` command silent for this many seconds (``None``: wait forever).

    Returns:
        True when every sample was read and no shard is empty, damaged, unreadable or miscounted
        by its ``sizes.json`` (``diffmm shards check`` exits 0), else False (exit 1).
    """
    shard_urls = expand_shard_urls(urls)
    stated = stated_counts(shard_urls)  # compared with sizes.json / *_stats.json where they exist
    limits = ReadLimits(None if max_member_bytes is None else parse_size(max_member_bytes), pipe_timeout)
    stats = DataStats("check")
    for url in tqdm(shard_urls, desc="check", unit="shard", disable=len(shard_urls) < 2):
        expected = stated.get(url)
        for s in iter_tar_samples(url, stats, limits=limits, expected=expected.samples if expected else None,
                                  expected_from=expected.source if expected else ""):
            stats.add("samples_in")
            where = f"{url}:{s['__key__']}"
            if decode_text(s, "txt", stats, where) is None:
                continue
            if kind == "image-text" and decode_image(s, stats, where, max_image_pixels) is None:
                continue
            stats.add("samples_out")
    print(stats.summary())
    snap = stats.snapshot()
    bad_shards = sum(snap[k] for k in ("shards_failed", "shards_truncated", "shards_empty", "shards_miscounted"))
    if len(stated) < len(shard_urls):
        print(f"{len(shard_urls) - len(stated)} of {len(shard_urls)} shards have no sizes.json entry "
              "(`diffmm shards index` writes one; training counts them on first use)")
    return stats.skipped == 0 and bad_shards == 0


def index_shards(urls: Sequence[str]) -> dict[str, dict[str, int]]:
    """Count the samples of existing local shards and write ``sizes.json`` beside them.

    Args:
        urls: local shards: files, brace patterns or globs, e.g. ``'dir/*.tar'``.

    Returns:
        ``{sizes.json path: {shard file name: samples}}`` of what was written.
    """
    written = write_sizes(expand_shard_urls(urls))
    for path, counts in written.items():
        print(f"{path}: {sum(counts.values())} samples in {len(counts)} shards")
    return written
