"""The MQAR generator: answers are the values of the queried keys, determinism by seed, the noise knob, errors; the
Zoology sampler: layout and vocabulary, the published draw order bit for bit, the power law, the query-order bias."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffmm.data.recall import (BLANK, IGNORE, RecallStream, RecallTask, eval_batches, make_recall_batch,
                                query_order_stats, task_grid, zoology_multiquery_ar)


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
        assert all(1 <= k <= K for k in keys) and all(task.first_value <= v < task.vocab_size for v in values)
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


# ----- Zoology's multiquery_ar sampling (sampler="zoology") ------------------------------------------------------
def zoology_law(slots, a):
    """Zoology's documented query-gap law p(i) ~ a * i^(a-1), i = 1..slots (written here from its docstring)."""
    w = np.array([a * i ** (a - 1) for i in range(1, slots + 1)])
    return w / w.sum()


def zoology_reference(vocab, examples, seq_len, seed, power_a, pairs, torch_seed):
    """The published draw order, through numpy's and torch's global generators as Zoology uses them: keys of every
    sequence, then values, then the query gaps (weighted, without replacement; key j at the j-th gap), then a
    full grid of random tokens kept on the zero positions."""
    np.random.seed(seed)
    half, ctx = vocab // 2, 2 * pairs
    keys = np.array([np.random.choice(np.arange(1, half), pairs, replace=False) for _ in range(examples)])
    vals = np.array([np.random.choice(np.arange(half, vocab), pairs, replace=False) for _ in range(examples)])
    space = (seq_len - ctx) // 2
    gaps = np.array([np.random.choice(space, pairs, replace=False, p=zoology_law(space, power_a))
                     for _ in range(examples)])
    x = np.zeros((examples, seq_len), dtype=np.int64)
    y = np.full((examples, seq_len), -100, dtype=np.int64)
    x[:, 0:ctx:2], x[:, 1:ctx:2] = keys, vals
    for i in range(examples):
        x[i, ctx + 2 * gaps[i]] = keys[i]
        y[i, ctx + 2 * gaps[i]] = vals[i]
    x = torch.tensor(x)
    torch.manual_seed(torch_seed)
    noise = torch.randint(vocab, size=x.shape)
    x[x == 0] = noise[x == 0]
    return x, torch.tensor(y)


@pytest.mark.parametrize("task", [RecallTask(vocab_size=64, seq_len=16, num_pairs=4, sampler="zoology"),
                                  RecallTask(vocab_size=17, seq_len=40, num_pairs=4, noise=0.0, sampler="zoology"),
                                  RecallTask(vocab_size=256, seq_len=128, num_pairs=8, query_power=1.0,
                                             sampler="zoology")])
def test_zoology_layout_labels_and_vocabulary(task):
    b = make_recall_batch(task, 32, seed=1, index=4)
    V = task.vocab_size
    assert task.queries == task.num_pairs and task.first_value == V // 2  # every pair asked; Zoology's split
    assert ((b.keys >= 1) & (b.keys < V // 2)).all() and ((b.values >= V // 2) & (b.values < V)).all()
    _check_batch(b, task)
    assert sorted(b.query_pair[0].tolist()) == list(range(task.num_pairs))


def test_zoology_matches_the_published_draw_order_bit_for_bit():
    for vocab, length, pairs, a, seed in [(64, 16, 4, 0.01, 0), (8192, 128, 8, 0.01, 3), (100, 64, 16, 0.5, 7)]:
        x, y = zoology_multiquery_ar(vocab, 50, length, seed, power_a=a, num_kv_pairs=pairs, torch_seed=11)
        rx, ry = zoology_reference(vocab, 50, length, seed, a, pairs, torch_seed=11)
        torch.testing.assert_close(x, rx, rtol=0, atol=0)
        torch.testing.assert_close(y, ry, rtol=0, atol=0)
    x0, _ = zoology_multiquery_ar(64, 20, 32, 0, num_kv_pairs=4, random_non_queries=False)
    for row in x0:  # without random fillers: after the pairs, only the four keys again, and blanks
        assert sorted(row[8:][row[8:] != BLANK].tolist()) == sorted(row[0:8:2].tolist())


def test_zoology_deterministic_by_seed_index_and_split():
    task = RecallTask(vocab_size=64, seq_len=64, num_pairs=8, noise=0.25, sampler="zoology")
    a, b = make_recall_batch(task, 8, seed=1, index=2), make_recall_batch(task, 8, seed=1, index=2)
    for f in ("inputs", "targets", "keys", "values", "query_pos", "query_pair"):
        assert torch.equal(getattr(a, f), getattr(b, f))
    for other in (make_recall_batch(task, 8, seed=1, index=3), make_recall_batch(task, 8, seed=2, index=2),
                  make_recall_batch(task, 8, seed=1, index=2, split="eval")):
        assert not torch.equal(a.inputs, other.inputs)
    ours = make_recall_batch(RecallTask(vocab_size=64, seq_len=64, num_pairs=8, noise=0.25), 8, seed=1, index=2)
    assert not torch.equal(a.inputs, ours.inputs)


def test_zoology_query_slots_follow_the_power_law_in_draw_order():
    task = RecallTask(vocab_size=64, seq_len=64, num_pairs=4, sampler="zoology")
    b = make_recall_batch(task, 6000, seed=0)
    first_slot = (b.query_pos[b.query_pair == 0] - task.context_len) // 2  # pair 0 sits at the first slot drawn
    freq = np.bincount(first_slot.numpy(), minlength=task.slots) / 6000
    np.testing.assert_allclose(freq, zoology_law(task.slots, 0.01), atol=0.02)


def test_query_order_bias_zoology_vs_ours():
    p0 = zoology_law(4, 0.01)[0]  # 4 pairs in 16 tokens fill the 4 slots: pair 0 is asked first iff drawn at slot 1
    zoo = query_order_stats(RecallTask(vocab_size=64, seq_len=16, num_pairs=4, sampler="zoology"), 8000, seed=0)
    ours = query_order_stats(RecallTask(vocab_size=64, seq_len=16, num_pairs=4), 8000, seed=0)
    assert abs(p0 - 0.478) < 0.001
    assert abs(zoo["first_asks_first_pair"] - p0) < 0.017 and abs(ours["first_asks_first_pair"] - 0.25) < 0.015
    assert zoo["rank_chance"] > 0.35 and abs(ours["rank_chance"] - 0.25) < 0.02  # the order gives answers away
    assert zoo["uniform_chance"] == ours["uniform_chance"] == 0.25


def test_zoology_filler_is_the_whole_vocabulary():
    task = RecallTask(vocab_size=16, seq_len=256, num_pairs=4, noise=1.0, sampler="zoology")
    b = make_recall_batch(task, 64, seed=0)
    keep = torch.ones_like(b.inputs, dtype=torch.bool)
    keep[:, :task.context_len] = False
    keep[torch.arange(64)[:, None], b.query_pos] = False
    counts = torch.bincount(b.inputs[keep], minlength=16).double() / keep.sum()
    assert counts.min() > 0.04 and counts.max() < 0.09  # uniform over 0..15, the blank included
    half = make_recall_batch(RecallTask(vocab_size=16, seq_len=256, num_pairs=4, noise=0.5, sampler="zoology"), 64)
    blank_share = float((half.inputs[keep] == BLANK).double().mean())
    assert abs(blank_share - (0.5 + 0.5 / 16)) < 0.02  # kept blank, or replaced by a drawn 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampler="zoo"), "sampler must be one of"),
    (dict(num_pairs=4, num_queries=2, sampler="zoology"), "num_queries must be None"),
    (dict(vocab_size=17, num_pairs=8, sampler="zoology"), "vocab_size >= 18"),
])
def test_zoology_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecallTask(**kwargs)


def test_task_grid_passes_the_sampler():
    tasks, _ = task_grid(64, [16, 32], [2, 4], sampler="zoology", noise=0.25)
    assert {t.sampler for t in tasks} == {"zoology"} and len(tasks) == 4
    with pytest.raises(ValueError, match="sampler 'zoology' queries every pair"):
        task_grid(64, [16], [4], sampler="zoology", num_queries=2)
    with pytest.raises(ValueError, match="sampler must be one of"):
        task_grid(64, [16], [4], sampler="uniform")


def test_samplers_draw_the_same_query_slots_and_differ_in_the_order():
    def slot_stats(sampler):
        task = RecallTask(vocab_size=64, seq_len=64, num_pairs=4, sampler=sampler)
        b = make_recall_batch(task, 6000, seed=0)
        slots = ((b.query_pos - task.context_len) // 2).numpy()  # (B, 4) ascending
        occupied = np.bincount(slots.ravel(), minlength=task.slots) / 6000
        return occupied, float((b.query_pair[:, 0] == 0).float().mean())

    (occ_ours, first_ours), (occ_zoo, first_zoo) = slot_stats("diffmm"), slot_stats("zoology")
    np.testing.assert_allclose(occ_ours, occ_zoo, atol=0.025)  # the same law, without replacement, for the slot set
    assert abs(first_ours - 0.25) < 0.02 and first_zoo > 0.3  # which pair sits where: the one difference
