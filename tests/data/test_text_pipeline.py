"""LM text pipeline: tokenization, packing with separators, tokenizers, epoch length, DDP equal batches."""
from __future__ import annotations

import os

import pytest
import torch

from diffmm.data.text import TextDataset, count_tokens, inputs_targets, text_loader
from diffmm.data.tokenizers import ClipBPE, load_lm_tokenizer, train_byte_level_bpe
from diffmm.data.writer import ShardWriter

pytestmark = pytest.mark.timeout(120)  # a broken batch quota hangs instead of failing


class CharTokenizer:
    """Bytes as tokens, 0 as the separator (easy to predict exactly)."""

    name, vocab_size, eos_id = "char", 256, 0

    def encode(self, text):
        return list(text.encode("utf-8"))


DOCS = ["hello world", "second doc", "x" * 25, "last one!"]


def write_docs(directory, docs, prefix="t", maxcount=2):
    with ShardWriter(directory, prefix, maxcount=maxcount) as w:
        for i, d in enumerate(docs):
            w.write(f"{i:04d}", {"txt": d})
    return w


def test_packing_is_the_separated_token_stream_cut_into_rows(tmp_path):
    w = write_docs(str(tmp_path), DOCS)
    loader = text_loader(w.pattern, batch_size=2, seq_len=7, num_workers=0, tokenizer=CharTokenizer(), train=False)
    rows = torch.cat(list(loader))
    stream = [t for d in DOCS for t in (*d.encode(), 0)]
    n_rows = len(stream) // 8
    assert rows.shape == (n_rows, 8)
    assert rows.flatten().tolist() == stream[:n_rows * 8]
    x, y = inputs_targets(rows)
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (n_rows, 7)


def test_bad_documents_are_skipped_and_counted(tmp_path):
    with ShardWriter(str(tmp_path), "t") as w:
        w.write("0000", {"txt": "fine text " * 5})
        w.write("0001", {"txt": b"\xff\xfe\xfa"})
        w.write("0002", {"json": "{}"})
    ds = TextDataset(w.pattern, 1, seq_len=4, tokenizer=CharTokenizer(), train=False)
    list(ds)
    c = ds.stats.snapshot()
    assert (c["samples_in"], c["samples_out"], c["skip_bad_utf8"], c["skip_missing_text"]) == (3, 1, 1, 1)


def test_tokens_json_gives_the_epoch_and_ranks_get_equal_batches(tmp_path):
    docs = [f"document number {i} " * (1 + i % 7) for i in range(30)]
    w = write_docs(str(tmp_path), docs, maxcount=4)
    tok = CharTokenizer()
    count_tokens(w.shards, tok)
    total = sum(len(d.encode()) + 1 for d in docs)
    counts = []
    for rank in range(2):
        ds = TextDataset(w.pattern, 3, seq_len=15, tokenizer=tok, rank=rank, world_size=2)
        assert ds.samples_per_epoch == total // 16
        batches = list(text_loader(w.pattern, 3, 15, num_workers=2, tokenizer=tok, rank=rank, world_size=2))
        assert all(b.shape == (3, 16) for b in batches)
        counts.append(len(batches))
    assert counts[0] == counts[1] == (total // 16) // 6


def test_missing_tokens_json_is_counted_once_and_written(tmp_path):
    import json

    w = write_docs(str(tmp_path), DOCS)
    tok = CharTokenizer()
    n = len(TextDataset(w.pattern, 2, seq_len=4, tokenizer=tok, train=True))
    total = sum(len(d.encode()) + 1 for d in DOCS)
    assert n == (total // 5) // 2
    assert sum(json.load(open(tmp_path / "tokens.json"))[tok.name].values()) == total
    with pytest.raises(ValueError, match="samples_per_epoch"):   # not local: cannot be counted up front
        len(TextDataset(f"pipe:cat {w.shards[0]}", 2, seq_len=4, tokenizer=CharTokenizer(), train=True))


def test_byte_level_bpe_trains_saves_and_reloads(tmp_path):
    texts = ["The quick brown fox jumps over the lazy dog. " * 20, "def f(x):\n    return x * 2\n" * 20, "naïve café ✓"]
    tok = train_byte_level_bpe(texts, str(tmp_path / "tokenizer.json"), vocab_size=300)
    again = load_lm_tokenizer(str(tmp_path))          # a folder holding tokenizer.json
    assert again.vocab_size == tok.vocab_size <= 300 and again.eos_id == tok.eos_id
    ids = again.encode("naïve café ✓ unseen ünïcödé")
    assert again.decode(ids) == "naïve café ✓ unseen ünïcödé"      # byte-level: no unknown tokens
    assert len(again.encode("The quick brown fox")) < len("The quick brown fox")  # merges were learned


def test_clip_bpe_as_lm_tokenizer():
    tok = ClipBPE()
    assert tok.vocab_size == 49408 and tok.eos_id == 49407
    assert tok.decode(tok.encode("a photo of a cat")).strip() == "a photo of a cat"


def test_tokenizer_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_lm_tokenizer(os.path.join(str(tmp_path), "nope.json"))
