"""The non-emoji image set builders: icons on a fake ``@iconify-json`` package (no network, no npm), Tux Paint stamps
on a fake stamps folder (no Debian package)."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from diffmm.eval.image_sources import ImageFolderSource

from diffmm_demo.imageset import STAMPS, build_icons, build_stamps, class_name

BOX = '<path fill="#{}" d="M2 2h12v12H2z"/>'


def fake_iconify(tmp_path, prefix="fake-color", category="UI Multicolor"):
    pkg = tmp_path / "npm" / "node_modules" / "@iconify-json" / prefix
    pkg.mkdir(parents=True)
    icons = {f"food-{i}": {"body": BOX.format("f00")} for i in range(3)}
    icons.update({f"car-{i}": {"body": BOX.format("00f"), "width": 24, "height": 24} for i in range(2)})
    icons.update({"beach": {"body": BOX.format("0f0")}, "gone": {"body": BOX.format("000"), "hidden": True}})
    (pkg / "icons.json").write_text(json.dumps({"prefix": prefix, "icons": icons, "width": 16, "height": 16}))
    cats = {"FoodDrinks": [f"food-{i}" for i in range(3)] + ["gone"], "Transportation": ["car-0", "car-1"],
            "MapTravel": ["beach"]}
    (pkg / "metadata.json").write_text(json.dumps({"categories": cats}))
    (pkg / "info.json").write_text(json.dumps({"category": category, "license": {"spdx": "CC-BY-4.0"}}))
    (pkg / "package.json").write_text(json.dumps({"version": "9.9.9"}))
    return str(tmp_path / "npm")


def test_class_name_splits_publisher_categories():
    assert class_name("FoodDrinks") == "food drinks"
    assert class_name("VideoMoviesTv") == "video movies tv"
    assert class_name("Sport") == "sport"


def test_build_icons_layout_and_labels(tmp_path):
    npm = fake_iconify(tmp_path)
    out = tmp_path / "data"
    meta = build_icons(str(out), "fake-color", size=32, min_images=2, npm_dir=npm, progress=False)
    root = out / "icons-fake-color"
    assert meta["classes"] == ["food drinks", "transportation"]       # MapTravel (1 icon) dropped
    assert meta["dropped_categories"] == ["MapTravel"]
    assert meta["counts"] == {"food drinks": 3, "transportation": 2}  # the hidden icon left out
    assert meta["source"] == "npm @iconify-json/fake-color@9.9.9"
    assert json.loads((root / "classes.json").read_text()) == meta
    assert sorted(p.name for p in (root / "food_drinks").iterdir()) == ["food-0.png", "food-1.png", "food-2.png"]
    with Image.open(root / "transportation" / "car-0.png") as img:
        assert img.mode == "RGB" and img.size == (32, 32)
        assert img.getpixel((0, 0)) == (255, 255, 255)              # white background
        r, g, b = img.getpixel((16, 16))
        assert b > 200 and r < 50                                     # the blue box
    src = ImageFolderSource(str(root), transform=lambda im: im, classnames=meta["classes"])
    assert src.classnames == meta["classes"] and src.num_samples == 5
    assert [label for _, label in src.dataset.files] == [0, 0, 0, 1, 1]
    build_icons(str(out), "fake-color", size=32, min_images=2, npm_dir=npm, progress=False)  # a rerun replaces it
    assert sorted(p.name for p in out.iterdir()) == ["icons-fake-color"]


def test_build_icons_refuses_emoji_and_names_missing_package(tmp_path):
    npm = fake_iconify(tmp_path, "some-emoji", category="Emoji")
    with pytest.raises(ValueError, match="emoji set"):
        build_icons(str(tmp_path / "data"), "some-emoji", npm_dir=npm, progress=False)
    with pytest.raises(FileNotFoundError, match="@iconify-json/absent"):
        build_icons(str(tmp_path / "data"), "absent", npm_dir=npm, progress=False)
    with pytest.raises(ValueError, match="no publisher category"):
        build_icons(str(tmp_path / "data"), "fake-color", min_images=50, npm_dir=fake_iconify(tmp_path / "b"),
                    progress=False)


def fake_stamps(tmp_path):
    """A stamps folder as Tux Paint's: categories with nested subfolders, RGBA PNGs of any aspect, .txt descriptions,
    an SVG (not taken), a damaged PNG (skipped and counted) and a category with one stamp (dropped)."""
    root = tmp_path / "stamps"
    stamps = [("animals/mammals/cat", (200, 0, 0, 255), (40, 20)), ("animals/birds/owl", (0, 200, 0, 128), (10, 30)),
              ("animals/dog", (0, 0, 200, 255), (16, 16)), ("food/fruit/apple", (9, 9, 9, 0), (8, 8)),
              ("food/pear", (50, 50, 50, 255), (8, 8)), ("space/moon", (1, 1, 1, 255), (8, 8))]
    for rel, color, size in stamps:
        path = root / (rel + ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGBA", size, color).save(path)
        path.with_suffix(".txt").write_text(f"A {rel.rsplit('/', 1)[1]}.\nfr.utf8=Un ...\n")
    (root / "food" / "broken.png").write_bytes(b"not a png")
    (root / "food" / "leaf.svg").write_text("<svg/>")
    return str(root)


def test_build_stamps_layout_labels_and_skips(tmp_path):
    meta = build_stamps(str(tmp_path / "data"), root=fake_stamps(tmp_path), size=24, min_images=2, progress=False)
    assert meta["classes"] == ["animals", "food"] and meta["counts"] == {"animals": 3, "food": 2}
    assert meta["dropped_categories"] == ["space"] and list(meta["skipped"]) == ["food/broken.png"]
    assert meta["majority_share"] == 3 / 5
    assert meta["stamps"]["animals/animals__mammals__cat.png"] == {"description": "A cat.", "subcategory": "mammals"}
    assert meta["stamps"]["animals/animals__dog.png"]["subcategory"] == "animals"
    folder = tmp_path / "data" / STAMPS
    img = Image.open(folder / "animals" / "animals__mammals__cat.png")
    assert img.size == (24, 24) and img.mode == "RGB"
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((12, 12))[0] > 150  # centred on white
    assert json.loads((folder / "classes.json").read_text())["classes"] == meta["classes"]
    source = ImageFolderSource(str(folder), transform=lambda im: im, classnames=meta["classes"])
    assert [label for _, label in source.dataset.files] == [0, 0, 0, 1, 1]


def test_build_stamps_names_the_debian_package_and_empty_sets(tmp_path):
    with pytest.raises(FileNotFoundError, match="install the Debian package tuxpaint-stamps-default"):
        build_stamps(str(tmp_path / "data"), root=str(tmp_path / "missing"), progress=False)
    with pytest.raises(ValueError, match="no category folder has 10 or more PNG stamps") as e:
        build_stamps(str(tmp_path / "data"), root=fake_stamps(tmp_path), min_images=10, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "data" / STAMPS).exists()
