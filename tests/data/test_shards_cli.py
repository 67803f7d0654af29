"""``diffmm shards from-captions|from-folders|from-text|check|index``: shards that the loaders read back; one-line
errors with exit status 2 (``check`` exits 1 on damaged shards)."""
from __future__ import annotations

import csv
import json
import shutil

import pytest
from PIL import Image

from diffmm.data.image_text import image_label_loader, image_text_loader
from diffmm.data.shard_tools import image_field, parse_size
from diffmm.cli import main as diffmm_main


def main(argv: list[str]) -> int:
    return diffmm_main(["shards", *argv])


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
    assert main(["from-captions", str(tmp_path / "imgs"), str(tmp_path / "c.csv"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no caption column" in err and "c.csv" in err and "\n" not in err
    (tmp_path / "d.csv").write_text("file,caption\nimg0.jpg,x\nmissing.jpg,y\n")
    assert main(["from-captions", str(tmp_path / "imgs"), str(tmp_path / "d.csv"), str(tmp_path / "o")]) == 2
    assert "row 2: image" in capsys.readouterr().err
    assert main(["from-captions", str(tmp_path / "imgs"), str(tmp_path / "d.csv"), str(tmp_path / "o"),
                 "--skip_missing", "true"]) == 0


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
    assert main(["from-text", str(out), str(docs), "--train_tokenizer", "300", "--maxcount", "2"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 5 documents in 3 shards" in printed
    assert (out / "tokenizer.json").exists() and (out / "tokens.json").exists()
    assert main(["check", str(out / "shard-{000000..000002}.tar"), "--kind", "text"]) == 0


def test_parse_size():
    assert parse_size("4096") == 4096 and parse_size("500MB") == 500 << 20 and parse_size("1GiB") == 1 << 30
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="bad size '5 apples'"):
        parse_size("5 apples")


# ----- a rerun never loses the old shards; bad input is found before anything is replaced ----------
def _captions(tmp_path, names):
    table = tmp_path / f"c{len(list(tmp_path.glob('c*.csv')))}.csv"
    table.write_text("file,caption\n" + "".join(f"{n},picture {i}\n" for i, n in enumerate(names)))
    return str(table)


def _shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*")) if p.is_file()}


@pytest.fixture
def captioned(tmp_path):
    """24 good images, a good 6-per-shard output, and a snapshot of its files."""
    make_images(tmp_path / "imgs", 24)
    good = [f"img{i}.{'png' if i % 2 else 'jpg'}" for i in range(24)]
    out = tmp_path / "out"
    assert main(["from-captions", str(tmp_path / "imgs"), _captions(tmp_path, good), str(out), "--maxcount", "6"]) == 0
    return tmp_path, good, out, _shard_bytes(out)


@pytest.mark.parametrize("bad", ["missing", "corrupt_bmp", "text_as_jpg"])
def test_rerun_with_a_bad_row_keeps_the_old_shards(captioned, capsys, bad):
    tmp_path, good, out, before = captioned
    if bad == "corrupt_bmp":
        (tmp_path / "imgs" / "bad.bmp").write_bytes(b"BM" + b"\x00" * 40)
        name = "bad.bmp"
    elif bad == "text_as_jpg":
        (tmp_path / "imgs" / "notes.jpg").write_text("this is text, not a JPEG")
        name = "notes.jpg"
    else:
        name = "missing.png"
    rows = good[:11] + [name] + good[11:]
    capsys.readouterr()
    assert main(["from-captions", str(tmp_path / "imgs"), _captions(tmp_path, rows), str(out), "--maxcount", "6"]) == 2
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if "error:" in ln]      # one line (the rest is the progress bar)
    assert "row 12" in line and name in line and "old shards are kept" in line and "Traceback" not in err
    assert _shard_bytes(out) == before                      # byte for byte, sizes.json included
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary folder left behind"


def test_skip_bad_keeps_every_good_sample_and_says_so(captioned, capsys):
    tmp_path, good, out, _ = captioned
    (tmp_path / "imgs" / "notes.jpg").write_text("text")
    (tmp_path / "imgs" / "bad.bmp").write_bytes(b"BM" + b"\x00" * 40)
    rows = good[:5] + ["missing.png"] + good[5:11] + ["bad.bmp"] + good[11:] + ["notes.jpg"]
    assert main(["from-captions", str(tmp_path / "imgs"), _captions(tmp_path, rows), str(out), "--maxcount", "6",
                 "--skip_bad", "true"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 24 samples" in printed and "3 rows skipped (bad image=2, missing image=1)" in printed
    assert sum(json.load(open(out / "sizes.json")).values()) == 24
    assert main(["check", str(out / "*.tar")]) == 0


def test_prefix_cannot_leave_the_output_folder(tmp_path, capsys):
    make_images(tmp_path / "a" / "b" / "imgs", 2)
    out = tmp_path / "a" / "b" / "out"
    table = _captions(tmp_path, ["img0.jpg", "img1.png"])
    for prefix in ("../../x", "sub/x", "..", "x\\y"):
        assert main(["from-captions", str(tmp_path / "a" / "b" / "imgs"), table, str(out), "--prefix", prefix]) == 2
        err = capsys.readouterr().err.strip()
        assert "--prefix" in err and "\n" not in err
    assert not list(tmp_path.rglob("*.tar")) and not out.exists()


def test_images_are_stored_by_their_real_format(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "png_named.jpg", "PNG")
    Image.new("RGB", (4, 4)).save(tmp_path / "pic.bmp")
    assert image_field(str(tmp_path / "png_named.jpg"))[0] == "png"
    field, data = image_field(str(tmp_path / "pic.bmp"))
    assert field == "png" and data.startswith(b"\x89PNG")


def test_from_folders_validates_images(tmp_path, capsys):
    make_images(tmp_path / "root" / "cat", 3)
    (tmp_path / "root" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    out = tmp_path / "out"
    assert main(["from-folders", str(tmp_path / "root"), str(out)]) == 2
    assert "broken.jpg" in capsys.readouterr().err and not out.exists() or not list(out.glob("*.tar"))
    assert main(["from-folders", str(tmp_path / "root"), str(out), "--skip_bad", "true"]) == 0
    assert "1 rows skipped (bad image=1)" in capsys.readouterr().out


# ----- check: globs and braces, exit status on damage; index writes sizes.json --------------------
def _write(out, n, prefix="s"):
    from diffmm.data.writer import ShardWriter

    with ShardWriter(str(out), prefix, maxcount=4) as w:
        for i in range(n):
            buf = __import__("io").BytesIO()
            Image.new("RGB", (4, 4), (i, 0, 0)).save(buf, "PNG")
            w.write(f"{i:04d}", {"png": buf.getvalue(), "txt": f"c {i}"})


def test_check_expands_globs_and_braces_and_fails_on_damage(tmp_path, capsys):
    _write(tmp_path, 10)                                             # 3 shards: 4 + 4 + 2
    assert main(["check", str(tmp_path / "*.tar")]) == 0
    assert "samples in=10 out=10" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "s-{000000..000001}.tar"), str(tmp_path / "s-000002.tar")]) == 0
    assert main(["check", str(tmp_path / "nothing-*.tar")]) == 2
    assert "no file matches the pattern" in capsys.readouterr().err
    open(tmp_path / "s-000003.tar", "wb").close()                    # an empty shard
    assert main(["check", str(tmp_path / "*.tar")]) == 1
    assert "empty=1" in capsys.readouterr().out
    (tmp_path / "s-000003.tar").unlink()
    p = tmp_path / "s-000001.tar"
    p.write_bytes(p.read_bytes()[:1500])                             # cut inside the first member's data
    assert main(["check", str(tmp_path / "*.tar")]) == 1
    assert "truncated=1" in capsys.readouterr().out


def test_check_reports_a_sizes_json_that_overstates_a_shard(tmp_path, capsys, caplog):
    _write(tmp_path, 8)
    sizes = json.load(open(tmp_path / "sizes.json"))
    sizes["s-000001.tar"] = 7                                        # really 4
    (tmp_path / "sizes.json").write_text(json.dumps(sizes))
    assert main(["check", str(tmp_path / "*.tar")]) == 1
    assert "miscounted=1" in capsys.readouterr().out
    [warning] = [r.getMessage() for r in caplog.records if "miscounted" in r.getMessage()]
    assert "s-000001.tar: 4 samples, but" in warning and "says 7" in warning


def test_index_writes_sizes_json(tmp_path, capsys):
    _write(tmp_path / "a", 10)
    (tmp_path / "a" / "sizes.json").unlink()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(["index", str(tmp_path / "a" / "*.tar"), str(tmp_path / "b" / "s-{000000..000001}.tar")]) == 0
    assert json.load(open(tmp_path / "a" / "sizes.json")) == {"s-000000.tar": 4, "s-000001.tar": 4, "s-000002.tar": 2}
    assert json.load(open(tmp_path / "b" / "sizes.json")) == {"s-000000.tar": 4, "s-000001.tar": 4}
    assert "10 samples in 3 shards" in capsys.readouterr().out


def test_the_tools_are_plain_functions(tmp_path, capsys):
    """What each subcommand runs, called from Python: typed arguments, a printed report, a return value."""
    from diffmm.data.shard_tools import check_shards, index_shards, write_shards_from_folders

    for cls in ("cat", "dog"):
        make_images(tmp_path / "root" / cls, 3)
    w = write_shards_from_folders(str(tmp_path / "root"), str(tmp_path / "out"), maxcount=4, maxsize="1MB",
                                  progress=False)
    assert (w.total, len(w.shards), w.skipped.total) == (6, 2, 0)
    assert "wrote 6 samples in 2 shards" in capsys.readouterr().out
    assert check_shards([str(tmp_path / "out" / "*.tar")], max_member_bytes="1MB") is True
    (tmp_path / "out" / "sizes.json").unlink()
    written = index_shards([str(tmp_path / "out" / "*.tar")])
    assert written == {str(tmp_path / "out" / "sizes.json"): {"shard-000000.tar": 4, "shard-000001.tar": 2}}
