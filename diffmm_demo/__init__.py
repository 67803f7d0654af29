"""The diffmm demo, an application of the library (as timm's ``train.py`` is of timm), kept beside the package and
not shipped in its wheel: tiny models with standard and differential attention (LiT on MiniLM and DINOv2 by
default; from-scratch CLIP, decoder LMs and associative recall on request) trained on CPU over several seeds with
``diffmm fit`` and the config files of ``configs/``, evaluated with the functions ``diffmm eval`` calls, compared in
``report/``. ``make demo`` / ``make demo-quick`` run it from the repository root; ``python -m diffmm_demo --help``
lists its commands.

    from diffmm_demo import run_demo
    run_demo(out="report-quick", quick=True)

Modules: ``run`` (:func:`run_demo`: data, training, evaluation and plots as failure-tolerant steps), ``parts``
(what each comparison trains and measures), ``evals`` (its evaluations), ``report`` (mean ± std, paired differences,
report.md), ``datasets``, ``imageset`` and ``montage`` (the demo data builders and pictures), ``system_data`` (the
Debian and npm files they read), ``__main__`` (the command line).
"""
from diffmm_demo.run import run_demo

__all__ = ["run_demo"]
