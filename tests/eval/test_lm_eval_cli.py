"""lm-eval's own CLI on a DIFF LM exported as DiffLlama: ``--model hf`` (transformers' DiffLlamaForCausalLM and
AutoTokenizer on the folder as is) and ``diffmm eval lm-eval`` (``--model diffmm``) agree on a local task."""
from __future__ import annotations

import glob
import json
import re
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
from eval_helpers import lm_eval_offline

from diffmm.cli import main as diffmm_main
from diffmm.cli import parse
from diffmm.data.tokenizers import ClipBPE
from diffmm.hub.difflama import save_difflama
from diffmm.models.lm import DiffLM, LMConfig

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's --model hf imports it
transformers = pytest.importorskip("transformers")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.__main__ import cli_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from diffmm.eval.harness import DiffmmLM, largest_batch, lm_eval_argv, lm_eval_cli, parse_batch_size  # noqa: E402

#: a multiple-choice task written for this test: (question, choices, answer index)
QUESTIONS = [("The capital of France is", ["Paris", "London", "Rome"], 0),
             ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
             ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus"], 1),
             ("A baby cat is called a", ["puppy", "calf", "kitten"], 2),
             ("The opposite of hot is", ["cold", "warm", "loud"], 0),
             ("Bees make", ["milk", "honey", "silk"], 1),
             ("It's raining, so take an", ["umbrella", "anchor", "oven"], 0),
             ("Seven plus five equals", ["twelve", "eleven", "thirteen"], 0)]


@pytest.fixture
def local_task(tmp_path, monkeypatch):
    lm_eval_offline(tmp_path, monkeypatch)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in QUESTIONS]
    (tasks / "qa.jsonl").write_text("\n".join(rows) + "\n")
    (tasks / "qa.yaml").write_text(
        f"task: diffmm_toy_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'qa.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return str(tasks)


def _difflama_export(folder: Path) -> DiffLM:
    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=49408, block_size=128, n_layer=2, n_embd=64, n_head=4, init_std=0.1)).eval()
    save_difflama(model, folder, tokenizer=ClipBPE())
    return model


def _lm_eval_output(out: Path) -> tuple[dict, list[dict]]:
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    (samples,) = glob.glob(str(out / "**" / "samples_diffmm_toy_qa_*.jsonl"), recursive=True)
    return json.loads(Path(results).read_text()), [json.loads(line) for line in open(samples)]


def _loglikelihoods(samples: list[dict]) -> torch.Tensor:
    """(docs, choices) log-likelihoods of lm-eval's logged samples, in document order."""
    by_doc = {s["doc_id"]: s for s in samples}
    return torch.tensor([[float(r[0]) for r in by_doc[i]["filtered_resps"]] for i in range(len(QUESTIONS))])


def test_hf_and_diffmm_models_agree_through_lm_eval(tmp_path, local_task):
    """lm-eval's Python entry with both models named as on its command line (its registry builds them from the
    model_args string); only lm-eval's own task index is skipped (~15 s per run)."""
    folder = tmp_path / "difflama"
    _difflama_export(folder)
    runs = {}
    for name in ("hf", "diffmm"):
        runs[name] = simple_evaluate(model=name, model_args=f"pretrained={folder}", tasks=["diffmm_toy_qa"],
                                     task_manager=TaskManager(include_path=local_task, include_defaults=False),
                                     device="cpu", batch_size=4, log_samples=True)
    hf_m, dm_m = (runs[n]["results"]["diffmm_toy_qa"] for n in ("hf", "diffmm"))
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none"):
        assert dm_m[metric] == hf_m[metric], metric
    ours, theirs = (_loglikelihoods(runs[n]["samples"]["diffmm_toy_qa"]) for n in ("diffmm", "hf"))
    assert theirs.std() > 0.5  # choices differ clearly; ties cannot decide the accuracy
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.slow  # two runs of lm-eval's CLI, each indexing lm-eval's ~10k task files (~45-60 s on 2 cores)
def test_hf_and_diffmm_adapter_agree_on_a_difflama_export(tmp_path, local_task, monkeypatch):
    folder = tmp_path / "difflama"
    _difflama_export(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)  # the folder as is
    assert tok("The capital of France is Paris")["input_ids"] == ClipBPE().encode("The capital of France is Paris")
    common = ["--tasks", "diffmm_toy_qa", "--include_path", local_task, "--device", "cpu", "--batch_size", "auto",
              "--log_samples"]
    # lm-eval's own CLI entry (what the lm-eval command runs), --model hf on the folder
    monkeypatch.setattr(sys, "argv", ["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={folder}",
                                      "--output_path", str(tmp_path / "hf"), *common])
    cli_evaluate()
    # diffmm's command: the same lm-eval CLI with diffmm registered, --model diffmm by default
    assert diffmm_main(["eval", "lm-eval", "--model_args", f"pretrained={folder}",
                        "--output_path", str(tmp_path / "dm"), *common]) == 0
    (hf_res, hf_samples), (dm_res, dm_samples) = _lm_eval_output(tmp_path / "hf"), _lm_eval_output(tmp_path / "dm")
    assert dm_res["config"]["model"] == "diffmm" and hf_res["config"]["model"] == "hf"
    hf_m, dm_m = hf_res["results"]["diffmm_toy_qa"], dm_res["results"]["diffmm_toy_qa"]
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none", "acc_norm_stderr,none"):
        assert dm_m[metric] == hf_m[metric], metric
    assert dm_m["acc_stderr,none"] > 0  # stderr kept
    ours, theirs = _loglikelihoods(dm_samples), _loglikelihoods(hf_samples)
    assert theirs.std() > 0.5  # choices differ clearly; ties cannot decide the accuracy
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    # batch_size=auto on CPU: both report lm-eval's largest batch (max_batch_size, 64)
    assert dm_res["config"]["batch_sizes"] == hf_res["config"]["batch_sizes"] == [64]


def test_cli_passes_lm_eval_arguments_through(capsys):
    assert diffmm_main(["eval", "lm-eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--model_args", "--tasks", "--include_path", "--batch_size", "--output_path"))
    args = ["--model_args", "pretrained=x", "--tasks", "a,b", "--batch_size", "auto"]
    assert parse(["eval", "lm-eval", *args]) == (["eval", "lm-eval"], lm_eval_cli, {"argv": args})
    assert lm_eval_argv(args) == ["run", "--model", "diffmm", *args]
    assert lm_eval_argv(["run", "--model", "hf", *args]) == ["run", "--model", "hf", *args]
    assert diffmm_main(["eval", "lm-eval", "--tasks", "a", "--lm", "x"]) == 2  # lm-eval's parser: no --lm
    assert "unrecognized arguments: --lm x" in capsys.readouterr().err


def test_batch_size_parsing_and_search():
    assert parse_batch_size(4) == (4, 0) and parse_batch_size("auto") == (None, 1)
    assert parse_batch_size("auto:3") == (None, 3)
    with pytest.raises(ValueError, match="batch_size 'big'"):
        parse_batch_size("big")
    tried = []

    def fits(batch):  # out of memory above 12 rows
        tried.append(batch)
        if batch > 12:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert largest_batch(fits, 64) == 8 and tried == [64, 32, 16, 8]
    with pytest.raises(ValueError):  # other errors are not "smaller"
        largest_batch(lambda b: (_ for _ in ()).throw(ValueError("shape")), 8)


def test_auto_batch_size_searches_on_an_accelerator():
    """The search path taken off CPU: the meta device stands in for a GPU whose memory holds 12 rows."""

    class Bounded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, device="meta"))
            self.calls = []

        def forward(self, idx):
            self.calls.append(tuple(idx.shape))
            if idx.shape[0] > 12:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
            return torch.zeros(*idx.shape, 50, device=idx.device)

    class Tok:
        eos_id = 0

    model = Bounded()
    lm = DiffmmLM(model, Tok(), batch_size="auto", max_batch_size=48, max_length=20)
    assert lm._device.type == "meta"
    assert lm.auto_batch_size(30) == 12 and model.calls == [(48, 20), (24, 20), (12, 20)]  # length capped at 20
    assert lm.auto_batch_size(30) == 12 and len(model.calls) == 3  # found once per length


def test_auto_batch_size_scores_like_a_fixed_one():
    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=64, block_size=32, n_layer=1, n_embd=32, n_head=4, init_std=0.1)).eval()

    class Tok:
        eos_id = 0

        def encode(self, text):
            return [1 + ord(c) % 60 for c in text]

    class Req:
        def __init__(self, *args):
            self.args = args

    reqs = [Req("ab" * (1 + i % 5), "cd" * (1 + i % 3)) for i in range(11)]
    fixed = DiffmmLM(model, Tok(), batch_size=3).loglikelihood(reqs)
    auto = DiffmmLM(model, Tok(), batch_size="auto:2", max_batch_size=5)
    got = auto.loglikelihood(reqs)
    torch.testing.assert_close(torch.tensor([g[0] for g in got]), torch.tensor([f[0] for f in fixed]))
    assert [g[1] for g in got] == [f[1] for f in fixed]
    assert list(auto.batch_sizes.values()) == [5, 5]  # searched twice (auto:2); on CPU: max_batch_size


def test_entry_point_is_declared_and_resolves():
    """lm-eval versions with plugin discovery read the ``lm_eval.models`` entry point into their registry as a
    placeholder; lm-eval's Registry materialises this one to DiffmmLM."""
    from lm_eval.api.registry import Registry

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11)
    value = re.search(r'\[project\.entry-points\."lm_eval\.models"\]\s*(?:#[^\n]*\n\s*)*diffmm = "([^"]+)"',
                      pyproject).group(1)
    assert value == "diffmm.eval.harness:DiffmmLM"
    registry = Registry("model")
    registry.register("diffmm", target=EntryPoint(name="diffmm", value=value, group="lm_eval.models"))
    assert registry.get("diffmm") is DiffmmLM


def test_python_form_keeps_stderr_and_auto(tmp_path, local_task):
    from diffmm.eval.commands import lm_eval

    folder = tmp_path / "difflama"
    _difflama_export(folder)
    res = lm_eval(lm=str(folder), tasks="diffmm_toy_qa", include_path=local_task, batch_size="auto", device="cpu",
                  out=str(tmp_path / "r.json"), md=str(tmp_path / "r.md"))
    metrics = json.loads((tmp_path / "r.json").read_text())["results"]["diffmm_toy_qa"]
    assert metrics["acc_stderr,none"] > 0 and metrics == res["results"]["diffmm_toy_qa"]
    assert f"{metrics['acc_stderr,none']:.4f}" in (tmp_path / "r.md").read_text()
    assert res["config"]["batch_size"] == "auto" and res["config"]["batch_sizes"] == [64]  # CPU: max_batch_size


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without CUDA")
def test_lm_eval_default_device_falls_back_to_cpu(tmp_path, caplog):
    """lm-eval's CLI passes device='cuda:0' unless told otherwise; like its hf model, the adapter runs on cpu."""
    folder = tmp_path / "difflama"
    _difflama_export(folder)
    lm = DiffmmLM(pretrained=str(folder), device="cuda:0", batch_size=2)
    assert lm.device.type == "cpu" and next(lm.model.parameters()).device.type == "cpu"
    assert "cuda:0 is not available here" in caplog.text
