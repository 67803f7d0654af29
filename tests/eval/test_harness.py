"""diffmm LMs inside lm-evaluation-harness 0.4.x, on local jsonl tasks with known scores (no hub)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from eval_helpers import CopyLastWord, UnigramLM, WordTokenizer, lm_eval_offline

pytest.importorskip("lm_eval")


class _Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture
def tasks_dir(tmp_path, monkeypatch):
    lm_eval_offline(tmp_path, monkeypatch)
    data = tmp_path / "data"
    data.mkdir()
    mc = [{"question": f"pick {i}", "choices": ["gamma", "delta"], "answer": i % 2} for i in range(6)]
    (data / "mc.jsonl").write_text("\n".join(json.dumps(r) for r in mc) + "\n")
    (data / "ppl.jsonl").write_text("\n".join(json.dumps({"text": " ".join(["alpha", "beta", "gamma"][:1 + i % 3] * 3)})
                                              for i in range(4)) + "\n")
    gen = [{"prompt": f"say {w}", "target": w} for w in ("apple", "pear", "plum")]
    (data / "gen.jsonl").write_text("\n".join(json.dumps(r) for r in gen) + "\n")
    ydir = tmp_path / "tasks"
    ydir.mkdir()
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (ydir / "mc.yaml").write_text(
        "task: toy_mc\n" + common.format(path=data / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    (ydir / "ppl.yaml").write_text(
        "task: toy_ppl\n" + common.format(path=data / "ppl.jsonl") +
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    (ydir / "gen.yaml").write_text(
        "task: toy_gen\n" + common.format(path=data / "gen.jsonl") +
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n")
    return str(ydir)


def test_adapter_requests_directly():
    from diffmm.eval.harness import DiffmmLM

    tok = WordTokenizer(vocab_size=16)
    for w in ["a", "b", "c"]:
        tok.id(w)
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4] + [1e-9] * 12))
    lm = DiffmmLM(UnigramLM(16, logits), tok, batch_size=2)
    p = torch.softmax(logits, 0)
    ll = lm.loglikelihood([_Req("a b", " c"), _Req("", "a b"), _Req("a", " c c")])
    assert ll[0][0] == pytest.approx(math.log(p[3]), rel=1e-5) and ll[0][1]  # c (id 3) is the argmax
    assert ll[1][0] == pytest.approx(math.log(p[1]) + math.log(p[2]), rel=1e-5) and not ll[1][1]
    assert ll[2][0] == pytest.approx(2 * math.log(p[3]), rel=1e-5)
    roll = lm.loglikelihood_rolling([_Req("a b c a")])
    assert roll[0] == pytest.approx(float(torch.log(p[[1, 2, 3, 1]]).sum()), rel=1e-5)
    # rolling windows shorter than the text give the same total for a context-free model
    lm.max_length = 2
    assert lm.loglikelihood_rolling([_Req("a b c a")])[0] == pytest.approx(roll[0], rel=1e-5)
    tok2 = WordTokenizer()
    gen = DiffmmLM(CopyLastWord(tok2), tok2)
    assert gen.generate_until([_Req("say kiwi", {"until": ["\n"], "max_gen_toks": 5})]) == ["kiwi"]


def test_lm_eval_runs_local_tasks(tasks_dir):
    from diffmm.eval.harness import DiffmmLM, run_lm_eval

    tok = WordTokenizer(vocab_size=64)
    for w in ["gamma", "delta", "alpha", "beta"]:
        tok.id(w)
    logits = torch.zeros(64)
    logits[tok.ids["gamma"]] = 2.0  # context-free model preferring "gamma": right on the even questions only
    res = run_lm_eval(DiffmmLM(UnigramLM(64, logits), tok), ["toy_mc", "toy_ppl"], include_path=tasks_dir)
    assert res["results"]["toy_mc"]["acc,none"] == pytest.approx(0.5)
    # word perplexity of a context-free model = exp(-sum log p / words); 'alpha'/'beta' share prob, 'gamma' higher
    p = torch.softmax(logits, 0)
    texts = [" ".join(["alpha", "beta", "gamma"][:1 + i % 3] * 3) for i in range(4)]
    nll = sum(-float(torch.log(p[tok.ids[w]])) for t in texts for w in t.split())
    words = sum(len(t.split()) for t in texts)
    assert res["results"]["toy_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    tok2 = WordTokenizer()
    res = run_lm_eval(DiffmmLM(CopyLastWord(tok2), tok2), ["toy_gen"], include_path=tasks_dir)
    assert res["results"]["toy_gen"]["exact_match,none"] == 1.0


def test_unknown_task_is_a_clear_error(tasks_dir):
    from diffmm.eval.common import EvalError
    from diffmm.eval.harness import DiffmmLM, run_lm_eval

    tok = WordTokenizer()
    with pytest.raises(EvalError, match=r"unknown task\(s\) \['nope_task'\]"):
        run_lm_eval(DiffmmLM(UnigramLM(8), tok), ["nope_task"], include_path=tasks_dir)


def test_model_args_string_loads_an_export(tmp_path):
    """lm-eval's --model_args path: a diffmm export folder plus a tokenizer spec, via the registry name."""
    from lm_eval.api.registry import get_model

    import diffmm.eval.harness  # noqa: F401  (registers "diffmm")
    from diffmm.models.lm import DiffLM, LMConfig

    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=49408, block_size=64, n_layer=1, n_embd=32, n_head=4)).eval()
    model.save_pretrained(tmp_path / "lm")
    lm = get_model("diffmm").create_from_arg_string(f"path={tmp_path / 'lm'},tokenizer=clip,batch_size=2")
    (ll, _), = lm.loglikelihood([_Req("the cat sat on", " the mat")])
    ids = lm.tok.encode("the cat sat on") + lm.tok.encode(" the mat")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])), -1)[0]
    n = len(lm.tok.encode(" the mat"))
    expected = float(sum(logp[len(ids) - 1 - n + i, ids[len(ids) - n + i]] for i in range(n)))
    assert ll == pytest.approx(expected, rel=1e-5) and lm.max_length == 64
