"""The main job, ``diffmm demo`` (``make demo``): tiny CLIP vs DiffCLIP, Transformer vs DIFF LM and the recall
comparison trained on CPU over several seeds with ``diffmm fit`` and the config files of ``configs/``, evaluated
with the functions ``diffmm eval`` calls, compared in ``report/``.

    from diffmm.demo import run_demo
    run_demo(out="report-quick", quick=True)

Modules: ``run`` (:func:`run_demo`: data, training, evaluation and plots as failure-tolerant steps),
``parts`` (what each comparison trains and measures), ``report`` (mean ± std, paired differences, report.md),
``datasets`` and ``montage`` (the demo data builders).
"""
from diffmm.demo.run import run_demo

__all__ = ["run_demo"]
