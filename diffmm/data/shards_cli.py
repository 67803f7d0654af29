"""``diffmm shards ...``: write webdataset shards, build the demo datasets, check shards, draw a montage."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

DEFAULT_OUT = "data"


def parse_size(text: str) -> int:
    """``"500MB"``, ``"1GB"``, ``"4096"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 500MB, 1GB, 4096)")
    unit = (m.group(2) or "").rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


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
    parser = argparse.ArgumentParser(prog="diffmm shards", description=__doc__)
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
        p = sub.add_parser(name, help=help_)
        p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
        p.add_argument("--no-install", action="store_true", help="never run apt/npm; just say what to install")
        if name in ("demo-emoji", "demo-all"):
            p.add_argument("--styles", default="noto,google,twitter,openmoji", help="comma-separated art styles")
            p.add_argument("--size", type=int, default=64, help="stored image side in px (default: 64)")
            p.add_argument("--skin-tones", action="store_true", help="also the skin-tone variants (~3,650 vs ~1,870)")
            from diffmm.data.sources import DEFAULT_NPM_DIR
            p.add_argument("--npm-dir", default=DEFAULT_NPM_DIR, help="where npm packages are installed/found")
        if name in ("demo-fashion-mnist", "demo-all"):
            p.add_argument("--train-limit", type=int, default=10000, help="first N training images (0: all 60,000)")
        if name in ("demo-text", "demo-all"):
            p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default: 8192)")

    p = sub.add_parser("check", help="read shards and report samples, skips and shard problems (exit 1 if any)")
    p.add_argument("urls", nargs="+", help="shards: files, brace patterns or globs, e.g. "
                                           "'data/emoji/noto/emoji-noto-{000000..000001}.tar' or 'dir/*.tar'")
    p.add_argument("--kind", choices=("image-text", "text"), default="image-text")
    from diffmm.data.image_text import MAX_IMAGE_PIXELS
    from diffmm.data.tar_reader import MAX_MEMBER_BYTES, PIPE_TIMEOUT

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


def _urls(specs: list[str]) -> list[str]:
    from diffmm.data.urls import check_shards_exist, expand_sources

    urls = list(dict.fromkeys(u for spec in specs for s in expand_sources(spec) for u in s.urls))
    check_shards_exist(urls)
    return urls


def _check(specs: list[str], kind: str, max_member_bytes: int | None = None, max_image_pixels: int | None = None,
           pipe_timeout: float | None = None) -> int:
    from diffmm.data.image_text import decode_image
    from tqdm import tqdm

    from diffmm.data.sizes import stated_counts
    from diffmm.data.stats import DataStats
    from diffmm.data.tar_reader import ReadLimits, iter_tar_samples

    shard_urls = _urls(specs)
    stated = stated_counts(shard_urls)  # compared with sizes.json / *_stats.json where they exist
    limits = ReadLimits(max_member_bytes, pipe_timeout)
    stats = DataStats("check")
    for url in tqdm(shard_urls, desc="check", unit="shard", disable=len(shard_urls) < 2):
        expected = stated.get(url)
        for s in iter_tar_samples(url, stats, limits=limits, expected=expected.samples if expected else None,
                                  expected_from=expected.source if expected else ""):
            stats.add("samples_in")
            where = f"{url}:{s['__key__']}"
            if "txt" not in s:
                stats.skip("missing_text", where)
                continue
            try:
                s["txt"].decode("utf-8")
            except UnicodeDecodeError:
                stats.skip("bad_utf8", where)
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
    return 0 if stats.skipped == 0 and bad_shards == 0 else 1


def _index(specs: list[str]) -> int:
    from diffmm.data.sizes import write_sizes

    written = write_sizes(_urls(specs))
    for path, counts in written.items():
        print(f"{path}: {sum(counts.values())} samples in {len(counts)} shards")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``diffmm shards``."""
    args = build_parser().parse_args(argv)
    import logging

    from diffmm.data.sources import MissingSource

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    try:
        return _run(args)
    except (MissingSource, FileNotFoundError, ValueError, KeyError) as e:
        print(f"diffmm shards {args.command}: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    c = args.command
    if getattr(args, "prefix", None) is not None:
        from diffmm.data.writer import check_prefix

        check_prefix(args.prefix)  # before anything is read or written
    if c == "from-captions":
        from diffmm.data.shard_sources import from_captions

        w = from_captions(args.image_dir, args.captions, args.out, args.prefix, args.maxcount, args.maxsize,
                          args.image_column, args.caption_column, args.skip_missing, skip_bad=args.skip_bad,
                          max_pixels=args.max_image_pixels)
        print(f"wrote {w.total} samples in {len(w.shards)} shards: {w.pattern}"
              + (f"; {w.skipped}" if w.skipped.total else ""))
    elif c == "from-folders":
        from diffmm.data.shard_sources import from_folders

        w = from_folders(args.root, args.out, args.prefix, args.maxcount, args.maxsize, args.template,
                         not args.no_shuffle, args.seed, skip_bad=args.skip_bad, max_pixels=args.max_image_pixels)
        print(f"wrote {w.total} samples in {len(w.shards)} shards: {w.pattern}; classes in {args.out}/classes.json"
              + (f"; {w.skipped}" if w.skipped.total else ""))
    elif c == "from-text":
        from diffmm.data.shard_sources import from_text

        w = from_text(args.files, args.out, args.prefix, args.maxcount, args.maxsize)
        print(f"wrote {w.total} documents in {len(w.shards)} shards: {w.pattern}")
        tok = None
        if args.train_tokenizer:
            from diffmm.data.shard_sources import iter_text_files
            from diffmm.data.tokenizers import train_byte_level_bpe

            def texts():
                for path in iter_text_files(args.files):
                    with open(path, encoding="utf-8") as f:
                        yield f.read()

            tok = train_byte_level_bpe(texts(), os.path.join(args.out, "tokenizer.json"), args.train_tokenizer)
            print(f"trained byte-level BPE (vocab {tok.vocab_size}): {tok.path}")
        elif args.tokenizer:
            from diffmm.data.tokenizers import load_lm_tokenizer

            tok = load_lm_tokenizer(args.tokenizer)
        if tok is not None:
            from diffmm.data.text import count_tokens, write_token_counts

            counts = count_tokens(w.shards, tok)
            print(f"{sum(counts.values())} tokens ({tok.name}) -> {write_token_counts(args.out, tok, counts)}")
    elif c in ("demo-emoji", "demo-fashion-mnist", "demo-text", "demo-all"):
        _demo(args)
    elif c == "check":
        return _check(args.urls, args.kind, args.max_member_bytes, args.max_image_pixels, args.pipe_timeout)
    elif c == "index":
        return _index(args.urls)
    elif c == "montage":
        from diffmm.data.montage import demo_montage

        print(f"wrote {demo_montage(args.data, args.out)}")
    return 0


def _demo(args: argparse.Namespace) -> None:
    c, install = args.command, not args.no_install
    if c in ("demo-emoji", "demo-all"):
        from diffmm.data.demo_emoji import build_emoji

        styles = [s.strip() for s in args.styles.split(",") if s.strip()]
        counts = build_emoji(args.out, styles, args.size, args.skin_tones, npm_dir=args.npm_dir, install=install)
        print("emoji: " + json.dumps(counts))
    if c in ("demo-fashion-mnist", "demo-all"):
        from diffmm.data.demo_fashion_mnist import build_fashion_mnist

        counts = build_fashion_mnist(args.out, train_limit=args.train_limit or None, install=install)
        print("fashion-mnist: " + json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "per_class"}
                                               for k, v in counts.items()}))
    if c in ("demo-text", "demo-all"):
        from diffmm.data.demo_text import build_python_docs

        info = build_python_docs(args.out, vocab_size=args.vocab_size, install=install)
        print("python-docs: " + json.dumps(info))
