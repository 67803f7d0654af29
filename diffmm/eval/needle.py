"""Multi-needle retrieval (DIFF Transformer paper, section 3.4) and the attention it spends on the answer.

A haystack of real text (e.g. the Python 3.11 docs) of ``context_length`` tokens holds N needles
``"The magic number of <city> is <number>."``. R of them, the queried ones, sit together at a given
depth (0 = start, 1 = end of the haystack); the other N - R are distractors at random places. For
each queried needle the prompt ends with ``"What is the magic number of <city>? The magic number of
<city> is"`` and the model decodes greedily; it scores if the number appears in its answer.
Accuracy is reported per depth and overall.

:func:`answer_attention` measures, for the last prompt position, the share of attention (per
layer and head, ``A`` or ``A1 - lambda*A2``) that falls on the queried needle's tokens.
"""
from __future__ import annotations

import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from diffmm.eval.attention_capture import AttentionRecord, AttentionRecorder
from diffmm.eval.common import EvalError, markdown_table, model_device
from diffmm.eval.lm_utils import context_limit, greedy_generate

CITIES = ("Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Dublin", "Cairo", "Quito", "Vienna", "Manila", "Dakar",
          "Helsinki", "Bogota", "Tbilisi", "Accra", "Riga", "Santiago", "Kyoto", "Warsaw", "Havana", "Tunis",
          "Zagreb", "Montreal", "Jakarta", "Lagos", "Prague", "Muscat", "Perth", "Sofia", "Rabat", "Tallinn",
          "Seoul", "Athens", "Denver", "Kampala", "Bergen", "Porto", "Osaka", "Madrid", "Minsk")
NEEDLE = "The magic number of {key} is {value}."
QUESTION = "What is the magic number of {key}? The magic number of {key} is"
#: the default haystack: the reST sources of the Python 3.11 documentation (Debian ``python3.11-doc``)
PYTHON_DOCS = "/usr/share/doc/python3.11/html/_sources"


@dataclass
class NeedleConfig:
    """Settings of a multi-needle run (paper: N in 1..8, R in 1..2, 4K-64K contexts)."""

    context_length: int = 4096
    num_needles: int = 6
    num_queried: int = 2
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 10
    digits: int = 7
    max_new_tokens: int = 8
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.num_queried <= self.num_needles:
            raise EvalError(f"needle: need 1 <= R (num_queried={self.num_queried}) <= N "
                            f"(num_needles={self.num_needles})")
        if self.num_needles > len(CITIES):
            raise EvalError(f"needle: at most {len(CITIES)} needles")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise EvalError(f"needle: depths must lie in [0, 1]; got {self.depths}")


def load_haystack(paths: str | Sequence[str], max_chars: int = 2_000_000) -> list[str]:
    """Sentences of real text from files or folders (``*.txt`` files, recursively, in sorted order), read until
    ``max_chars`` characters."""
    files: list[str] = []
    for p in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(p):
            files += [os.path.join(d, n) for d, _, names in sorted(os.walk(p)) for n in sorted(names)
                      if n.endswith(".txt")]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise EvalError(f"haystack: no such file or folder: {p}")
    text: list[str] = []
    for f in files:
        if sum(map(len, text)) >= max_chars:
            break
        with open(f, encoding="utf-8", errors="replace") as fh:
            text.append(fh.read())
    return split_sentences("\n".join(text))


def split_sentences(text: str) -> list[str]:
    """Sentences (split after . ! ? and at blank lines), whitespace collapsed, empty ones dropped."""
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text)
    out = [" ".join(p.split()) for p in parts]
    out = [s for s in out if s]
    if not out:
        raise EvalError("haystack: the text has no sentences")
    return out


@dataclass
class NeedlePrompt:
    """One prompt: tokens, the queried key/value, where its needle sits (token span) and the depth it got."""

    tokens: list[int]
    key: str
    value: str
    span: tuple[int, int]
    depth: float


class NeedleBuilder:
    """Builds prompts from a haystack with a tokenizer (``encode`` / ``decode``)."""

    def __init__(self, tokenizer, sentences: Sequence[str], cfg: NeedleConfig) -> None:
        self.tok, self.sentences, self.cfg = tokenizer, list(sentences), cfg
        self._tokens: dict[int, list[int]] = {}  # sentence index -> its tokens

    def _haystack(self, budget: int, rng: random.Random) -> list[list[int]]:
        """Consecutive sentences from a random start, as many as fit ``budget`` tokens; a sentence longer than the
        whole budget is skipped, not the end of the haystack."""
        hay, used, start = [], 0, rng.randrange(len(self.sentences))
        for i in range(start, start + 4 * len(self.sentences)):
            i %= len(self.sentences)
            if i not in self._tokens:
                self._tokens[i] = self.tok.encode(" " + self.sentences[i])
            s = self._tokens[i]
            if len(s) > budget:
                continue
            if used + len(s) > budget:
                break
            hay.append(s)
            used += len(s)
        if not hay:
            raise EvalError(f"needle: no haystack sentence fits {budget} tokens; raise context_length")
        return hay

    def trial(self, depth: float, rng: random.Random) -> list[NeedlePrompt]:
        """The R prompts of one trial (same haystack and needles, one question each)."""
        cfg = self.cfg
        keys = rng.sample(CITIES, cfg.num_needles)
        values = [str(rng.randrange(10 ** (cfg.digits - 1), 10 ** cfg.digits)) for _ in keys]
        needles = [self.tok.encode(" " + NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
        questions = [self.tok.encode(" " + QUESTION.format(key=k)) for k in keys[:cfg.num_queried]]
        budget = cfg.context_length - sum(map(len, needles)) - max(map(len, questions))
        if budget < 1:
            raise EvalError(f"needle: context_length {cfg.context_length} leaves no room for a haystack")
        hay = self._haystack(budget, rng)
        bounds = np.cumsum([0] + [len(s) for s in hay])  # token offsets of the sentence boundaries
        at = int(np.argmin(np.abs(bounds - depth * bounds[-1])))  # the boundary of the queried needles
        queried = list(range(cfg.num_queried))
        rng.shuffle(queried)
        slots: dict[int, list[int]] = {at: queried}
        for j in range(cfg.num_queried, cfg.num_needles):  # the distractors, at random boundaries
            slots.setdefault(rng.randrange(len(hay) + 1), []).append(j)
        seq: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        for b in range(len(hay) + 1):
            for j in slots.get(b, []):
                spans[j] = (len(seq), len(seq) + len(needles[j]))
                seq += needles[j]
            seq += hay[b] if b < len(hay) else []
        return [NeedlePrompt(seq + questions[r], keys[r], values[r], spans[r], float(bounds[at] / bounds[-1]))
                for r in range(cfg.num_queried)]


@dataclass
class NeedleResult:
    """Accuracy per target depth (fraction of queried needles answered), plus attention shares if measured."""

    config: dict
    accuracy_by_depth: dict[float, float]
    attention_by_depth: dict[float, float] = field(default_factory=dict)
    prompts: int = 0
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return float(np.mean(list(self.accuracy_by_depth.values())))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accuracy"] = self.accuracy
        d["accuracy_by_depth"] = {str(k): v for k, v in self.accuracy_by_depth.items()}
        d["attention_by_depth"] = {str(k): v for k, v in self.attention_by_depth.items()}
        return d

    def to_markdown(self, name: str = "model") -> str:
        depths = sorted(self.accuracy_by_depth)
        rows = [[name, *[self.accuracy_by_depth[dp] for dp in depths], self.accuracy]]
        if self.attention_by_depth:
            rows.append([f"{name}: attention on needle", *[self.attention_by_depth.get(dp, float("nan"))
                                                           for dp in depths], float(np.mean(
                                                               list(self.attention_by_depth.values())))])
        c = self.config
        return (f"Multi-needle retrieval, {c['context_length']} tokens, N={c['num_needles']}, R={c['num_queried']}, "
                f"{c['trials']} trials per depth\n\n"
                + markdown_table(["", *[f"depth {100 * dp:.0f}%" for dp in depths], "mean"], rows))


@torch.no_grad()
def answer_attention(model, tokens: Sequence[int], span: tuple[int, int]) -> dict:
    """Share of attention of the last position on ``tokens[span[0]:span[1]]``.

    Per layer and head, ``share = sum(a[span]) / sum(a)`` where ``a`` is the head's attention row
    (``A``; ``A1 - lambda*A2`` for DIFF layers, whose rows sum to 1 - lambda). Returns the mean over
    all layers and heads (``answer``), ``noise = 1 - answer`` and per-layer means.
    """
    device = model_device(model)
    per_layer: list[float] = []

    def take(rec: AttentionRecord) -> None:
        row = rec.select_queries(slice(-1, None))
        a = row.maps()[0, :, 0]  # (h, S)
        share = a[:, span[0]:span[1]].sum(-1) / a.sum(-1)
        per_layer.append(float(share.mean()))

    idx = torch.tensor(list(tokens), device=device)[None]
    with AttentionRecorder(model, on_record=take):
        model(idx)
    if not per_layer:
        raise EvalError("answer_attention: the model has no attention layer the recorder knows")
    answer = float(np.mean(per_layer))
    return {"answer": answer, "noise": 1.0 - answer, "per_layer": per_layer}


def multi_needle(model, tokenizer, haystack: Sequence[str], cfg: NeedleConfig, *, measure_attention: bool = False,
                 show_progress: bool = True) -> NeedleResult:
    """Run the multi-needle test (see module doc). ``haystack``: sentences from :func:`load_haystack`."""
    limit = context_limit(model)
    if limit is not None and cfg.context_length + cfg.max_new_tokens > limit:
        raise EvalError(f"needle: context_length {cfg.context_length} + {cfg.max_new_tokens} new tokens exceeds "
                        f"the model's {limit} positions")
    builder = NeedleBuilder(tokenizer, haystack, cfg)
    rng = random.Random(cfg.seed)
    stop = (tokenizer.eos_id,) if getattr(tokenizer, "eos_id", None) is not None else ()
    acc: dict[float, float] = {}
    att: dict[float, float] = {}
    t0 = time.perf_counter()
    bar = tqdm(total=len(cfg.depths) * cfg.trials * cfg.num_queried, desc="needles", disable=not show_progress,
               unit="prompt")
    for depth in cfg.depths:
        hits, shares = [], []
        for p in (p for _ in range(cfg.trials) for p in builder.trial(depth, rng)):
            answer = greedy_generate(model, p.tokens, cfg.max_new_tokens, stop_ids=stop)
            hits.append(p.value in re.sub(r"\s+", "", tokenizer.decode(answer) if answer else ""))
            if measure_attention:
                shares.append(answer_attention(model, p.tokens, p.span)["answer"])
            bar.update(1)
        acc[depth] = float(np.mean(hits))
        if shares:
            att[depth] = float(np.mean(shares))
    bar.close()
    return NeedleResult(asdict(cfg), acc, att, len(cfg.depths) * cfg.trials * cfg.num_queried,
                        time.perf_counter() - t0)

