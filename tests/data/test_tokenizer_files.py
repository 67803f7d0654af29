"""Tokenizer files of exports: transformers' AutoTokenizer on the folder gives diffmm's (open_clip's) ids."""
from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, processors

from diffmm.data.tokenizers import ClipBPE, TokenizerFile, load_lm_tokenizer, train_byte_level_bpe
from diffmm.models.clip.tokenizer import CLIPTokenizer

transformers = pytest.importorskip("transformers")

DOCS = "/usr/share/doc/python3.11/html/_sources"
#: real documents (Debian's Python docs and licences): prose, code, non-ASCII text (unicode howto, re's 'ſ' notes)
DOC_FILES = [f"{DOCS}/tutorial/introduction.rst.txt", f"{DOCS}/library/re.rst.txt", f"{DOCS}/library/stdtypes.rst.txt",
             f"{DOCS}/whatsnew/3.0.rst.txt", "/usr/share/common-licenses/GPL-3"]
SAMPLES = [
    "Hello, World!  It's “quoted” ﬁne — ＦＵＬＬ width &amp;amp; AT&T <b>bold</b>",
    "ΣΟΦΟΣ ΟΔΟΣ. Straße ÜBER naïve café e\u0301 İstanbul 東京タワー 3.14159 x²",
    "  tabs\tand\nnewlines\r\n\u00a0nbsp  and\u200bzero-width   ",
    "Don't you'LL 'S 'sam <end_of_text> trailing",
]


def _real_texts() -> list[str]:
    found = [f for f in DOC_FILES if os.path.isfile(f)]
    if len(found) < 3:
        pytest.skip("Debian's python3.11-doc / base-files texts are not installed")
    return [open(f, encoding="utf-8").read()[:30000] for f in found]


def test_clip_bpe_lm_export_matches_open_clip(tmp_path):
    ClipBPE().save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = ClipBPE()
    for text in SAMPLES + _real_texts():
        assert hf(text)["input_ids"] == ours.encode(text)  # default call: no special tokens, as diffmm's encode
    assert hf.eos_token_id == ours.eos_id and hf.bos_token is None
    ids = ours.encode("a photo of a cat")
    assert hf.decode(ids) == ours.decode(ids)  # "a photo of a cat " (open_clip keeps the last word's space)
    assert isinstance(load_lm_tokenizer(tmp_path), ClipBPE)


def test_clip_caption_tokenizer_adds_start_and_end(tmp_path):
    cap = CLIPTokenizer(context_length=77)
    cap.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES[:2]:
        ids = cap(text)[0].tolist()
        n = ids.index(cap.eot_token_id) + 1
        assert hf(text)["input_ids"] == ids[:n]
    assert hf.model_max_length == 77
    with pytest.raises(ValueError, match="caption tokenizer"):
        load_lm_tokenizer(tmp_path)


def test_tokenizer_file_export_drops_added_tokens(tmp_path):
    texts = _real_texts()
    tok = train_byte_level_bpe(texts, str(tmp_path / "src" / "tokenizer.json"), vocab_size=600, eos_token="</s>")
    raw = Tokenizer.from_file(tok.path)  # the same tokenizer with a post-processor that adds the eos token
    raw.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", tok.eos_id)])
    raw.save(str(tmp_path / "src" / "tokenizer.json"))
    tok = TokenizerFile(str(tmp_path / "src" / "tokenizer.json"), eos_token="</s>")
    tok.save_pretrained(tmp_path / "out")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in SAMPLES + [t[:5000] for t in texts]:
        assert hf(text)["input_ids"] == tok.encode(text)
    assert hf.eos_token == "</s>"
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["diffmm_tokenizer"] == "tokenizer.json"
    again = load_lm_tokenizer(tmp_path / "out")
    assert again.eos_id == tok.eos_id and again.encode(SAMPLES[0]) == tok.encode(SAMPLES[0])

