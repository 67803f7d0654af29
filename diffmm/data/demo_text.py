"""Demo LM corpus: the Python 3.11 documentation reST sources (Debian ``python3.11-doc``).

Writes ``OUT/python-docs/{train,val}/pydocs-SPLIT-NNNNNN.tar`` (one ``.rst`` page per sample;
about 1 page in 20 goes to ``val``, chosen by a hash of its path), a byte-level BPE trained on the
train split (``OUT/python-docs/tokenizer.json``) and ``tokens.json`` per split with its token counts.
"""
from __future__ import annotations

import hashlib
import json
import os

from diffmm.data.shard_sources import from_text, iter_text_files
from diffmm.data.sources import ensure_apt
from diffmm.data.text import count_tokens, write_token_counts
from diffmm.data.tokenizers import train_byte_level_bpe

PYDOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"


def is_val(rel_path: str, val_every: int = 20) -> bool:
    """Deterministic split: a page is in ``val`` when the hash of its relative path is 0 modulo ``val_every``."""
    return int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest(), 16) % val_every == 0


def build_python_docs(out_dir: str, source_dir: str = PYDOC_SOURCES, vocab_size: int = 8192, val_every: int = 20,
                      maxcount: int = 100, install: bool = True, progress: bool = True) -> dict:
    """Build the Python-docs text shards and tokenizer under ``out_dir/python-docs``; returns the counts."""
    if source_dir == PYDOC_SOURCES:
        ensure_apt("python3.11-doc", os.path.join(PYDOC_SOURCES, "contents.rst.txt"), install)
    files = [p for p in iter_text_files([os.path.join(source_dir, "**", "*.txt")])]
    splits = {"train": [], "val": []}
    for p in files:
        splits["val" if is_val(os.path.relpath(p, source_dir), val_every) else "train"].append(p)
    root = os.path.join(out_dir, "python-docs")
    counts: dict = {}
    writers = {}
    for split, paths in splits.items():
        if not paths:
            raise ValueError(f"{source_dir}: the {split} split is empty ({len(files)} files)")
        writers[split] = from_text(paths, os.path.join(root, split), prefix=f"pydocs-{split}", maxcount=maxcount,
                                   root=source_dir, progress=progress)

    def train_texts():
        for p in splits["train"]:
            with open(p, encoding="utf-8") as f:
                yield f.read()

    tok = train_byte_level_bpe(train_texts(), os.path.join(root, "tokenizer.json"), vocab_size=vocab_size)
    for split, writer in writers.items():
        per_shard = count_tokens(writer.shards, tok)
        write_token_counts(os.path.join(root, split), tok, per_shard)
        n_bytes = sum(os.path.getsize(p) for p in splits[split])
        counts[split] = {"documents": writer.total, "shards": len(writer.shards), "pattern": writer.pattern,
                         "bytes": n_bytes, "tokens": sum(per_shard.values())}
    info = {"tokenizer": "tokenizer.json", "tokenizer_name": tok.name, "vocab_size": tok.vocab_size,
            "eos_token": tok.eos_token, "eos_id": tok.eos_id, "counts": counts}
    with open(os.path.join(root, "info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info
