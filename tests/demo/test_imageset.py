"""The icon image set builder on a fake ``@iconify-json`` package (no network, no npm)."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from diffmm.demo.imageset import build_icons, class_name
from diffmm.eval.image_sources import ImageFolderSource

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
