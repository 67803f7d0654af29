"""``diffmm shards from-captions|from-folders|from-text|check``: shards that the loaders read back."""
from __future__ import annotations

import csv
import json

import pytest
from PIL import Image

from diffmm.data.image_text import image_label_loader, image_text_loader
from diffmm.data.shards_cli import main, parse_size


def make_images(folder, n):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (12, 10), (20 * i, 0, 0)).save(folder / f"img{i}.{'png' if i % 2 else 'jpg'}")


def ids_tok(texts):
    import torch

    return torch.tensor([[int(t.split()[-1])] for t in texts])


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet"])
def test_from_captions_all_table_formats(tmp_path, fmt):
    make_images(tmp_path / "imgs", 5)
    rows = [{"file": f"img{i}.{'png' if i % 2 else 'jpg'}", "caption": f"picture {i}", "extra": i} for i in range(5)]
    table = tmp_path / f"captions.{fmt}"
    if fmt in ("csv", "tsv"):
        with open(table, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if fmt == "tsv" else ",")
            w.writeheader()
            w.writerows(rows)
    elif fmt == "jsonl":
        table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), table)
    out = tmp_path / "out"
    assert main(["from-captions", str(tmp_path / "imgs"), str(table), str(out), "--maxcount", "2"]) == 0
    assert json.load(open(out / "sizes.json")) == {"shard-000000.tar": 2, "shard-000001.tar": 2, "shard-000002.tar": 1}
    loader = image_text_loader(str(out / "shard-{000000..000002}.tar"), 5, num_workers=0, tokenizer=ids_tok,
                               image_size=8, train=False)
    images, tokens = next(iter(loader))
    assert images.shape == (5, 3, 8, 8) and sorted(tokens[:, 0].tolist()) == [0, 1, 2, 3, 4]


def test_from_captions_errors_are_one_line(tmp_path, capsys):
    make_images(tmp_path / "imgs", 2)
    (tmp_path / "c.csv").write_text("file,label\nimg0.jpg,x\n")
    assert main(["from-captions", str(tmp_path / "imgs"), str(tmp_path / "c.csv"), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert "no caption column" in err and "c.csv" in err and "\n" not in err
    (tmp_path / "d.csv").write_text("file,caption\nimg0.jpg,x\nmissing.jpg,y\n")
    assert main(["from-captions", str(tmp_path / "imgs"), str(tmp_path / "d.csv"), str(tmp_path / "o")]) == 1
    assert "row 2: image" in capsys.readouterr().err
    assert main(["from-captions", str(tmp_path / "imgs"), str(tmp_path / "d.csv"), str(tmp_path / "o"),
                 "--skip-missing"]) == 0


def test_from_folders_labels_and_classes(tmp_path):
    for cls in ("cat", "hot_dog"):
        make_images(tmp_path / "root" / cls, 3)
    out = tmp_path / "out"
    assert main(["from-folders", str(tmp_path / "root"), str(out)]) == 0
    classes = json.load(open(out / "classes.json"))
    assert classes["classes"] == ["cat", "hot dog"]
    loader = image_label_loader(str(out / "shard-000000.tar"), 6, num_workers=0, image_size=8)
    _, labels = next(iter(loader))
    assert sorted(labels.tolist()) == [0, 0, 0, 1, 1, 1]
    assert main(["check", str(out / "shard-000000.tar")]) == 0


def test_from_text_with_trained_tokenizer(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"page{i}.rst").write_text(f"Page {i}\n======\n\nSome text about python number {i}.\n" * 5)
    (docs / "sub").mkdir()
    (docs / "sub" / "more.rst").write_text("Nested page. " * 30)
    out = tmp_path / "out"
    assert main(["from-text", str(out), str(docs), "--train-tokenizer", "300", "--maxcount", "2"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 5 documents in 3 shards" in printed
    assert (out / "tokenizer.json").exists() and (out / "tokens.json").exists()
    assert main(["check", str(out / "shard-{000000..000002}.tar"), "--kind", "text"]) == 0


def test_parse_size():
    assert parse_size("4096") == 4096 and parse_size("500MB") == 500 << 20 and parse_size("1GiB") == 1 << 30
