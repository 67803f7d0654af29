"""Demo dataset builders on small synthetic copies of their sources (the real packages are optional)."""
from __future__ import annotations

import gzip
import json
import os
import struct

import numpy as np
import pytest
from PIL import Image

from diffmm.data.image_text import image_label_loader
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.data.text import TextDataset
from diffmm.eval.classnames import FASHION_MNIST_CLASSNAMES

from diffmm_demo import datasets
from diffmm_demo.datasets import build_fashion_mnist, build_python_docs
from diffmm_demo.system_data import NOTO_EMOJI_FONT, require_debian_file, require_npm_package

EMOJI_TEST = """# group: Smileys & Emotion
# subgroup: face-smiling
1F600                                                  ; fully-qualified     # 😀 E1.0 grinning face
263A FE0F                                              ; fully-qualified     # ☺️ E0.6 smiling face
263A                                                   ; unqualified         # ☺ E0.6 smiling face
# group: People & Body
# subgroup: hand-fingers-closed
1F44D                                                  ; fully-qualified     # 👍 E0.6 thumbs up
1F44D 1F3FD                                            ; fully-qualified     # 👍🏽 E1.0 thumbs up: medium skin tone
# group: Component
# subgroup: skin-tone
1F3FB                                                  ; component           # 🏻 E1.0 light skin tone
"""
CLDR = """<ldml><annotations>
<annotation cp="😀">face | grin | grinning face</annotation>
<annotation cp="😀" type="tts">grinning face</annotation>
<annotation cp="👍">+1 | hand | thumb | up</annotation>
<annotation cp="☺">outlined | relaxed | smile</annotation>
</annotations></ldml>"""


def fake_sources(tmp_path):
    (tmp_path / "emoji-test.txt").write_text(EMOJI_TEST, encoding="utf-8")
    (tmp_path / "cldr" / "annotations").mkdir(parents=True)
    (tmp_path / "cldr" / "annotations" / "en.xml").write_text(CLDR, encoding="utf-8")
    pkg = tmp_path / "npm" / "node_modules" / "emoji-datasource-google"
    (pkg / "img" / "google" / "64").mkdir(parents=True)
    (pkg / "package.json").write_text("{}")
    entries = [{"unified": "1F600", "image": "1f600.png"}, {"unified": "263A-FE0F", "image": "263a-fe0f.png"}]
    (pkg / "emoji.json").write_text(json.dumps(entries))
    for e in entries:
        Image.new("RGBA", (64, 64), (255, 200, 0, 255)).save(pkg / "img" / "google" / "64" / e["image"])
    return tmp_path


def test_emoji_parsing_keeps_fully_qualified_and_groups(tmp_path):
    src = fake_sources(tmp_path)
    emojis = datasets.parse_emoji_test(str(src / "emoji-test.txt"))
    assert [e.key for e in emojis] == ["1f600", "263a_fe0f", "1f44d"]
    assert len(datasets.parse_emoji_test(str(src / "emoji-test.txt"), skin_tones=True)) == 4
    kw = datasets.parse_cldr_keywords(str(src / "cldr"))
    emojis[2].keywords = kw["👍"]
    assert emojis[2].caption() == "an emoji of thumbs up, +1, hand, thumb"
    assert emojis[0].group == "Smileys & Emotion" and emojis[2].subgroup == "hand-fingers-closed"


def test_emoji_build_from_a_style_package(tmp_path):
    src = fake_sources(tmp_path)
    counts = datasets.build_emoji(str(tmp_path / "out"), styles=["google"], size=16, npm_dir=str(src / "npm"),
                                    progress=False, emoji_test=str(src / "emoji-test.txt"),
                                    cldr_dir=str(src / "cldr"))
    pattern = str(tmp_path / "out" / "emoji" / "google" / "emoji-google-000000.tar")
    assert counts["styles"]["google"] == {"samples": 2, "missing_in_style": 1, "shards": 1, "pattern": pattern}
    info = json.load(open(tmp_path / "out" / "emoji" / "classes.json"))
    assert info["groups"] == ["Smileys & Emotion", "People & Body"]
    samples = list(iter_tar_samples(counts["styles"]["google"]["pattern"], DataStats()))
    assert [json.loads(s["json"])["group_id"] for s in samples] == [0, 0]
    assert Image.open(__import__("io").BytesIO(samples[0]["png"])).size == (16, 16)


@pytest.mark.skipif(not os.path.exists(NOTO_EMOJI_FONT), reason="needs Debian fonts-noto-color-emoji (make demo-data)")
def test_noto_renders_single_glyphs_and_rejects_unknown_sequences():
    from PIL import ImageFont

    font = ImageFont.truetype(NOTO_EMOJI_FONT, 109, layout_engine=ImageFont.Layout.RAQM)
    img = datasets.render_noto("\U0001F469\u200d\U0001F4BB", font)   # ZWJ sequence: one glyph
    assert img is not None and img.getbbox() is not None
    assert datasets.render_noto("AB", font) is None


def test_missing_packages_say_what_to_install(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nothing not found: install the Debian package some-package"):
        require_debian_file(str(tmp_path / "nothing"), "some-package")
    with pytest.raises(FileNotFoundError, match=f"npm package openmoji .*npm install --prefix {tmp_path} openmoji"):
        require_npm_package("openmoji", str(tmp_path))
    # a builder stops with one line naming the missing file and its package, before writing anything
    with pytest.raises(FileNotFoundError) as e:
        datasets.build_emoji(str(tmp_path / "out"), styles=["openmoji"], npm_dir=str(tmp_path / "npm"),
                               emoji_test=str(tmp_path / "none.txt"))
    assert "none.txt not found: install the Debian package unicode-data" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    src = fake_sources(tmp_path)
    with pytest.raises(FileNotFoundError, match="emoji style openmoji: .* install the npm package openmoji"):
        datasets.build_emoji(str(tmp_path / "out"), styles=["openmoji"], npm_dir=str(src / "npm"),
                               emoji_test=str(src / "emoji-test.txt"), cldr_dir=str(src / "cldr"), progress=False)


def write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_from_idx(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 12)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    counts = build_fashion_mnist(str(tmp_path / "out"), source_dir=str(tmp_path), train_limit=20, maxcount=8,
                                 progress=False)
    assert counts["train"]["samples"] == 20 and counts["train"]["shards"] == 3 and counts["test"]["samples"] == 12
    info = json.load(open(tmp_path / "out" / "fashion-mnist" / "classes.json"))
    assert info["classes"] == list(FASHION_MNIST_CLASSNAMES) and info["templates"][0] == "a photo of a {}."
    images, labels = next(iter(image_label_loader(counts["test"]["pattern"], 12, num_workers=0, image_size=28)))
    assert images.shape == (12, 3, 28, 28) and sorted(labels.tolist()) == sorted((np.arange(12) % 10).tolist())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x01\x02\x08\x01"))
    (tmp_path / "bad" / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x01\x02\x08\x01"))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: not an IDX file"):
        build_fashion_mnist(str(tmp_path / "out2"), source_dir=str(tmp_path / "bad"), progress=False)


def test_python_docs_corpus_splits_and_tokenizer(tmp_path):
    src = tmp_path / "_sources"
    (src / "library").mkdir(parents=True)
    for i in range(30):
        (src / "library" / f"mod{i}.rst.txt").write_text(
            f":mod:`mod{i}` --- module {i}\n\nText about module {i}.\n" * 4)
    info = build_python_docs(str(tmp_path / "out"), source_dir=str(src), vocab_size=300, val_every=5, progress=False)
    c = info["counts"]
    assert c["train"]["documents"] + c["val"]["documents"] == 30 and c["val"]["documents"] > 0
    assert os.path.exists(tmp_path / "out" / "python-docs" / "tokenizer.json")
    ds = TextDataset(c["train"]["pattern"], 2, seq_len=16, tokenizer=str(tmp_path / "out" / "python-docs"))
    assert ds.samples_per_epoch == c["train"]["tokens"] // 17        # from tokens.json
