"""``diffmm shards ...``: write webdataset shards, build the demo datasets, check shards, draw a montage.

Each subcommand calls one function (:mod:`diffmm.data.shard_tools`, :mod:`diffmm.demo.datasets`,
:mod:`diffmm.demo.montage`) with the parsed options; its errors become one line and exit status 1.
"""
from __future__ import annotations

import argparse
import logging
import sys

from diffmm.data.decode import MAX_IMAGE_PIXELS
from diffmm.data.shard_tools import (check_shards, index_shards, parse_size, write_shards_from_captions,
                                     write_shards_from_folders, write_shards_from_text)
from diffmm.data.system_data import NPM_DIR
from diffmm.data.tar_reader import MAX_MEMBER_BYTES, PIPE_TIMEOUT
from diffmm.demo.datasets import STYLES, build_demo_data, build_emoji, build_fashion_mnist, build_python_docs
from diffmm.demo.montage import draw_demo_montage

DEFAULT_OUT = "data"


def _pixels(text: str) -> int | None:
    if text.lower() in ("none", "0", "off"):
        return None
    try:
        return int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad pixel count {text!r} (e.g. 89478485, 1e8 or none)") from None


def _add_limits(p: argparse.ArgumentParser, maxcount: int) -> None:
    p.add_argument("--prefix", default="shard",
                   help="shard file name prefix, a plain name without '/' or '..' (default: shard)")
    p.add_argument("--maxcount", type=int, default=maxcount, help=f"samples per shard (default: {maxcount})")
    p.add_argument("--maxsize", type=parse_size, default=1 << 30, help="bytes per shard, e.g. 500MB (default: 1GB)")


def build_parser() -> argparse.ArgumentParser:
    """The ``diffmm shards`` argument parser."""
    parser = argparse.ArgumentParser(prog="diffmm shards", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("from-captions", help="image folder + captions table (CSV/TSV/JSONL/parquet) -> shards")
    p.add_argument("image_dir")
    p.add_argument("captions", help="table with an image path column and a caption column")
    p.add_argument("out")
    p.add_argument("--image-column", help="default: first of image,file,filename,filepath,path,url")
    p.add_argument("--caption-column", help="default: first of caption,text,title,txt")
    p.add_argument("--skip-missing", action="store_true", help="skip rows whose image file is missing (counted)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip rows with a missing or undecodable image or an empty caption (counted); "
                        "default: stop, keeping the old shards")
    p.add_argument("--max-image-pixels", type=_pixels, default=None,
                   help="reject larger images (default: Pillow's decompression-bomb threshold, ~89M)")
    _add_limits(p, 10000)

    p = sub.add_parser("from-folders", help="ROOT/CLASS/*.jpg -> labelled shards + classes.json")
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--template", default="a photo of a {}.", help="caption template for the class name")
    p.add_argument("--no-shuffle", action="store_true", help="keep class order (default: shuffle with --seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-bad", action="store_true",
                   help="skip undecodable images (counted); default: stop, keeping the old shards")
    p.add_argument("--max-image-pixels", type=_pixels, default=None,
                   help="reject larger images (default: Pillow's decompression-bomb threshold, ~89M)")
    _add_limits(p, 10000)

    p = sub.add_parser("from-text", help="text files (one document each) -> text shards")
    p.add_argument("out")
    p.add_argument("files", nargs="+", help="files, folders or glob patterns (quote ** globs)")
    p.add_argument("--tokenizer", help="also write tokens.json for this tokenizer (clip or a tokenizer.json)")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of this vocabulary size on the files, save OUT/tokenizer.json")
    _add_limits(p, 1000)

    for name, help_ in (("demo-emoji", "emoji image-caption pairs in several art styles"),
                        ("demo-fashion-mnist", "Fashion-MNIST zero-shot classification shards"),
                        ("demo-text", "Python documentation text corpus + BPE tokenizer"),
                        ("demo-all", "all three demo datasets")):
        p = sub.add_parser(name, help=help_ + " (from the packages `make demo-data` installs)")
        p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
        if name in ("demo-emoji", "demo-all"):
            p.add_argument("--styles", default=",".join(STYLES), help="comma-separated art styles")
            p.add_argument("--size", type=int, default=64, help="stored image side in px (default: 64)")
            p.add_argument("--skin-tones", action="store_true", help="also the skin-tone variants (~3,650 vs ~1,870)")
            p.add_argument("--npm-dir", default=NPM_DIR, help="where the npm emoji packages are installed")
        if name in ("demo-fashion-mnist", "demo-all"):
            p.add_argument("--train-limit", type=int, default=10000, help="first N training images (0: all 60,000)")
        if name in ("demo-text", "demo-all"):
            p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default: 8192)")

    p = sub.add_parser("check", help="read shards and report samples, skips and shard problems (exit 1 if any)")
    p.add_argument("urls", nargs="+", help="shards: files, brace patterns or globs, e.g. "
                                           "'data/emoji/noto/emoji-noto-{000000..000001}.tar' or 'dir/*.tar'")
    p.add_argument("--kind", choices=("image-text", "text"), default="image-text")
    p.add_argument("--max-member-bytes", type=parse_size, default=MAX_MEMBER_BYTES,
                   help=f"skip samples with a larger tar member, e.g. 64MB (default: {MAX_MEMBER_BYTES >> 20}MB)")
    p.add_argument("--max-image-pixels", type=_pixels, default=MAX_IMAGE_PIXELS,
                   help=f"skip larger images (default: {MAX_IMAGE_PIXELS}; 'none': no cap)")
    p.add_argument("--pipe-timeout", type=float, default=PIPE_TIMEOUT,
                   help=f"kill a pipe: command silent for this many seconds (default: {PIPE_TIMEOUT:g})")

    p = sub.add_parser("index", help="count the samples of shards and write sizes.json beside them")
    p.add_argument("urls", nargs="+", help="local shards: files, brace patterns or globs, e.g. 'dir/*.tar'")

    p = sub.add_parser("montage", help="draw a PNG of demo samples")
    p.add_argument("--data", default=DEFAULT_OUT)
    p.add_argument("--out", default="docs/img/demo_montage.png")
    return parser


def _run(a: argparse.Namespace) -> int:
    c = a.command
    limits = {"prefix": a.prefix, "maxcount": a.maxcount, "maxsize": a.maxsize} if hasattr(a, "prefix") else {}
    styles = [s.strip() for s in a.styles.split(",") if s.strip()] if hasattr(a, "styles") else []
    if c == "from-captions":
        write_shards_from_captions(a.image_dir, a.captions, a.out, image_column=a.image_column,
                                   caption_column=a.caption_column, skip_missing=a.skip_missing, skip_bad=a.skip_bad,
                                   max_image_pixels=a.max_image_pixels, **limits)
    elif c == "from-folders":
        write_shards_from_folders(a.root, a.out, template=a.template, shuffle=not a.no_shuffle, seed=a.seed,
                                  skip_bad=a.skip_bad, max_image_pixels=a.max_image_pixels, **limits)
    elif c == "from-text":
        write_shards_from_text(a.out, a.files, tokenizer=a.tokenizer, train_tokenizer=a.train_tokenizer, **limits)
    elif c == "demo-emoji":
        build_emoji(a.out, styles, a.size, a.skin_tones, a.npm_dir)
    elif c == "demo-fashion-mnist":
        build_fashion_mnist(a.out, train_limit=a.train_limit or None)
    elif c == "demo-text":
        build_python_docs(a.out, vocab_size=a.vocab_size)
    elif c == "demo-all":
        build_demo_data(a.out, styles, a.size, a.skin_tones, a.npm_dir, a.train_limit or None, a.vocab_size)
    elif c == "check":
        ok = check_shards(a.urls, kind=a.kind, max_member_bytes=a.max_member_bytes,
                          max_image_pixels=a.max_image_pixels, pipe_timeout=a.pipe_timeout)
        return 0 if ok else 1
    elif c == "index":
        index_shards(a.urls)
    elif c == "montage":
        draw_demo_montage(a.data, a.out)
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``diffmm shards``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except (FileNotFoundError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"diffmm shards {args.command}: error: {msg}", file=sys.stderr)
        return 1
