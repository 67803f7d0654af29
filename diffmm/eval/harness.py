"""diffmm LMs inside EleutherAI's lm-evaluation-harness (0.4.x).

    from diffmm.eval.harness import DiffmmLM, run_lm_eval
    lm = DiffmmLM(model, tokenizer, batch_size=8)
    results = run_lm_eval(lm, ["my_task"], include_path="tasks/")

Importing this module also registers the model as ``diffmm`` in lm-eval's registry, so
``lm_eval.simple_evaluate(model="diffmm", model_args="path=EXPORT_DIR,tokenizer=clip", ...)`` works.
lm-eval is optional (``pip install 'diffmm[eval]'``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from diffmm.eval.common import EvalError
from diffmm.eval.lm_utils import context_limit, greedy_generate, rolling_loglikelihood, score_continuations
from diffmm.eval.loading import lm_tokenizer, load_lm

try:  # lm-eval is optional (the diffmm 'eval' extra)
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
except ImportError:  # the class below still imports; using it raises a clear error
    LM = None

    def register_model(*names):  # type: ignore[no-redef]
        return lambda cls: cls


def _require_lm_eval() -> None:
    if LM is None:
        raise EvalError("lm-evaluation-harness is not installed; pip install 'lm-eval>=0.4,<0.5' "
                        "(or the diffmm 'eval' extra)")


@register_model("diffmm")
class DiffmmLM(LM or object):  # type: ignore[misc]
    """An lm-eval ``LM`` backed by a diffmm LM (anything :mod:`diffmm.eval.lm_utils` can drive).

    Args:
        model: the LM (``model(idx) -> logits``), or None with ``path``.
        tokenizer: ``encode`` / ``decode`` / ``eos_id`` (diffmm LM tokenizers); with ``path``, a tokenizer spec
            string (``clip``, a ``tokenizer.json``) or None for the folder's own.
        path: an LM folder ``diffmm.load_pretrained`` reads (lm-eval's ``--model_args``; see
            :func:`~diffmm.eval.loading.load_lm`).
        batch_size: sequences per forward when scoring.
        max_length: context limit (default: the model's ``block_size``).
        max_gen_toks: default cap of generated tokens.
        device: where the model runs.
    """

    def __init__(self, model=None, tokenizer=None, *, path: Optional[str] = None, batch_size: int | str = 8,
                 max_length: Optional[int] = None, max_gen_toks: int = 64, device: Optional[str] = None,
                 **unused: Any) -> None:
        _require_lm_eval()
        super().__init__()
        if model is None:  # built from lm-eval's --model_args: path=..., tokenizer=<spec string>
            if path is None:
                raise EvalError("DiffmmLM needs a model and tokenizer, or path=LM_FOLDER")
            model = load_lm(path, device=device)
            tokenizer = lm_tokenizer(path, tokenizer if isinstance(tokenizer, str) else None)
        if tokenizer is None:
            raise EvalError("DiffmmLM needs a tokenizer")
        self.model, self.tok = model.eval(), tokenizer
        self.batch_size_ = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length or context_limit(model) or 2048)
        self.max_gen_toks = int(max_gen_toks)

    # ---- helpers
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, text: str) -> list[int]:
        return self.tok.encode(text) if text else []

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # trailing spaces of the context belong to the continuation (as lm-eval's HF model does)
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        ctx = self.tok_encode(context) or [self.eot_token_id]
        return ctx, self.tok_encode(continuation)

    # ---- the three request types
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), continuation is the greedy decode)`` per request."""
        pairs = [self._split(*req.args) for req in requests]
        out = score_continuations(self.model, [c for c, _ in pairs], [x for _, x in pairs],
                                  max_length=self.max_length, batch_size=self.batch_size_)
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings (the first token predicted from the end-of-text token)."""
        out = []
        for req in requests:
            (text,) = req.args[:1]
            ll = rolling_loglikelihood(self.model, self.tok_encode(text), max_length=self.max_length,
                                       first_token=self.eot_token_id)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
            out.append(ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation, cut at the first stop string (``until``) of each request."""
        out = []
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = greedy_generate(self.model, self.tok_encode(context) or [self.eot_token_id], n,
                                  stop_ids=(self.eot_token_id,), max_length=self.max_length)
            ids = [t for t in ids if t != self.eot_token_id]
            text = self.tok.decode(ids) if ids else ""
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def run_lm_eval(lm: "DiffmmLM", tasks: list[str], *, include_path: Optional[str] = None,
                num_fewshot: Optional[int] = None, limit: Optional[int | float] = None, seed: int = 0,
                include_defaults: Optional[bool] = None) -> dict:
    """Run lm-eval tasks on ``lm``; returns lm-eval's results dict (``results`` per task, ``versions``, ...).

    Local tasks (YAML files with ``dataset_path: json`` and local ``data_files``) are found through
    ``include_path``; lm-eval's own tasks are indexed too when ``include_defaults`` (default: only
    without ``include_path``; indexing them takes ~15 s). ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``
    default to 1 so that ``datasets`` does not look online.
    """
    _require_lm_eval()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if include_defaults is None:
        include_defaults = include_path is None
    tm = TaskManager(include_path=include_path, include_defaults=include_defaults)
    missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:
        where = f"under {include_path}" if include_path else "among lm-eval's tasks"
        raise EvalError(f"lm-eval: unknown task(s) {missing} {where}; local tasks need their YAML folder as "
                        f"include_path (lm-eval's own tasks: include_defaults=True)")
    with torch.no_grad():
        res = simple_evaluate(model=lm, tasks=tasks, task_manager=tm, num_fewshot=num_fewshot, limit=limit,
                              log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, bootstrap_iters=0)
    if res is None:
        raise EvalError("lm-eval returned no results")
    return {"results": res["results"], "versions": res.get("versions", {}), "n-samples": res.get("n-samples", {}),
            "config": {k: v for k, v in res.get("config", {}).items() if isinstance(v, (str, int, float, type(None)))}}
