"""Multi-query associative recall (MQAR, Zoology: Arora et al. 2023) as a seeded, generated dataset (the task, its
vocabulary, noise, query law and the two samplers: docs/evaluation.md, "Associative recall (MQAR)").

A sequence starts with ``num_pairs`` key-value pairs; ``num_queries`` of the keys come again later, and the
target at a query is its value (``IGNORE`` = -100 elsewhere, so the loss is on the answers only). Token 0 is
the blank filler; ``noise`` fills other positions with random key / value tokens. Everything is a function of
``(seed, index)``, so a batch can be rebuilt anywhere (resuming, DDP ranks, evaluation) without storing it.
``sampler="zoology"`` draws as Zoology's published ``multiquery_ar`` does (:func:`zoology_multiquery_ar`).

    >>> task = RecallTask(vocab_size=256, seq_len=128, num_pairs=8)
    >>> b = make_recall_batch(task, batch_size=4, seed=0)
    >>> b.inputs.shape, b.targets.shape         # (4, 128), (4, 128); targets -100 except at queries
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal, Optional, Sequence

import numpy as np
import torch

from diffmm.data.dist import worker_id_count

IGNORE = -100
BLANK = 0
SPLITS = ("train", "eval", "mixture", "stats")
SAMPLERS = ("diffmm", "zoology")


@dataclass(frozen=True)
class RecallTask:
    """One MQAR setting.

    Attributes:
        vocab_size: total vocabulary V (blank 0, keys ``1..K``, values ``K+1..V-1``, K = (V-1)//2; ``zoology``:
            keys ``1..V//2-1``, values ``V//2..V-1``).
        seq_len: input tokens per sequence.
        num_pairs: key-value pairs at the start of the sequence.
        num_queries: pairs queried later (distinct keys); None = all ``num_pairs`` (Zoology's MQAR).
        noise: probability that a filler position holds a random key/value token instead of the blank.
        query_power: exponent ``a`` of the query-offset law ``p(i) ~ i^(a-1)`` (0.01 as Zoology; 1 = uniform).
        sampler: ``diffmm`` (queried pairs assigned to the drawn slots at random) or ``zoology`` (Zoology's
            ``multiquery_ar``: pair j at the j-th slot drawn; every pair queried; ``noise`` 1.0 is its
            ``random_non_queries=True``, 0.0 False).
    """

    vocab_size: int = 256
    seq_len: int = 128
    num_pairs: int = 8
    num_queries: Optional[int] = None
    noise: float = 1.0
    query_power: float = 0.01
    sampler: Literal["diffmm", "zoology"] = "diffmm"

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"RecallTask: {msg}")

        for name in ("vocab_size", "seq_len", "num_pairs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{name} must be a positive int, got {v!r}")
        if self.sampler not in SAMPLERS:
            raise bad(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.sampler == "zoology" and self.num_queries not in (None, self.num_pairs):
            raise bad(f"num_queries must be None (every pair) with sampler 'zoology', got {self.num_queries!r}")
        if self.num_queries is not None and (not isinstance(self.num_queries, int) or
                                             not 1 <= self.num_queries <= self.num_pairs):
            raise bad(f"num_queries must be in 1..num_pairs ({self.num_pairs}), got {self.num_queries!r}")
        if self.num_keys < self.num_pairs or self.num_values < self.num_pairs:
            need = 2 * self.num_pairs + (2 if self.sampler == "zoology" else 1)
            raise bad(f"vocab_size {self.vocab_size} has {self.num_keys} keys and {self.num_values} values; "
                      f"num_pairs {self.num_pairs} needs at least that many of each (vocab_size >= {need})")
        if self.slots < self.queries:
            raise bad(f"seq_len {self.seq_len} leaves {self.slots} query slots after {self.num_pairs} pairs; "
                      f"{self.queries} queries need seq_len >= {2 * self.num_pairs + 2 * self.queries}")
        if not 0.0 <= float(self.noise) <= 1.0:
            raise bad(f"noise must lie in [0, 1], got {self.noise!r}")
        if not float(self.query_power) > 0:
            raise bad(f"query_power must be > 0, got {self.query_power!r}")

    # ----- derived sizes ----------------------------------------------------------------------
    @property
    def first_value(self) -> int:
        """The smallest value token (keys are ``1 .. first_value - 1``)."""
        return self.vocab_size // 2 if self.sampler == "zoology" else (self.vocab_size - 1) // 2 + 1

    @property
    def num_keys(self) -> int:
        return self.first_value - 1

    @property
    def num_values(self) -> int:
        return self.vocab_size - self.first_value

    @property
    def queries(self) -> int:
        """Queries per sequence."""
        return self.num_pairs if self.num_queries is None else self.num_queries

    @property
    def context_len(self) -> int:
        """Tokens of the key-value block at the start."""
        return 2 * self.num_pairs

    @property
    def slots(self) -> int:
        """Two-token query slots after the key-value block."""
        return (self.seq_len - self.context_len) // 2

    @property
    def name(self) -> str:
        """Short label, e.g. ``L128-N8`` (``-Q4`` when fewer queries than pairs; noise and sampler are not in the
        name)."""
        s = f"L{self.seq_len}-N{self.num_pairs}"
        if self.num_queries is not None and self.num_queries != self.num_pairs:
            s += f"-Q{self.num_queries}"
        return s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RecallBatch:
    """Generated sequences with their answers.

    Attributes:
        inputs: (B, T) token ids.
        targets: (B, T) the value at every query position, ``IGNORE`` elsewhere.
        keys, values: (B, N) the pairs in context order (pair j sits at positions 2j, 2j+1).
        query_pos: (B, Q) input positions of the queried keys (ascending).
        query_pair: (B, Q) which pair each query asks for.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    query_pos: torch.Tensor
    query_pair: torch.Tensor
    task: RecallTask

    def __len__(self) -> int:
        return self.inputs.shape[0]


def _rng(seed: int, index: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(index), int(stream), 0x5EC]))


def make_recall_batch(task: RecallTask, batch_size: int, seed: int = 0, index: int = 0, *,
                      split: str = "train") -> RecallBatch:
    """Batch number ``index`` of the stream ``seed`` for ``task``: a pure function of its arguments.

    ``split`` (``train``, ``eval`` or ``stats``) selects disjoint random streams, so evaluation sets never
    repeat a training batch of the same seed. ``task.sampler`` picks the sampling (see the module doc).
    """
    if batch_size < 1:
        raise ValueError(f"make_recall_batch: batch_size must be >= 1, got {batch_size}")
    if split not in SPLITS:
        raise ValueError(f"make_recall_batch: split must be one of {SPLITS}, got {split!r}")
    if task.sampler == "zoology":
        numpy_seq, torch_seq = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(index), SPLITS.index(split),
                                                       0x200]).spawn(2)
        gen = torch.Generator().manual_seed(int(torch_seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
        return _zoology_batch(task, batch_size, np.random.RandomState(np.random.MT19937(numpy_seq)), gen)
    rng = _rng(seed, index, SPLITS.index(split))
    B, N, Q, T = batch_size, task.num_pairs, task.queries, task.seq_len
    K = task.num_keys
    keys = 1 + np.argsort(rng.random((B, K)), axis=1)[:, :N]                     # (B, N) distinct keys
    values = 1 + K + np.argsort(rng.random((B, task.num_values)), axis=1)[:, :N]  # (B, N) distinct values
    x = np.full((B, T), BLANK, dtype=np.int64)
    x[:, 0:2 * N:2], x[:, 1:2 * N:2] = keys, values
    # filler: random key/value tokens with probability `noise`, on every position after the pairs
    filler = rng.integers(1, task.vocab_size, size=(B, T - 2 * N))
    use = rng.random((B, T - 2 * N)) < task.noise
    x[:, 2 * N:] = np.where(use, filler, BLANK)
    # queries: Q distinct pairs, at Q distinct slots drawn by the power law without replacement (Gumbel top-k)
    pair = np.argsort(rng.random((B, N)), axis=1)[:, :Q]                          # (B, Q)
    i = np.arange(1, task.slots + 1, dtype=np.float64)
    log_w = np.log(task.query_power * i ** (task.query_power - 1.0))
    gumbel = log_w[None, :] - np.log(-np.log(rng.random((B, task.slots))))
    slot = np.argsort(-gumbel, axis=1, kind="stable")[:, :Q]
    order = np.argsort(slot, axis=1)
    slot, pair = np.take_along_axis(slot, order, 1), np.take_along_axis(pair, order, 1)
    pos = 2 * N + 2 * slot                                                         # (B, Q)
    rows = np.arange(B)[:, None]
    x[rows, pos] = keys[rows, pair]
    y = np.full((B, T), IGNORE, dtype=np.int64)
    y[rows, pos] = values[rows, pair]
    t = torch.from_numpy
    return RecallBatch(t(x), t(y), t(keys), t(values), t(pos), t(pair), task)


def zoology_gap_law(slots: int, power_a: float) -> np.ndarray:
    """Zoology's query-slot probabilities: ``p(i) ~ a * i^(a-1)`` over slots ``i = 1 .. slots``, normalised. (slots,)"""
    w = power_a * np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1.0)
    return w / w.sum()


def _zoology_batch(task: RecallTask, batch_size: int, rs: np.random.RandomState,
                   gen: torch.Generator) -> RecallBatch:
    """Zoology's ``multiquery_ar`` sampling, in the order it consumes its random streams: per sequence the keys, then
    per sequence the values, then per sequence the query slots (numpy's legacy ``choice`` without replacement, the
    slots weighted by :func:`zoology_gap_law`, pair ``j`` going to the ``j``-th slot drawn); the filler from torch."""
    B, N, T, V = batch_size, task.num_pairs, task.seq_len, task.vocab_size
    key_pool, value_pool = np.arange(1, task.first_value), np.arange(task.first_value, V)
    keys = np.stack([rs.choice(key_pool, size=N, replace=False) for _ in range(B)])      # (B, N)
    values = np.stack([rs.choice(value_pool, size=N, replace=False) for _ in range(B)])  # (B, N)
    law = zoology_gap_law(task.slots, task.query_power)
    slot_of_pair = np.stack([rs.choice(task.slots, size=N, replace=False, p=law) for _ in range(B)])  # (B, N)
    x = np.full((B, T), BLANK, dtype=np.int64)
    x[:, 0:2 * N:2], x[:, 1:2 * N:2] = keys, values
    rows = np.arange(B)[:, None]
    x[rows, 2 * N + 2 * slot_of_pair] = keys
    y = np.full((B, T), IGNORE, dtype=np.int64)
    y[rows, 2 * N + 2 * slot_of_pair] = values
    inputs = torch.from_numpy(x)
    # every blank position becomes a token drawn uniformly from the whole vocabulary (Zoology draws a full (B, T)
    # grid and keeps it where the input is 0); noise below 1 keeps each with probability `noise` only
    filler = torch.randint(V, (B, T), generator=gen)
    blank = inputs == BLANK
    if task.noise < 1.0:
        blank &= torch.rand((B, T), generator=gen) < task.noise
    inputs[blank] = filler[blank]
    pair = np.argsort(slot_of_pair, axis=1)                                           # (B, N): pairs by slot
    pos = 2 * N + 2 * np.take_along_axis(slot_of_pair, pair, 1)                       # (B, N) ascending
    t = torch.from_numpy
    return RecallBatch(inputs, t(y), t(keys), t(values), t(pos), t(pair), task)


def zoology_multiquery_ar(vocab_size: int, num_examples: int, input_seq_len: int, seed: int, power_a: float = 0.01,
                          num_kv_pairs: int = 8, random_non_queries: bool = True,
                          torch_seed: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` (num_examples, input_seq_len) as Zoology's ``multiquery_ar`` draws them for these arguments.

    Zoology seeds numpy's global legacy generator with ``seed`` and takes the filler from torch's global one;
    here both are local (``np.random.RandomState(seed)``, a ``torch.Generator`` seeded with ``torch_seed``,
    default ``seed``), so the result equals Zoology's call made right after ``torch.manual_seed(torch_seed)``.
    Zoology's own checks (even length, ``vocab_size > input_seq_len``) are not repeated; ``num_passes`` > 1
    (its repeated key-value block) is not offered.
    """
    task = RecallTask(vocab_size=vocab_size, seq_len=input_seq_len, num_pairs=num_kv_pairs,
                      noise=1.0 if random_non_queries else 0.0, query_power=power_a, sampler="zoology")
    gen = torch.Generator().manual_seed(seed if torch_seed is None else torch_seed)
    b = _zoology_batch(task, num_examples, np.random.RandomState(seed), gen)
    return b.inputs, b.targets


def query_order_stats(task: RecallTask, examples: int = 4096, seed: int = 0) -> dict[str, float]:
    """What the order of the queries alone gives away, measured on ``examples`` sequences (their own stream).

    Returns:
        ``first_asks_first_pair``: the share of sequences whose first query asks for pair 0 (1/N when uniform);
        ``rank_chance``: the accuracy of answering the ``q``-th query with the pair most often asked at rank
        ``q`` (counted on half the sequences, scored on the other half), the score of a model that uses the
        order and not the keys (1/N when uniform); ``uniform_chance``: 1/N.
    """
    if examples < 2:
        raise ValueError(f"query_order_stats: examples must be >= 2, got {examples}")
    pair = make_recall_batch(task, examples, seed=seed, split="stats").query_pair.numpy()  # (E, Q)
    fit, score = pair[:examples // 2], pair[examples // 2:]
    favourite = np.array([np.bincount(fit[:, q], minlength=task.num_pairs).argmax() for q in range(task.queries)])
    return {"first_asks_first_pair": float((pair[:, 0] == 0).mean()),
            "rank_chance": float((score == favourite[None]).mean()), "uniform_chance": 1.0 / task.num_pairs}


def eval_batches(task: RecallTask, examples: int, batch_size: int, seed: int) -> Iterator[RecallBatch]:
    """``examples`` sequences of ``task`` in batches (the last one smaller): a fixed evaluation set per seed."""
    for index, start in enumerate(range(0, examples, batch_size)):
        yield make_recall_batch(task, min(batch_size, examples - start), seed=seed, index=index, split="eval")


def task_grid(vocab_size: int, seq_lens: Iterable[int], num_pairs: Iterable[int], *, noise: float = 1.0,
              num_queries: Optional[int] = None, query_power: float = 0.01,
              sampler: str = "diffmm") -> tuple[list[RecallTask], list[str]]:
    """Every ``(seq_len, pairs)`` setting that fits, and the labels of those left out (e.g. ``L64-N32``).

    ``num_queries`` is capped at each setting's pairs. Raises ValueError (with the reason) when none fits or
    ``sampler`` is unknown.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if sampler == "zoology" and num_queries is not None:
        raise ValueError(f"num_queries {num_queries}: sampler 'zoology' queries every pair; leave num_queries unset")
    tasks, skipped, why = [], [], ""
    for L in seq_lens:
        for n in num_pairs:
            try:
                tasks.append(RecallTask(vocab_size=vocab_size, seq_len=int(L), num_pairs=int(n), noise=noise,
                                        num_queries=None if num_queries is None else min(int(num_queries), int(n)),
                                        query_power=query_power, sampler=sampler))
            except ValueError as e:
                skipped.append(f"L{L}-N{n}")
                why = str(e)
    if not tasks:
        raise ValueError(f"no setting of seq_len {list(seq_lens)} x pairs {list(num_pairs)} fits: {why or 'empty'}")
    return tasks, skipped


class RecallStream(torch.utils.data.IterableDataset):
    """Endless training batches ``(inputs, targets)`` from a mixture of :class:`RecallTask` s.

    Batch ``n`` (counted over the whole run) uses task ``tasks[c]`` with ``c`` drawn from ``weights``
    by ``(seed, n)``, and its sequences are ``make_recall_batch(task, batch_size, seed', n)``; so
    batch ``n`` is the same whatever the worker, rank split or restart. Under DDP rank ``r`` of ``W``
    takes batches ``n*W + r``. ``start`` skips the first batches of this rank (resuming).

    Args:
        tasks: the settings mixed; every batch comes from one of them (one sequence length per batch).
        batch_size: sequences per batch.
        seed: stream seed.
        weights: mixture weights (default uniform).
        rank, world_size: DDP position.
        start: batches of this rank already consumed.
        batch_tokens: when set, a batch of a setting holds ``max(1, batch_tokens // seq_len)`` sequences
            instead of ``batch_size`` (about the same cost per step for short and long settings).
    """

    def __init__(self, tasks: Sequence[RecallTask], batch_size: int, seed: int = 0,
                 weights: Optional[Sequence[float]] = None, rank: int = 0, world_size: int = 1, start: int = 0,
                 batch_tokens: Optional[int] = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"RecallStream: batch_size must be >= 1, got {batch_size}")
        if batch_tokens is not None and batch_tokens < 1:
            raise ValueError(f"RecallStream: batch_tokens must be >= 1, got {batch_tokens}")
        self.tasks, self.batch_size, self.seed = list(tasks), int(batch_size), int(seed)
        self.batch_tokens = None if batch_tokens is None else int(batch_tokens)
        if not self.tasks:
            raise ValueError("RecallStream: give at least one task")
        w = np.ones(len(tasks)) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (len(tasks),) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"RecallStream: weights {list(weights or [])} must be {len(tasks)} non-negative numbers, "
                             f"not all 0")
        self.weights = w / w.sum()
        self.rank, self.world_size, self.start = int(rank), int(world_size), int(start)

    def task_of(self, n: int) -> RecallTask:
        """The task of global batch ``n``."""
        u = _rng(self.seed, n, SPLITS.index("mixture")).random()
        return self.tasks[min(int(np.searchsorted(np.cumsum(self.weights), u, side="right")), len(self.tasks) - 1)]

    def rows(self, task: RecallTask) -> int:
        """Sequences per batch of ``task``."""
        return self.batch_size if self.batch_tokens is None else max(1, self.batch_tokens // task.seq_len)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch ``n``."""
        task = self.task_of(n)
        b = make_recall_batch(task, self.rows(task), seed=self.seed, index=n)
        return b.inputs, b.targets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        wid, nw = worker_id_count()
        k = self.start + wid
        while True:
            yield self.batch(k * self.world_size + self.rank)
            k += nw
