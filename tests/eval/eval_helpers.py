"""Stand-in models and tiny data builders for the evaluation tests (hand-set, so the right answers are known)."""
from __future__ import annotations

import io
import json
import os
import re
import tarfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import functional as TF

# ------------------------------------------------------------------------------ lm-eval
def lm_eval_offline(tmp_path, monkeypatch) -> None:
    """lm-eval's datasets and hub reads stay offline and in ``tmp_path`` (local task folders only)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ------------------------------------------------------------------------------ image side
RANK_WEIGHTS = (1.0, 0.5, 0.25, 0.2, 0.15)  # feature weight of the 1st..5th class coded in an image
NONE = 255  # "no class" code


def to_tensor_rgb(img: Image.Image) -> torch.Tensor:
    """Test transform: no resizing or normalisation, so pixel codes survive."""
    return TF.to_tensor(img.convert("RGB"))


def code_image(ranked: list[int], size: int = 8) -> np.ndarray:
    """A grey (size, size) uint8 image whose first row holds the class ids the key model will rank 1st..5th."""
    arr = np.full((size, size), 7, dtype=np.uint8)
    codes = list(ranked) + [NONE] * (5 - len(ranked))
    arr[0, :5] = codes
    return arr


class KeyCLIP(nn.Module):
    """A CLIP whose image embedding is read from pixel codes and whose text embedding is the class one-hot.

    Image feature: ``sum_r RANK_WEIGHTS[r] * e_{code_r}``; text feature of prompt t for class c:
    ``e_c + 0.3 * e_{C + t}`` (a template direction no image has). So the predicted ranking of an
    image is exactly the ranking coded in its first pixel row.
    """

    def __init__(self, num_classes: int, num_templates: int):
        super().__init__()
        self.C, self.T = num_classes, num_templates
        self.dummy = nn.Parameter(torch.zeros(1))
        self.logit_scale = nn.Parameter(torch.tensor(np.log(100.0), dtype=torch.float32))

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        codes = torch.round(images[:, 0, 0, :5] * 255).long()  # (B, 5)
        feats = torch.zeros(images.shape[0], self.C + self.T)
        for r, w in enumerate(RANK_WEIGHTS):
            valid = codes[:, r] < self.C
            feats[valid, codes[valid, r]] += w
        return F.normalize(feats, dim=-1) if normalize else feats

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        feats = F.one_hot(tokens[:, 0], self.C + self.T).float()
        feats = feats + 0.3 * F.one_hot(self.C + tokens[:, 1], self.C + self.T).float()
        return F.normalize(feats, dim=-1) if normalize else feats


class KeyTokenizer:
    """Turns ``"<template word> of class<c>"`` prompts into ``[c, template index]`` rows."""

    def __init__(self, template_words: list[str]):
        self.words = template_words

    def __call__(self, texts):
        rows = []
        for t in texts:
            m = re.search(r"(\w+) of class(\d+)", t)
            rows.append([int(m.group(2)), self.words.index(m.group(1))])
        return torch.tensor(rows, dtype=torch.long)


def known_dataset(num_classes: int = 10) -> tuple[list[int], list[list[int]]]:
    """100 (label, coded ranking) pairs: 60 right at top-1, 20 right at rank 2, 10 at rank 5, 10 wrong at top-5.

    Returns labels and rankings; top-1 = 0.60, top-5 = 0.90 exactly.
    """
    labels, rankings = [], []
    others = lambda y, k: [(y + j) % num_classes for j in range(1, k + 1)]  # noqa: E731
    for i in range(100):
        y = i % num_classes
        if i < 60:
            r = [y] + others(y, 4)
        elif i < 80:
            r = [(y + 1) % num_classes, y] + [(y + j) % num_classes for j in (2, 3, 4)]
        elif i < 90:
            r = others(y, 4) + [y]
        else:
            r = others(y, 5)
        labels.append(y)
        rankings.append(r)
    return labels, rankings


def write_image_folder(root: str, labels, rankings, num_classes: int, prefix: str = "class") -> str:
    for c in range(num_classes):
        os.makedirs(os.path.join(root, f"{prefix}{c}"), exist_ok=True)
    for i, (y, r) in enumerate(zip(labels, rankings)):
        Image.fromarray(code_image(r)).save(os.path.join(root, f"{prefix}{y}", f"{i:05d}.png"))
    return root


def write_label_shard(path: str, labels, rankings, label_in_json: bool = False) -> str:
    with tarfile.open(path, "w") as tf:
        for i, (y, r) in enumerate(zip(labels, rankings)):
            buf = io.BytesIO()
            Image.fromarray(code_image(r)).save(buf, format="PNG")
            members = {"png": buf.getvalue(), "txt": f"an image of class{y}".encode()}
            if label_in_json:
                members["json"] = json.dumps({"label": y}).encode()
            else:
                members["cls"] = str(y).encode()
            for field, data in members.items():
                info = tarfile.TarInfo(f"{i:06d}.{field}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def tiny_open_clip(seed: int = 0):
    """A random 1-layer open_clip CLIP (32 px images, context 16) and its tokenizer."""
    import open_clip
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(seed)
    model = open_clip.CLIP(embed_dim=32, vision_cfg=CLIPVisionCfg(layers=1, width=32, patch_size=8, image_size=32,
                                                                  head_width=16),
                           text_cfg=CLIPTextCfg(context_length=16, vocab_size=49408, width=32, heads=2, layers=1))
    model.eval()
    tok = open_clip.tokenizer.SimpleTokenizer(context_length=16)
    return model, tok


# ------------------------------------------------------------------------------- LM side
class WordTokenizer:
    """Words and punctuation marks as tokens; the vocabulary grows as text is seen (up to ``vocab_size``)."""

    name = "words"

    def __init__(self, vocab_size: int = 4096):
        self.vocab_size = vocab_size
        self.words = ["<eos>"]
        self.ids = {"<eos>": 0}
        self.eos_id = 0

    def id(self, w: str) -> int:
        if w not in self.ids:
            if len(self.words) >= self.vocab_size:
                raise ValueError("WordTokenizer: vocabulary full")
            self.ids[w] = len(self.words)
            self.words.append(w)
        return self.ids[w]

    def encode(self, text: str) -> list[int]:
        return [self.id(w) for w in re.findall(r"\w+|[^\w\s]", text)]

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


class _TableLM(nn.Module):
    """Base of the rule-based stand-in LMs: ``rule(words, t) -> next word or None`` at each position."""

    def __init__(self, tok: WordTokenizer, block_size: int = 100_000, only_last: bool = False):
        super().__init__()
        self.tok, self.only_last = tok, only_last
        self.dummy = nn.Parameter(torch.zeros(1))
        self.block_size = block_size

    def rule(self, words: list[str], t: int):
        raise NotImplementedError

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        V = self.tok.vocab_size
        logits = torch.zeros(B, T, V)
        for b in range(B):
            words = [self.tok.words[i] for i in idx[b].tolist()]
            for t in ([T - 1] if self.only_last else range(T)):
                w = self.rule(words, t)
                if w is not None:
                    logits[b, t, self.tok.id(w)] = 20.0
        return logits


class NeedleOracle(_TableLM):
    """Answers "magic number of KEY is" with the value of the needle ``of KEY is VALUE`` if it lies within the
    last ``window`` tokens; otherwise predicts ".". Only the last position is computed (greedy decoding)."""

    def __init__(self, tok: WordTokenizer, window: int):
        super().__init__(tok, only_last=True)
        self.window = window

    def rule(self, words, t):
        T = t + 1
        if T >= 5 and words[t] == "is" and words[t - 3:t - 1] == ["number", "of"]:
            key = words[t - 1]
            for j in range(max(0, T - self.window), T - 4):
                if words[j:j + 3] == ["of", key, "is"] and words[j + 3].isdigit():
                    return words[j + 3]
        return "."


class RecencyICL(_TableLM):
    """After ``Label :`` predicts the label of the previous demonstration (order-sensitive by design)."""

    def rule(self, words, t):
        if t >= 1 and words[t] == ":" and words[t - 1] == "Label":
            for j in range(t - 2, 0, -1):
                if words[j] == ":" and words[j - 1] == "Label" and j + 1 < len(words):
                    return words[j + 1]
        return None


class ReaderICL(_TableLM):
    """After ``Label :`` predicts the true label of the input text (order-insensitive)."""

    def __init__(self, tok, label_of_word: dict[str, str]):
        super().__init__(tok)
        self.label_of_word = label_of_word

    def rule(self, words, t):
        if t >= 1 and words[t] == ":" and words[t - 1] == "Label":
            for j in range(t - 2, -1, -1):
                if words[j] in self.label_of_word:
                    return self.label_of_word[words[j]]
        return None


class CopyLastWord(_TableLM):
    """Repeats the last word of the prompt, then ends the text (for generate_until)."""

    def rule(self, words, t):
        if t >= 1 and words[t - 1] == "say":
            return words[t]
        if t >= 2 and words[t - 2] == "say" and words[t - 1] == words[t]:
            return "<eos>"
        return None


class UnigramLM(nn.Module):
    """Next-token distribution ``softmax(logits)`` independent of the context (uniform by default)."""

    def __init__(self, vocab_size: int, logits: torch.Tensor | None = None, block_size: int = 100_000):
        super().__init__()
        self.table = nn.Parameter(logits if logits is not None else torch.zeros(vocab_size), requires_grad=False)
        self.block_size = block_size

    def forward(self, idx):
        return self.table.expand(*idx.shape, -1).clone()


class OneLayerLM(nn.Module):
    """One-hot embedding (E = vocab), one attention layer (residual) and an identity head.

    ``attn`` is a diffmm ``Attention`` or ``DiffAttention`` of width E whose weights the tests set.
    """

    def __init__(self, attn: nn.Module, vocab: int, emb: torch.Tensor | None = None):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Parameter(emb if emb is not None else torch.eye(vocab), requires_grad=False)
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].attn = attn
        self.block_size = 100_000

    def forward(self, idx):
        x = self.emb[idx]
        blk = self.blocks[0]
        x = x + blk.attn(x, causal=True)
        return x


class BlockWrapLM(nn.Module):
    """Like OneLayerLM but the block is a module whose forward runs the attention (so hooks see a block output)."""

    class Block(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return x + self.attn(x, causal=True)

    def __init__(self, attn: nn.Module, emb: torch.Tensor):
        super().__init__()
        self.emb = nn.Parameter(emb, requires_grad=False)
        self.blocks = nn.ModuleList([self.Block(attn)])
        self.block_size = 100_000

    def forward(self, idx):
        x = self.emb[idx]
        for b in self.blocks:
            x = b(x)
        return x


def write_text_shard(path: str, docs: list[str]) -> str:
    with tarfile.open(path, "w") as tf:
        for i, doc in enumerate(docs):
            data = doc.encode()
            info = tarfile.TarInfo(f"doc{i:05d}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


HAYSTACK_TEXT = " ".join(
    f"Sentence {i} talks about topic {i % 7} and mentions the river {i % 5} near the hill {i % 3}."
    for i in range(400))


class TableCLIP(nn.Module):
    """Image embedding = ``img_table[id coded in pixel (0, 0)]``; text ``"cap<j>"`` -> ``txt_table[j]``."""

    def __init__(self, img_table: torch.Tensor, txt_table: torch.Tensor):
        super().__init__()
        self.img_table = nn.Parameter(img_table, requires_grad=False)
        self.txt_table = nn.Parameter(txt_table, requires_grad=False)

    def encode_image(self, images):
        return self.img_table[torch.round(images[:, 0, 0, 0] * 255).long()]

    def encode_text(self, tokens):
        return self.txt_table[tokens[:, 0]]


def cap_tokenizer(texts):
    return torch.tensor([[int(re.search(r"cap(\d+)", t).group(1))] for t in texts])


def write_caption_shard(path: str, captions: list[list[int]], start: int = 0, extra_bad: bool = False,
                        as_json: bool = False) -> str:
    """Image i (id start+i coded in pixel (0,0)) with captions ``cap<j>`` for j in captions[i]."""
    with tarfile.open(path, "w") as tf:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

        for i, caps in enumerate(captions):
            buf = io.BytesIO()
            Image.fromarray(np.full((4, 4), start + i, dtype=np.uint8)).save(buf, format="PNG")
            add(f"{start + i:06d}.png", buf.getvalue())
            if as_json:
                add(f"{start + i:06d}.json", json.dumps({"captions": [f"cap{j}" for j in caps]}).encode())
            else:
                add(f"{start + i:06d}.txt", "\n".join(f"cap{j}" for j in caps).encode())
        if extra_bad:
            add("bad1.png", b"garbage")
            add("bad1.txt", b"cap0")
            buf = io.BytesIO()
            Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(buf, format="PNG")
            add("bad2.png", buf.getvalue())  # no caption
    return path
