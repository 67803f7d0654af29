"""LM batches: raw text documents (``KEY.txt``) -> tokens -> packed fixed-length sequences.

Each document is tokenized and followed by the tokenizer's end-of-document id; the token
stream of one worker is cut into rows of ``seq_len + 1`` tokens (inputs ``row[:-1]``, targets
``row[1:]``, see :func:`inputs_targets`). A row may span several documents (packing); the
tail shorter than a row is dropped when the worker's stream ends.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterator, Sequence

import torch
from tqdm import tqdm

from diffmm.data.decode import decode_text
from diffmm.data.files import read_json, write_json_atomic
from diffmm.data.stats import DataStats
from diffmm.data.stream import ShardLoader, ShardStream
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.data.tokenizers import LMTokenizer, load_lm_tokenizer
from diffmm.data.urls import is_local

TOKENS_FILE = "tokens.json"
log = logging.getLogger("diffmm.data")


def inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``(B, seq_len+1)`` rows into inputs ``(B, seq_len)`` and next-token targets ``(B, seq_len)``."""
    return batch[:, :-1], batch[:, 1:]


def read_token_counts(urls: Sequence[str], tokenizer_name: str) -> int | None:
    """Total tokens (documents + separators) of ``urls`` from ``tokens.json`` files, if recorded for this tokenizer."""
    total = 0
    by_dir: dict[str, dict] = {}
    for url in urls:
        directory, name = os.path.split(url)
        if directory not in by_dir:
            by_dir[directory] = (read_json(os.path.join(directory, TOKENS_FILE)) or {}).get(tokenizer_name, {})
        if name not in by_dir[directory]:
            return None
        total += int(by_dir[directory][name])
    return total


class TextDataset(ShardStream):
    """Batches of packed token rows, long ``(B, seq_len + 1)``.

    Args:
        urls: shard spec of text shards.
        batch_size: rows per batch (per rank).
        seq_len: model context; rows hold ``seq_len + 1`` tokens.
        tokenizer: an :class:`~diffmm.data.tokenizers.LMTokenizer` or a spec for
            :func:`~diffmm.data.tokenizers.load_lm_tokenizer` (``"clip"`` or a tokenizer.json path).
        text_field: document field (file extension).
        samples_per_epoch: rows per epoch over all ranks; default from ``tokens.json`` (written by
            ``diffmm shards from-text --tokenizer``) as ``tokens // (seq_len + 1)``.
        **kwargs: :class:`ShardStream` options (``equalize`` defaults to ``train``).
    """

    def __init__(self, urls: str | Sequence[str], batch_size: int, seq_len: int,
                 tokenizer: LMTokenizer | str = "clip", text_field: str = "txt", train: bool = True,
                 **kwargs: Any) -> None:
        kwargs.setdefault("shuffle", train)
        kwargs.setdefault("equalize", train)
        kwargs.setdefault("shuffle_buffer", 100)
        super().__init__(urls, batch_size, **kwargs)
        self.tokenizer = load_lm_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.seq_len = seq_len
        self.text_field = text_field

    @property
    def samples_per_epoch(self) -> int:
        """Rows per epoch over all ranks (explicit, else from ``tokens.json``, which is written on
        first use by tokenizing the shards once when it has no entry for this tokenizer)."""
        if self._samples_per_epoch is None:
            tokens = read_token_counts(self.urls, self.tokenizer.name)
            if tokens is None and not all(is_local(u) for u in self.urls):
                raise ValueError(f"{self.name}: no tokens.json entry for tokenizer {self.tokenizer.name} next to "
                                 "the shards and they are not local files; pass samples_per_epoch= (rows per epoch)")
            if tokens is None:
                log.info("%s: no tokens.json entry for tokenizer %s: tokenizing %d shard(s) once to count tokens",
                         self.name, self.tokenizer.name, len(self.urls))
                tokens = sum(count_tokens(self.urls, self.tokenizer, progress=self.rank_world()[0] == 0).values())
            self._samples_per_epoch = tokens // (self.seq_len + 1)
        return self._samples_per_epoch

    def _process(self, sample: dict) -> list[int] | None:
        """The document's tokens followed by the end-of-document id, or ``None`` after counting a skip."""
        text = decode_text(sample, self.text_field, self.stats, f"{sample['__url__']}:{sample['__key__']}")
        return None if text is None else [*self.tokenizer.encode(text), self.tokenizer.eos_id]

    def _pack(self, items: Iterator[tuple[str, list[int]]]) -> Iterator[tuple[str, list[int]]]:
        """Documents packed into rows of ``seq_len + 1`` tokens; a row's key is ``KEY:T``, the document and
        token offset where the row starts."""
        row_len = self.seq_len + 1
        buf: list[int] = []
        docs: list[tuple[int, str]] = []   # (index in buf where a document starts, its key)
        for key, tokens in items:
            docs.append((len(buf), key))
            buf.extend(tokens)
            start = 0
            while len(buf) - start >= row_len:
                while len(docs) > 1 and docs[1][0] <= start:
                    docs.pop(0)
                yield f"{docs[0][1]}:{start - docs[0][0]}", buf[start:start + row_len]
                start += row_len
            del buf[:start]
            docs = [(i - start, k) for i, k in docs]

    def _collate(self, items: list[list[int]]) -> torch.Tensor:
        return torch.tensor(items, dtype=torch.long)


def text_loader(urls: str | Sequence[str], batch_size: int, seq_len: int, num_workers: int = 2,
                **dataset_kwargs: Any) -> ShardLoader:
    """A :class:`ShardLoader` over a :class:`TextDataset` (kwargs go to the dataset)."""
    return ShardLoader(TextDataset(urls, batch_size, seq_len, **dataset_kwargs), num_workers=num_workers)


def count_tokens(urls: Sequence[str], tokenizer: LMTokenizer, progress: bool = False) -> dict[str, int]:
    """Tokens (with one separator per document) of each shard url, also merged into the ``tokens.json`` beside
    the shards under the tokenizer's name (a folder that cannot be written keeps none; the counts are returned
    all the same)."""
    stats = DataStats("count-tokens")
    out: dict[str, int] = {}
    for url in tqdm(urls, desc="counting tokens", unit="shard", disable=not progress or len(urls) < 2):
        n = 0
        for sample in iter_tar_samples(url, stats):
            try:
                n += len(tokenizer.encode(sample["txt"].decode("utf-8"))) + 1
            except (KeyError, UnicodeDecodeError):  # the loader skips these documents too
                continue
        out[url] = n
    by_dir: dict[str, dict[str, int]] = {}
    for url, n in out.items():
        by_dir.setdefault(os.path.dirname(url), {})[os.path.basename(url)] = n
    for directory, counts in by_dir.items():
        path = os.path.join(directory, TOKENS_FILE)
        data = read_json(path) or {}
        data[tokenizer.name] = {**data.get(tokenizer.name, {}), **counts}
        try:
            write_json_atomic(path, data)
        except OSError as e:  # read-only data: the count is used, just not kept
            log.warning("could not write %s (%s)", path, e)
    return out
