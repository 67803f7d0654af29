"""Image-text retrieval: image->text and text->image recall@K on image-text shards.

An image may have several captions: the lines of ``KEY.txt`` (default) or a list in a JSON field
(``caption_field="json:captions"``). Text->image: a caption scores if its image is among the K most
similar images. Image->text: an image scores if any of its captions is among the K most similar
captions (the CLIP / CLIP_benchmark definition). Embeddings (not images) of the whole set are kept;
similarities are computed in chunks.
"""
from __future__ import annotations

import itertools
import json
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from diffmm.data.decode import decode_image
from diffmm.data.stream import ShardLoader, ShardStream
from diffmm.eval.common import EvalError, markdown_table, model_device
from diffmm.eval.zeroshot import encode_images, encode_texts


def parse_captions(sample: dict, field: str) -> list[str]:
    """Captions of a raw webdataset sample: lines of a text field, or a JSON ``json:NAME`` (str or list)."""
    if field.startswith("json:"):
        value = json.loads(sample["json"])[field[len("json:"):]]
        caps = [value] if isinstance(value, str) else list(value)
    else:
        caps = sample[field].decode("utf-8").splitlines()
    caps = [c.strip() for c in caps if isinstance(c, str) and c.strip()]
    if not caps:
        raise ValueError("no caption")
    return caps


class ImageCaptionsDataset(ShardStream):
    """Batches ``(images (B,3,S,S), captions list[list[str]])`` of image-text shards, each sample read once.

    Args:
        urls: shard spec.
        batch_size: images per batch.
        transform: PIL image -> tensor (the model's eval preprocess).
        caption_field: ``txt`` (one caption a line) or ``json:NAME`` (a string or a list).
    """

    def __init__(self, urls: str | Sequence[str], batch_size: int, transform: Callable,
                 caption_field: str = "txt") -> None:
        super().__init__(urls, batch_size, shuffle=False, equalize=False, name="retrieval")
        self.transform, self.caption_field = transform, caption_field

    def _process(self, sample: dict):
        where = f"{sample['__url__']}:{sample['__key__']}"
        try:
            caps = parse_captions(sample, self.caption_field)
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            self.stats.skip("missing_text", where, f"{self.caption_field}: {type(e).__name__}: {e}")
            return None
        img = decode_image(sample, self.stats, where)
        if img is None:
            return None
        try:
            return self.transform(img), caps
        except Exception as e:  # transform failures count as corrupt images
            self.stats.skip("corrupt_image", where, f"transform failed: {type(e).__name__}: {e}")
            return None

    def _collate(self, items):
        return torch.stack([im for im, _ in items]), [c for _, c in items]


def _first_hit_rank(queries: torch.Tensor, keys: torch.Tensor, hit_of, kmax: int, chunk: int) -> torch.Tensor:
    """Per query, the rank (0 = first) of its best-ranked matching key among the ``kmax`` most similar ones
    (``kmax`` when none is there); ``hit_of(top (c, kmax), start)`` marks the matching keys."""
    ranks = torch.empty(queries.shape[0], dtype=torch.long)
    for s in range(0, queries.shape[0], chunk):
        top = (queries[s:s + chunk] @ keys.T).topk(kmax, dim=1).indices  # (c, kmax)
        hit = hit_of(top, s)
        ranks[s:s + chunk] = torch.where(hit.any(1), hit.float().argmax(1).long(), kmax)
    return ranks


def recall_at_k(image_emb: torch.Tensor, text_emb: torch.Tensor, text_to_image: torch.Tensor,
                ks: Sequence[int] = (1, 5, 10), chunk: int = 1024) -> dict[str, float]:
    """Recall@K both ways from normalised embeddings; ``text_to_image[t]`` = index of caption t's image."""
    t2i_rank = _first_hit_rank(text_emb, image_emb, lambda top, s: top == text_to_image[s:s + chunk, None],
                               min(max(ks), image_emb.shape[0]), chunk)  # rank of the right image of each caption
    i2t_rank = _first_hit_rank(image_emb, text_emb,  # best rank of any of the image's captions
                               lambda top, s: text_to_image[top] == torch.arange(s, s + len(top))[:, None],
                               min(max(ks), text_emb.shape[0]), chunk)
    out = {}
    for k in ks:
        out[f"image_to_text_R@{k}"] = float((i2t_rank < k).float().mean())
        out[f"text_to_image_R@{k}"] = float((t2i_rank < k).float().mean())
    return out


@torch.no_grad()
def evaluate_retrieval(model, tokenizer, batches: Iterable[tuple[torch.Tensor, list[list[str]]]], *,
                       ks: Sequence[int] = (1, 5, 10), precision: str = "auto", show_progress: bool = True,
                       total: int | None = None, max_batches: int | None = None) -> dict[str, Any]:
    """Embed images and their captions batch by batch, then compute :func:`recall_at_k`."""
    device = model_device(model)
    imgs, txts, owner = [], [], []  # owner[t]: index of caption t's image
    n_img = 0
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="retrieval", disable=not show_progress, unit="img")
    for images, captions in itertools.islice(batches, max_batches):
        imgs.append(encode_images(model, images, precision=precision).cpu())
        flat = [c for caps in captions for c in caps]
        txts.append(encode_texts(model, tokenizer, flat, device=device, precision=precision).cpu())
        owner += [n_img + i for i, caps in enumerate(captions) for _ in caps]
        n_img += len(captions)
        bar.update(len(captions))
    bar.close()
    if not n_img:
        raise EvalError("retrieval: no image-caption pair was read (see the skip counts in the log)")
    out: dict[str, Any] = recall_at_k(torch.cat(imgs), torch.cat(txts), torch.tensor(owner), ks)
    out.update(images=n_img, texts=len(owner), seconds=time.perf_counter() - t0)
    return out


def retrieval_on_shards(model, tokenizer, urls, transform: Callable, *, caption_field: str = "txt",
                        batch_size: int = 64, num_workers: int = 2, **kwargs) -> dict[str, Any]:
    """:func:`evaluate_retrieval` over image-text shards; adds the data counters (skips) to the result."""
    try:
        ds = ImageCaptionsDataset(urls, batch_size, transform, caption_field)
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(f"shards {urls}: {e}") from None
    total = ds.samples_per_epoch if ds.shard_counts() is not None else None
    if total and kwargs.get("max_batches") is not None:  # the bar ends where max_batches stops
        total = min(total, kwargs["max_batches"] * batch_size)
    out = evaluate_retrieval(model, tokenizer, ShardLoader(ds, num_workers=num_workers), total=total, **kwargs)
    out["skipped"] = {k[len("skip_"):]: v for k, v in ds.stats.snapshot().items() if k.startswith("skip_") and v}
    return out


def retrieval_markdown(results: dict[str, dict], ks: Sequence[int] = (1, 5, 10)) -> str:
    """One row per model: image->text and text->image recall@K in %."""
    head = ["model", *[f"I->T R@{k}" for k in ks], *[f"T->I R@{k}" for k in ks], "images", "captions"]
    rows = [[name, *[100 * r[f"image_to_text_R@{k}"] for k in ks], *[100 * r[f"text_to_image_R@{k}"] for k in ks],
             r["images"], r["texts"]] for name, r in results.items()]
    return markdown_table(head, rows)
