"""Your own pipeline stages: webdataset filters (``wds.map``, ``wds.select``, ``wds.decode``, ...) on each raw sample.

A stage is what a webdataset pipeline is built from: a callable that takes an iterator of samples
and returns an iterator of samples, such as ``wds.map(f)``, ``wds.select(pred)``, ``wds.decode("pil")``,
``wds.rename(...)``, ``wds.map_dict(...)`` or a generator function of your own. The datasets run their
``stages`` on every sample the tar reader yields (a dict of webdataset's shape: ``__key__``,
``__url__``, ``__local_path__`` for a local shard, and one entry per file extension holding the
member's bytes), after the shuffle buffer and before their own decoding. Each sample goes through
the stages on its own, so that every problem stays a counted skip of one sample:

* a stage that yields nothing for a sample drops it (``wds.select``, or a stage whose own
  ``handler`` skipped an error): counted as ``skip_filtered``;
* a stage that raises: ``handler(exception)`` decides, as in webdataset. ``wds.reraise_exception``
  (the default) raises; a handler that returns True (``wds.warn_and_continue``,
  ``wds.ignore_and_continue``) skips the sample, counted as ``skip_stage_error``; one that returns
  False (``wds.warn_and_stop``) raises too, because one DataLoader worker that stops early would
  leave the ranks with different numbers of batches.

A stage must turn one sample into at most one sample, still a dict (the batch quotas that make
epochs exact count one item per sample): whole-stream stages such as ``wds.shuffle``,
``wds.batched`` or ``wds.to_tuple`` have no place here; the dataset shuffles, decodes and batches.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from diffmm.data.stats import DataStats

#: a webdataset pipeline stage: samples in, samples out
Stage = Callable[[Iterator[dict]], Iterable[Any]]
#: a webdataset exception handler: True to skip the sample, False to stop, or raise
Handler = Callable[[BaseException], bool]


def run_stages(sample: dict, stages: Sequence[Stage], handler: Handler, stats: DataStats) -> Optional[dict]:
    """Run ``stages`` on one raw sample; returns the sample they yield, or ``None`` after counting a skip.

    Raises:
        RuntimeError: a stage raised and ``handler`` returned False (stop).
        ValueError: the stages turned the sample into several samples or into something that is not a dict.
    """
    where = f"{sample['__url__']}:{sample['__key__']}"
    try:
        out: Iterable[Any] = iter((sample,))
        for stage in stages:
            out = stage(out)
        results = list(itertools.islice(out, 2))
    except Exception as exn:
        if handler(exn):
            stats.skip("stage_error", where, f"{type(exn).__name__}: {exn}")
            return None
        raise RuntimeError(f"{stats.name}: a pipeline stage failed on {where} and the handler said stop; "
                           "stopping one worker would leave the ranks with unequal batch counts") from exn
    if not results:
        stats.skip("filtered", where)
        return None
    if len(results) > 1 or not isinstance(results[0], dict):
        raise ValueError(f"{stats.name}: pipeline stages must turn each sample into one sample dict; {where} became "
                         f"{'several samples' if len(results) > 1 else type(results[0]).__name__}")
    return results[0]
