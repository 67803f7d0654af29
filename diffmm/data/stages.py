"""Your own pipeline stages: webdataset filters (``wds.map``, ``wds.select``, ``wds.decode``, ...) on each raw sample
(what a stage sees and how its drops and errors are counted: docs/data.md, "Your own webdataset stages").

The datasets run their ``stages`` on every sample the tar reader yields (webdataset's dict: ``__key__``,
``__url__``, one entry per file extension), after the shuffle buffer and before their own decoding, one sample at
a time, so every problem stays a counted skip of one sample: a dropped sample is ``skip_filtered``; an exception
goes to ``handler`` as in webdataset (continue: ``skip_stage_error``; stop: raises, since a worker stopping early
would leave the ranks with unequal batch counts). A stage turns one sample into at most one sample dict
(``wds.shuffle``, ``wds.batched``, ``wds.to_tuple`` are the dataset's own job).
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
