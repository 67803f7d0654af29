"""diffmm LMs inside EleutherAI's lm-evaluation-harness (0.4.x).

    from diffmm.eval.harness import DiffmmLM, run_lm_eval
    lm = DiffmmLM(model, tokenizer, batch_size=8)
    results = run_lm_eval(lm, ["my_task"], include_path="tasks/")

Importing this module registers the model as ``diffmm`` in lm-eval's registry, so
``lm_eval.simple_evaluate(model="diffmm", model_args="pretrained=LM_FOLDER", ...)`` works. From the command line,
:func:`lm_eval_cli` (``diffmm eval lm-eval ARGS``) registers it and runs lm-eval's own CLI on lm-eval's own
arguments (``--model diffmm`` by default). lm-eval 0.4.13 has no plugin discovery, so its own ``lm_eval`` command
does not know ``diffmm``; diffmm also declares the ``lm_eval.models`` entry point that later lm-eval versions
discover. lm-eval is optional (``pip install 'diffmm[eval]'``).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Optional

import torch

from diffmm.eval.common import EvalError, model_device
from diffmm.eval.lm_utils import context_limit, greedy_generate, lm_logits, rolling_loglikelihood, score_continuations
from diffmm.eval.loading import lm_tokenizer, load_lm

try:  # lm-eval is optional (the diffmm 'eval' extra)
    # lm-eval's own model names first: its get_model() indexes them only while its registry is empty, so registering
    # "diffmm" before them would hide "hf" and the others from this process
    import lm_eval.models  # noqa: F401
    from lm_eval import simple_evaluate
    from lm_eval.__main__ import cli_evaluate
    from lm_eval._cli import HarnessCLI
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
except ImportError:  # the class below still imports; using it raises a clear error
    LM = None

    def register_model(*names):  # type: ignore[no-redef]
        return lambda cls: cls


log = logging.getLogger("diffmm.eval")
#: lm-eval's default number of bootstrap resamples for the stderr of metrics without a closed form
BOOTSTRAP_ITERS = 100000


def _require_lm_eval() -> None:
    if LM is None:
        raise EvalError("lm-evaluation-harness is not installed; pip install 'lm-eval>=0.4.10,<0.5' "
                        "(or the diffmm 'eval' extra)")


def parse_batch_size(batch_size: int | str) -> tuple[Optional[int], int]:
    """lm-eval's batch size as ``(size, 0)`` for a number, ``(None, 1)`` for ``auto`` and ``(None, N)`` for
    ``auto:N`` (the size is searched N times over the length-sorted requests)."""
    text = str(batch_size).strip()
    if text.isdigit() and int(text) > 0:
        return int(text), 0
    head, _, times = text.partition(":")
    if head == "auto" and (not times or times.isdigit() and int(times) > 0):
        return None, int(times or 1)
    raise ValueError(f"batch_size {batch_size!r}; expected a positive integer, auto or auto:N")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an accelerator out-of-memory error (CUDA, MPS, XPU)."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def largest_batch(fits: Callable[[int], Any], start: int) -> int:
    """The largest of ``start, start/2, ..., 1`` for which ``fits(batch)`` raises no out-of-memory error
    (lm-eval's ``batch_size=auto`` search); 1 when none fits (the run then fails on its own)."""
    batch = max(1, int(start))
    while True:
        try:
            fits(batch)
            return batch
        except Exception as e:  # only out-of-memory errors mean "smaller"; others propagate
            if not is_out_of_memory(e):
                raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if batch == 1:
            return 1
        batch //= 2


@register_model("diffmm")
class DiffmmLM(LM or object):  # type: ignore[misc]
    """An lm-eval ``LM`` backed by a diffmm LM (anything :mod:`diffmm.eval.lm_utils` can drive).

    Args:
        model: the LM (``model(idx) -> logits``), or None with ``pretrained``.
        tokenizer: ``encode`` / ``decode`` / ``eos_id`` (diffmm LM tokenizers); with ``pretrained``, a tokenizer spec
            string (``clip``, a ``tokenizer.json``) or None for the folder's own.
        pretrained: an LM ``diffmm.load_pretrained`` reads (a diffmm export or DiffLlama folder, a Lightning .ckpt;
            lm-eval's ``--model_args pretrained=...`` as for ``--model hf``); ``path`` is the older name.
        batch_size: sequences per forward when scoring, or lm-eval's ``auto`` / ``auto:N``: the largest of
            ``max_batch_size``, its halves, ..., 1 whose forward pass at the longest request's length fits in memory
            (found again N times over the length-sorted requests for ``auto:N``). On CPU no pass is tried (memory
            runs out there by swapping or the process being killed, not by an error): ``auto`` is ``max_batch_size``,
            which is also what lm-eval's own search gives on CPU.
        max_batch_size: the largest batch ``auto`` tries (lm-eval's ``--max_batch_size``; default 64 as lm-eval's).
        max_length: context limit (default: the model's ``block_size``).
        max_gen_toks: default cap of generated tokens.
        device: where the model runs (lm-eval's ``--device``; default: cuda when there is one; a CUDA device on a
            machine without one falls back to cpu with a warning, as lm-eval's hf model does).
    """

    def __init__(self, model=None, tokenizer=None, *, pretrained: Optional[str] = None, path: Optional[str] = None,
                 batch_size: int | str = 8, max_batch_size: Optional[int] = None, max_length: Optional[int] = None,
                 max_gen_toks: int = 64, device: Optional[str] = None, **unused: Any) -> None:
        _require_lm_eval()
        super().__init__()
        path = pretrained or path
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's default --device is cuda:0; as its hf model does, run where the machine can
            log.warning("DiffmmLM: device %s is not available here (lm-eval's default is cuda:0); running on cpu",
                        device)
            device = "cpu"
        if model is None:  # built from lm-eval's --model_args: pretrained=..., tokenizer=<spec string>
            if path is None:
                raise EvalError("DiffmmLM needs a model and tokenizer, or pretrained=LM_FOLDER")
            model = load_lm(str(path), device=device or "auto")
            tokenizer = lm_tokenizer(str(path), tokenizer if isinstance(tokenizer, str) else None)
        if tokenizer is None:
            raise EvalError("DiffmmLM needs a tokenizer")
        if unused:
            log.warning("DiffmmLM: ignoring model arguments %s", ", ".join(sorted(unused)))
        self.model, self.tok = model.eval(), tokenizer
        self._device = model_device(model)
        self.fixed_batch, self.auto_times = parse_batch_size(batch_size)
        self.batch_size_spec = str(batch_size)
        self.max_batch_size = int(max_batch_size or 64)
        self.batch_sizes: dict[int, int] = {}  # longest request length -> the batch size auto found for it
        self.max_length = int(max_length or context_limit(model) or 2048)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def batch_size_(self) -> int:
        """The batch size in use (the last one ``auto`` found; ``max_batch_size`` before any search)."""
        if self.fixed_batch:
            return self.fixed_batch
        return list(self.batch_sizes.values())[-1] if self.batch_sizes else self.max_batch_size

    def auto_batch_size(self, length: int) -> int:
        """lm-eval's ``auto``: the largest batch whose forward (and log-softmax) at ``length`` tokens fits."""
        length = max(1, min(int(length), self.max_length))
        if length not in self.batch_sizes:
            if self._device.type == "cpu":
                found = self.max_batch_size
            else:
                def fits(batch: int) -> None:
                    with torch.no_grad():
                        idx = torch.zeros(batch, length, dtype=torch.long, device=self._device)
                        torch.log_softmax(lm_logits(self.model, idx), dim=-1)
                found = largest_batch(fits, self.max_batch_size)
            self.batch_sizes[length] = found
            log.info("batch_size auto: %d at %d tokens on %s", found, length, self._device)
        return self.batch_sizes[length]

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
        lengths = [min(len(c) + len(x) - 1, self.max_length) for c, x in pairs]
        order = sorted(range(len(pairs)), key=lambda i: -lengths[i])  # longest first, as lm-eval sorts them
        n, times = len(order), max(1, self.auto_times)
        chunks = [order] if self.fixed_batch else [order[k * n // times:(k + 1) * n // times] for k in range(times)]
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for chunk in (c for c in chunks if c):
            batch = self.fixed_batch or self.auto_batch_size(lengths[chunk[0]])
            scores = score_continuations(self.model, [pairs[i][0] for i in chunk], [pairs[i][1] for i in chunk],
                                         max_length=self.max_length, batch_size=batch)
            for i, res in zip(chunk, scores):
                out[i] = res
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
                include_defaults: Optional[bool] = None, bootstrap_iters: int = BOOTSTRAP_ITERS) -> dict:
    """Run lm-eval tasks on ``lm``; returns lm-eval's results dict (``results`` per task with its ``*_stderr``
    entries, ``versions``, ...). ``bootstrap_iters`` is lm-eval's (resamples for the stderr of metrics without a
    closed form; 0 turns every stderr off, as lm-eval does).

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
                              fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters)
    if res is None:
        raise EvalError("lm-eval returned no results")
    config = {k: v for k, v in res.get("config", {}).items() if isinstance(v, (str, int, float, type(None)))}
    if isinstance(lm, DiffmmLM):  # simple_evaluate records these only for a model given by name
        config.update(batch_size=lm.batch_size_spec, batch_sizes=list(lm.batch_sizes.values()))
    return {"results": res["results"], "versions": res.get("versions", {}), "n-samples": res.get("n-samples", {}),
            "config": config}


def lm_eval_argv(argv: list[str]) -> list[str]:
    """lm-eval's command line for ``diffmm eval lm-eval ARGS``: ``run`` unless ``ls`` / ``validate`` is named, and
    ``--model diffmm`` unless ``--model`` is given; the rest unchanged."""
    args = list(argv)
    if not args or args[0] not in ("run", "ls", "validate"):
        args = ["run", *args]
    if args[0] == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args[1:]):
        args[1:1] = ["--model", "diffmm"]
    return args


def _with_argv(args: list[str], fn: Callable[[], Any]) -> Any:
    saved = sys.argv
    sys.argv = ["lm-eval", *args]  # lm-eval's CLI reads sys.argv
    try:
        return fn()
    finally:
        sys.argv = saved


def check_lm_eval_args(argv: list[str]) -> None:
    """Parse ``diffmm eval lm-eval ARGS`` with lm-eval's own parser without running anything (SystemExit on
    ``--help`` or bad arguments, as argparse does); without lm-eval nothing is checked (running then says what
    to install)."""
    if LM is not None:
        _with_argv(lm_eval_argv(argv), lambda: HarnessCLI().parse_args())


def lm_eval_cli(argv: list[str]) -> int:
    """``diffmm eval lm-eval ARGS``: lm-eval's own command line (``lm-eval run``'s arguments, passed unchanged) with
    ``diffmm`` registered and ``--model diffmm`` unless ``--model`` is given; ``ls`` / ``validate`` pass through
    too. Returns the exit status."""
    _require_lm_eval()
    try:
        _with_argv(lm_eval_argv(argv), cli_evaluate)
    except SystemExit as e:  # argparse's --help and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return 0
