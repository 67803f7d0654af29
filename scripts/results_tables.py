"""Regenerate the result tables of the docs from the committed result files.

Each generated section of a doc sits between two markers and is rewritten from its source:

    <!-- BEGIN GENERATED demo-clip (scripts/results_tables.py from results/demo/results.json) -->
    ...
    <!-- END GENERATED demo-clip -->

| section | doc | source |
|---|---|---|
| ``demo-run``, ``demo-lit``, ``demo-dinov2`` | docs/results.md | ``results/demo/results.json`` (``diffmm demo``) |
| ``demo-clip``, ``demo-lm`` | docs/results.md | ``results/demo_scratch/results.json`` (the from-scratch run) |
| ``mechanism-*`` | docs/results.md | ``results/mechanism/`` (``studies/mechanism/analyze.py`` renders them) |

    python scripts/results_tables.py                       # rewrite the generated sections
    python scripts/results_tables.py --check               # exit 1 and name the stale sections
    python scripts/results_tables.py --import-demo report  # copy a demo run's results into results/demo/, then rewrite

``--import-demo DIR`` copies ``DIR/results.json`` and ``DIR/report.md`` (and the plots ``report.md`` shows) into
``results/demo/`` and writes ``results/demo/config.json`` (command, preset, config, environment); absolute paths
in them become relative to the repository (or ``<path>``). ``tests/test_docs.py`` checks that the committed docs
equal this script's output.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the demo application (diffmm_demo/) lives beside the package and is not installed
sys.path.insert(0, os.path.join(REPO, "studies", "mechanism"))
import analyze as mechanism  # noqa: E402
from diffmm_demo.report import comparison_table  # noqa: E402

DEMO_DIR = os.path.join("results", "demo")
SCRATCH_DIR = os.path.join("results", "demo_scratch")  # the from-scratch CLIP and LM run the LiT demo replaced
SCRIPT = "scripts/results_tables.py"


# ------------------------------------------------------------------------------------------------ demo
def _load_demo(root: str, folder: str = DEMO_DIR) -> dict:
    path = os.path.join(root, folder, "results.json")
    if not os.path.isfile(path):
        raise SystemExit(f"{os.path.relpath(path, root)}: not found; run the demo and import it: "
                         f"`python {SCRIPT} --import-demo report`")
    with open(path) as f:
        return json.load(f)


def demo_run(root: str) -> str:
    r = _load_demo(root)
    cfg, env = r["config"], r["environment"]
    preset = cfg.get("preset", "custom")  # as recorded by the run (config.json holds the same)
    steps = r.get("steps", [])
    failed = [s["name"] for s in steps if s["status"] == "failed"]
    command = r["command"].replace("diffmm demo", "python -m diffmm_demo run", 1)  # its name inside the package
    rows = [
        ("command", f"`{command}`" + (" (recorded as diffmm demo)" if command != r["command"] else "")),
        ("preset", {"full": "full (`make demo`)", "quick": "**quick** (`make demo-quick`: a smoke test, not the "
                    "documented comparison)"}.get(preset, "custom")),
        ("seeds", ", ".join(map(str, cfg["seeds"]))),
        *[(p["name"], f"{' vs '.join(p['models'])}: {p['budget']}") for p in r["parts"].values()],
        ("steps", f"{len(steps) - len(failed)} ok, {len(failed)} failed"
                  + (f" ({', '.join(failed)})" if failed else "")),
        ("wall time", f"{(r.get('wall_seconds') or 0) / 60:.1f} min (CPU {(r.get('cpu_seconds') or 0) / 60:.1f} min), "
                      f"{env['cores']} cores, {env['torch_threads']} torch thread(s), load average "
                      f"{env.get('load_start')} at the start, {env.get('load_end', '?')} at the end"),
        ("software", f"diffmm {env.get('diffmm')}, torch {env.get('torch')}, Python {env.get('python')}"),
        ("finished", str(r.get("finished", "?"))),
    ]
    lines = ["| run | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    if preset != "full":
        lines += ["", f"**The committed run is the {preset} preset**, not the 3-seed `make demo` run this page "
                      "describes; regenerate with "
                      "`make demo && python scripts/results_tables.py --import-demo report`."]
    return "\n".join(lines) + "\n"


def demo_part(key: str, what: str, folder: str = DEMO_DIR) -> Callable[[str], str]:
    """The comparison table of the demo part ``key`` of the run in ``folder`` (the same table as its report.md)."""
    def render(root: str) -> str:
        part = _load_demo(root, folder)["parts"].get(key)
        return comparison_table(part) if part else f"*(no {what} part in this run)*\n"

    return render


# ----------------------------------------------------------------------------------------- machinery
DOC = "docs/results.md"  # the doc with generated sections
SECTIONS: dict[str, tuple[Callable[[str], str], str]] = {  # name -> (render, what it reads)
    "demo-run": (demo_run, f"{DEMO_DIR}/results.json"),
    "demo-lit": (demo_part("lit", "LiT"), f"{DEMO_DIR}/results.json"),
    "demo-dinov2": (demo_part("dinov2", "DINOv2 LiT"), f"{DEMO_DIR}/results.json"),
    "demo-clip": (demo_part("clip", "image-text", SCRATCH_DIR), f"{SCRATCH_DIR}/results.json"),
    "demo-lm": (demo_part("lm", "language", SCRATCH_DIR), f"{SCRATCH_DIR}/results.json"),
    **{name: (fn, "results/mechanism/") for name, fn in mechanism.SECTIONS.items()},  # studies/mechanism/analyze.py
}


def _pattern(name: str) -> re.Pattern:
    """The generated section ``name`` of the doc, its markers included."""
    return re.compile(rf"<!-- BEGIN GENERATED {re.escape(name)} .*?-->\n.*?<!-- END GENERATED {re.escape(name)} -->",
                      re.S)


def _read_doc(root: str) -> str:
    with open(os.path.join(root, DOC), encoding="utf-8") as f:
        return f.read()


def render(root: str = REPO) -> tuple[str, list[str]]:
    """The regenerated text of the doc, and the problems (missing markers)."""
    text, problems = _read_doc(root), []
    for name, (fn, source) in SECTIONS.items():
        if not _pattern(name).search(text):
            problems.append(f"{DOC}: no markers for section {name}")
            continue
        block = (f"<!-- BEGIN GENERATED {name} ({SCRIPT} from {source}) -->\n" + fn(root).rstrip("\n")
                 + "\n"
                 f"<!-- END GENERATED {name} -->")
        text = _pattern(name).sub(lambda m, block=block: block, text, count=1)
    return text, problems


def check(root: str = REPO) -> list[str]:
    """Names of the sections whose committed text differs from the generated one (and missing markers)."""
    text, problems = render(root)
    current = _read_doc(root)
    return problems + [f"{DOC}: {n}" for n in SECTIONS if _pattern(n).findall(current) != _pattern(n).findall(text)]


# ------------------------------------------------------------------------------------------- import
_ABS = re.compile(r"(?<![\w.~])/(?:work|tmp|root|home|Users|private|var/folders)/[^\s\"'`)\]]*")


def scrub(text: str, run_dir: str, root: str = REPO) -> str:
    """Absolute paths -> relative to the repository (when inside it) or ``<path>``."""
    for base in sorted({os.path.abspath(run_dir), os.path.realpath(run_dir)}, key=len, reverse=True):
        text = text.replace(base + os.sep, DEMO_DIR + "/").replace(base, DEMO_DIR)
    for base in sorted({os.path.abspath(root), os.path.realpath(root)}, key=len, reverse=True):
        text = text.replace(base + os.sep, "").replace(base, ".")
    return _ABS.sub("<path>", text)


def import_demo(run_dir: str, root: str = REPO) -> list[str]:
    """Copy a demo run's results.json, report.md and shown plots into results/demo/; returns the written files."""
    src_json = os.path.join(run_dir, "results.json")
    if not os.path.isfile(src_json):
        raise SystemExit(f"{src_json}: not found; run `python -m diffmm_demo run --out {run_dir}` first")
    dest = os.path.join(root, DEMO_DIR)
    os.makedirs(dest, exist_ok=True)
    written = []

    def write(name: str, text: str) -> None:
        with open(os.path.join(dest, name), "w") as f:
            f.write(text)
        written.append(os.path.join(DEMO_DIR, name))

    with open(src_json) as f:
        text = scrub(f.read(), run_dir, root)
    r = json.loads(text)
    write("results.json", text)
    config = {"command": r["command"], "preset": r["config"].get("preset", "custom"), "config": r["config"],
              "environment": r["environment"]}
    write("config.json", json.dumps(config, indent=1) + "\n")
    preset, steps = config["preset"], r["config"]["steps"]
    write("README.md", f"# The demo run behind docs/results.md\n\n"
          f"`{r['command']}`, preset **{preset}**"
          + (f" (a smoke test: {len(r['config']['seeds'])} seed(s), "
             + ", ".join(f"{steps[p]} {p} steps" for p in r["config"]["parts"])
             + "; not the documented 3-seed comparison)" if preset == "quick" else "")
          + f", finished {r.get('finished', '?')}.\n\n"
          "`results.json` holds every number, `config.json` the config and environment, `report.md` the "
          "report with its plots. Written by `python scripts/results_tables.py --import-demo DIR`, which also "
          "regenerates the tables of docs/results.md. The full run:\n\n"
          "    make demo && python scripts/results_tables.py --import-demo report\n")
    report = os.path.join(run_dir, "report.md")
    if os.path.isfile(report):
        with open(report) as f:
            md = scrub(f.read(), run_dir, root)
        for img in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md):
            s, t = os.path.join(run_dir, img), os.path.join(dest, img)
            if os.path.isfile(s):
                os.makedirs(os.path.dirname(t), exist_ok=True)
                shutil.copyfile(s, t)
                written.append(os.path.join(DEMO_DIR, img))
        write("report.md", md)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--check", action="store_true", help="do not write; exit 1 when a generated section is stale")
    p.add_argument("--import-demo", metavar="DIR", help="first copy DIR's demo results into results/demo/")
    p.add_argument("--root", default=REPO, help="repository root (default: this script's checkout)")
    a = p.parse_args(argv)
    if a.import_demo and a.check:
        p.error("--import-demo writes; it cannot be combined with --check")
    if a.import_demo:
        for path in import_demo(a.import_demo, a.root):
            print(f"wrote {path}")
    if a.check:
        stale = check(a.root)
        for s in stale:
            print(f"stale: {s}", file=sys.stderr)
        return 1 if stale else 0
    text, problems = render(a.root)
    if problems:
        for s in problems:
            print(f"error: {s}", file=sys.stderr)
        return 1
    if text != _read_doc(a.root):
        with open(os.path.join(a.root, DOC), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
