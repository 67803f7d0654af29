"""What the language evaluations need from an LM: logits, per-token log-probs, scoring and greedy decoding.

An LM is any module with ``model(idx (B, T)) -> logits (B, T, V)`` (a tensor, a tuple starting
with logits, or an object with ``.logits``), like :class:`diffmm.DiffLM`. A tokenizer has
``encode(str) -> list[int]``, ``decode(list[int]) -> str`` and ``eos_id``.
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from diffmm.eval.common import model_device


def lm_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) in fp32."""
    out = model(idx)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "logits"):
        out = out.logits
    return out.float()


def context_limit(model) -> Optional[int]:
    """The longest sequence the model takes (``config.block_size`` and common aliases), or None."""
    for obj in (getattr(model, "config", None), model):
        for attr in ("block_size", "max_position_embeddings", "n_positions", "max_seq_len", "context_length"):
            v = getattr(obj, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


@torch.no_grad()
def score_continuations(model, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *,
                        max_length: Optional[int] = None, batch_size: int = 8) -> list[tuple[float, bool]]:
    """Sum of log p(continuation | context) and whether greedy decoding would produce the continuation.

    Context tokens are cut from the left so that context + continuation fits ``max_length``
    (default :func:`context_limit`). The continuation must be non-empty; an empty context is
    not allowed either (prepend a start/eos token first).
    """
    device = model_device(model)
    max_length = max_length or context_limit(model)
    items = []
    for ctx, cont in zip(contexts, continuations):
        if not cont:
            raise ValueError("score_continuations: empty continuation")
        if not ctx:
            raise ValueError("score_continuations: empty context; prepend a start token")
        seq = list(ctx) + list(cont)
        if max_length is not None:
            seq = seq[-(max_length + 1):]
        if len(seq) <= len(cont):
            raise ValueError(f"continuation of {len(cont)} tokens does not fit max_length {max_length}")
        items.append((seq, len(cont)))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(items)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # long first: padding stays small
    for start in range(0, len(order), batch_size):
        idxs = order[start:start + batch_size]
        T = max(len(items[i][0]) - 1 for i in idxs)
        inp = torch.zeros(len(idxs), T, dtype=torch.long)
        for row, i in enumerate(idxs):
            seq = items[i][0][:-1]
            inp[row, :len(seq)] = torch.tensor(seq)  # right padding: causal models ignore what follows
        logp = F.log_softmax(lm_logits(model, inp.to(device)), dim=-1).cpu()
        for row, i in enumerate(idxs):
            seq, n = items[i]
            L = len(seq) - 1
            target = torch.tensor(seq[-n:])
            lp = logp[row, L - n:L]  # (n, V): predictions of the continuation tokens
            results[i] = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
    return results


@torch.no_grad()
def rolling_loglikelihood(model, tokens: Sequence[int], *, max_length: Optional[int] = None,
                          first_token: Optional[int] = None) -> float:
    """Log-likelihood of a whole token sequence with disjoint windows of ``max_length`` predictions.

    The first token is predicted from ``first_token`` (e.g. eos) when given, else it is not scored.
    Each window after the first sees as much earlier text as fits (up to ``max_length`` tokens).
    """
    max_length = max_length or context_limit(model) or 1024
    seq = ([first_token] if first_token is not None else []) + list(tokens)
    contexts, continuations = [], []
    for pos in range(1, len(seq), max_length):  # pos: index in seq of the first token the window scores
        end = min(pos + max_length, len(seq))
        contexts.append(seq[max(0, end - 1 - max_length):pos])  # the window input seq[start:end-1] has <= max_length
        continuations.append(seq[pos:end])
    return float(sum(s for s, _ in score_continuations(model, contexts, continuations, max_length=max_length)))


@torch.no_grad()
def greedy_generate(model, prompt: Sequence[int], max_new_tokens: int, *, stop_ids: Sequence[int] = (),
                    max_length: Optional[int] = None) -> list[int]:
    """Greedy continuation of ``prompt`` (new tokens only), stopping after any of ``stop_ids``.

    Uses the model's own ``generate(..., greedy=True)`` (KV cache) when it has one, else full forwards.
    The prompt is cut from the left so that prompt + new tokens fit ``max_length``.
    """
    device = model_device(model)
    max_length = max_length or context_limit(model)
    prompt = list(prompt)
    if max_length is not None:
        max_new_tokens = min(max_new_tokens, max_length - 1)
        prompt = prompt[-(max_length - max_new_tokens):]
    if max_new_tokens <= 0:
        return []
    idx = torch.tensor(prompt, device=device)[None]
    if "greedy" in inspect.signature(getattr(model, "generate", lambda: None)).parameters:
        out = model.generate(idx, max_new_tokens, greedy=True)[0, len(prompt):].tolist()
    else:
        out = []
        for _ in range(max_new_tokens):
            nxt = int(lm_logits(model, idx)[0, -1].argmax())
            out.append(nxt)
            if nxt in stop_ids:
                break
            idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[:i + 1]
    return out
