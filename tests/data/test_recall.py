"""The MQAR generator: answers are the values of the queried keys, determinism by seed, the noise knob, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffmm.data.recall import (BLANK, IGNORE, RecallStream, RecallTask, eval_batches, make_recall_batch,
                                task_grid)


def _check_batch(b, task):
    B, T = b.inputs.shape
    N, Q = task.num_pairs, task.queries
    assert (B, T) == b.targets.shape and T == task.seq_len
    assert b.keys.shape == b.values.shape == (B, N) and b.query_pos.shape == b.query_pair.shape == (B, Q)
    K = task.num_keys
    for i in range(B):
        x, y = b.inputs[i].tolist(), b.targets[i].tolist()
        keys, values = b.keys[i].tolist(), b.values[i].tolist()
        # the block: k1 v1 k2 v2 ..., distinct keys from the key range, distinct values from the value range
        assert x[0:2 * N:2] == keys and x[1:2 * N:2] == values
        assert len(set(keys)) == N and len(set(values)) == N
        assert all(1 <= k <= K for k in keys) and all(K < v < task.vocab_size for v in values)
        lookup = dict(zip(keys, values))
        # targets: exactly the query positions, each the value of the key sitting there
        answered = [t for t in range(T) if y[t] != IGNORE]
        assert answered == b.query_pos[i].tolist() == sorted(answered)
        assert len(set(b.query_pair[i].tolist())) == Q
        for t, j in zip(b.query_pos[i].tolist(), b.query_pair[i].tolist()):
            assert t >= 2 * N and (t - 2 * N) % 2 == 0
            assert x[t] == keys[j] and y[t] == values[j] == lookup[x[t]]


@pytest.mark.parametrize("task", [RecallTask(vocab_size=64, seq_len=64, num_pairs=8),
                                  RecallTask(vocab_size=32, seq_len=40, num_pairs=4, num_queries=2, noise=0.0),
                                  RecallTask(vocab_size=17, seq_len=33, num_pairs=8, query_power=1.0)])
def test_answers_are_the_values_of_the_queried_keys(task):
    _check_batch(make_recall_batch(task, 16, seed=3, index=5), task)


def test_deterministic_by_seed_and_index():
    task = RecallTask(vocab_size=128, seq_len=96, num_pairs=8)
    a, b = make_recall_batch(task, 8, seed=1, index=2), make_recall_batch(task, 8, seed=1, index=2)
    for f in ("inputs", "targets", "keys", "values", "query_pos", "query_pair"):
        assert torch.equal(getattr(a, f), getattr(b, f))
    assert not torch.equal(a.inputs, make_recall_batch(task, 8, seed=1, index=3).inputs)
    assert not torch.equal(a.inputs, make_recall_batch(task, 8, seed=2, index=2).inputs)
    ev = make_recall_batch(task, 8, seed=1, index=2, split="eval")
    assert not torch.equal(a.inputs, ev.inputs)  # evaluation sets never repeat training batches
    first = list(eval_batches(task, 20, 8, seed=4))
    assert [len(x) for x in first] == [8, 8, 4]
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(first, eval_batches(task, 20, 8, seed=4)))


def test_noise_controls_the_filler():
    def filler(task):
        b = make_recall_batch(task, 64, seed=0)
        keep = torch.ones_like(b.inputs, dtype=torch.bool)
        keep[:, :task.context_len] = False
        keep[torch.arange(64)[:, None], b.query_pos] = False
        return b.inputs[keep]

    base = dict(vocab_size=64, seq_len=128, num_pairs=4)
    assert (filler(RecallTask(**base, noise=0.0)) == BLANK).all()
    f1 = filler(RecallTask(**base, noise=1.0))
    assert (f1 != BLANK).all() and ((f1 >= 1) & (f1 < 64)).all()
    f1_keys = (f1 <= RecallTask(**base).num_keys).float().mean()
    assert 0.4 < float(f1_keys) < 0.6  # random keys and values alike: false pairs in the query region
    f = filler(RecallTask(**base, noise=0.3))
    assert abs(float((f != BLANK).float().mean()) - 0.3) < 0.03


def test_query_power_puts_queries_early():
    def mean_slot(power):
        t = RecallTask(vocab_size=64, seq_len=512, num_pairs=4, query_power=power)
        b = make_recall_batch(t, 256, seed=0)
        return float(((b.query_pos - t.context_len) // 2).float().mean())

    assert mean_slot(0.01) < 0.5 * mean_slot(1.0)
    assert abs(mean_slot(1.0) - (512 - 8) / 4) < 15  # uniform over the slots


@pytest.mark.parametrize("kwargs,match", [
    (dict(vocab_size=16, num_pairs=8), "vocab_size 16"),
    (dict(seq_len=30, num_pairs=8), "seq_len 30"),
    (dict(noise=1.5), "noise"),
    (dict(num_queries=0), "num_queries"),
    (dict(query_power=0.0), "query_power"),
    (dict(seq_len=0), "seq_len must be a positive int"),
])
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecallTask(**kwargs)


def test_task_grid_leaves_out_what_does_not_fit():
    tasks, skipped = task_grid(64, [32, 64], [4, 8, 16])
    assert [t.name for t in tasks] == ["L32-N4", "L32-N8", "L64-N4", "L64-N8", "L64-N16"]
    assert skipped == ["L32-N16"]  # 16 pairs and 16 queries need 64 tokens
    with pytest.raises(ValueError, match="no setting"):
        task_grid(64, [16], [8])


def test_stream_batches_do_not_depend_on_start_rank_or_workers():
    tasks = [RecallTask(vocab_size=64, seq_len=32, num_pairs=4), RecallTask(vocab_size=64, seq_len=64, num_pairs=8)]

    def take(ds, n):
        it = iter(ds)
        return [next(it) for _ in range(n)]

    full = take(RecallStream(tasks, 4, seed=7), 6)
    assert {b[0].shape[1] for b in full} == {32, 64}  # both settings are mixed
    later = take(RecallStream(tasks, 4, seed=7, start=3), 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[3:], later))
    rank1 = take(RecallStream(tasks, 4, seed=7, rank=1, world_size=2), 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[1::2], rank1))
    loader = torch.utils.data.DataLoader(RecallStream(tasks, 4, seed=7), batch_size=None, num_workers=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, take(loader, 6)))
    sized = take(RecallStream(tasks, 4, seed=7, batch_tokens=256), 6)
    assert all(b[0].shape[0] == 256 // b[0].shape[1] for b in sized)
    with pytest.raises(ValueError, match="weights"):
        RecallStream(tasks, 4, weights=[1.0])


def test_stream_weights_pick_the_settings():
    tasks = [RecallTask(vocab_size=64, seq_len=32, num_pairs=4), RecallTask(vocab_size=64, seq_len=64, num_pairs=8)]
    ds = RecallStream(tasks, 2, seed=0, weights=[0.0, 1.0])
    assert {ds.task_of(n).seq_len for n in range(50)} == {64}
    ds = RecallStream(tasks, 2, seed=0, weights=[3.0, 1.0])
    share = np.mean([ds.task_of(n).seq_len == 32 for n in range(2000)])
    assert abs(share - 0.75) < 0.04
