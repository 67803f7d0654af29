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


def _add_limits(p: argparse.ArgumentParser, maxcount: int) -> None:
    p.add_argument("--prefix", default="shard", help="shard file name prefix (default: shard)")
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
    p.add_argument("--skip-missing", action="store_true", help="skip rows whose image file is missing")
    _add_limits(p, 10000)

    p = sub.add_parser("from-folders", help="ROOT/CLASS/*.jpg -> labelled shards + classes.json")
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--template", default="a photo of a {}.", help="caption template for the class name")
    p.add_argument("--no-shuffle", action="store_true", help="keep class order (default: shuffle with --seed)")
    p.add_argument("--seed", type=int, default=0)
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

    p = sub.add_parser("check", help="read shards and report samples, skips and shard problems")
    p.add_argument("urls", help="shard spec, e.g. 'data/emoji/noto/emoji-noto-{000000..000001}.tar'")
    p.add_argument("--kind", choices=("image-text", "text"), default="image-text")

    p = sub.add_parser("montage", help="draw a PNG of demo samples")
    p.add_argument("--data", default=DEFAULT_OUT)
    p.add_argument("--out", default="docs/img/demo_montage.png")
    return parser


def _check(urls: str, kind: str) -> int:
    from diffmm.data.image_text import decode_image
    from diffmm.data.stats import DataStats
    from diffmm.data.tar_reader import iter_tar_samples
    from diffmm.data.urls import check_shards_exist, expand_sources

    shard_urls = [u for s in expand_sources(urls) for u in s.urls]
    check_shards_exist(shard_urls)
    stats = DataStats("check")
    for url in shard_urls:
        for s in iter_tar_samples(url, stats):
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
            if kind == "image-text" and decode_image(s, stats, where) is None:
                continue
            stats.add("samples_out")
    print(stats.summary())
    return 0 if stats.skipped == 0 and stats.snapshot()["shards_failed"] == 0 else 1


def main(argv: list[str]) -> int:
    """Entry point of ``diffmm shards``."""
    args = build_parser().parse_args(argv)
    from diffmm.data.sources import MissingSource

    try:
        return _run(args)
    except (MissingSource, FileNotFoundError, ValueError, KeyError) as e:
        print(f"diffmm shards {args.command}: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    c = args.command
    if c == "from-captions":
        from diffmm.data.shard_sources import from_captions

        w = from_captions(args.image_dir, args.captions, args.out, args.prefix, args.maxcount, args.maxsize,
                          args.image_column, args.caption_column, args.skip_missing)
        print(f"wrote {w.total} samples in {len(w.shards)} shards: {w.pattern}"
              + (f" ({w.skipped_missing} rows skipped: image missing)" if w.skipped_missing else ""))
    elif c == "from-folders":
        from diffmm.data.shard_sources import from_folders

        w = from_folders(args.root, args.out, args.prefix, args.maxcount, args.maxsize, args.template,
                         not args.no_shuffle, args.seed)
        print(f"wrote {w.total} samples in {len(w.shards)} shards: {w.pattern}; classes in {args.out}/classes.json")
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
        return _check(args.urls, args.kind)
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
