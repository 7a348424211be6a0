"""The notebooks in analysis/ run top to bottom on a small results file, from the repository
root, writing only to a `notebooks` folder beside the results; and each .ipynb holds the same
cells as its jupytext .py twin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from results_files import paper_rows, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "analysis"
NAMES = ("fit_power_laws", "figure3", "figure5")
SWEEPS_OWN = b"the sweep's own figure, which no notebook may overwrite"


def cells(notebook) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def sweep_folder(folder: Path) -> Path:
    """A sweep's folder with a small results table and its own analysis/fig3.png."""
    write_jsonl(folder / "results.jsonl", paper_rows())
    (folder / "analysis").mkdir()
    (folder / "analysis" / "fig3.png").write_bytes(SWEEPS_OWN)
    return folder


def run(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "LMUSCALE_RESULTS"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**environ, "LMUSCALE_N_BOOT": "30", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The sweep folder after `python analysis/run_notebooks.py` ran in the repository root,
    and the bytes of analysis/ before and after."""
    sweep = sweep_folder(tmp_path_factory.mktemp("sweep"))
    before = {p.name: p.read_bytes() for p in NOTEBOOKS.iterdir() if p.is_file()}
    done = run(["analysis/run_notebooks.py"], ROOT, LMUSCALE_RESULTS=str(sweep / "results.jsonl"))
    assert done.returncode == 0, done.stdout + done.stderr
    after = {p.name: p.read_bytes() for p in NOTEBOOKS.iterdir() if p.is_file()}
    return sweep, before, after


@pytest.mark.parametrize("name", NAMES)
def test_ipynb_matches_its_py_twin(name):
    paired = jupytext.read(NOTEBOOKS / f"{name}.py")
    stored = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert cells(stored) == cells(paired), f"run: jupytext --sync analysis/{name}.py"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, executed):
    sweep = executed[0]
    notebook = nbformat.read(sweep / "notebooks" / f"{name}.ipynb", as_version=4)
    assert cells(notebook) == cells(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    kinds = {k for o in outputs for k in o.get("data", {})}
    if name == "fit_power_laws":
        assert "24 runs" in text and "LMU, 25,000 steps: lmu-55k" in text
        assert "text/markdown" in kinds
    else:
        figure = sweep / "notebooks" / f"fig{name[-1]}"
        assert "image/png" in kinds
        assert Path(f"{figure}.png").stat().st_size > 10_000 and Path(f"{figure}.pdf").exists()
    if name == "figure5":
        assert "lmu-1000k: loss" in text and "inf" in text


def test_notebooks_leave_the_sweeps_analysis_and_their_sources_alone(executed):
    sweep, before, after = executed
    assert [p.name for p in (sweep / "analysis").iterdir()] == ["fig3.png"]
    assert (sweep / "analysis" / "fig3.png").read_bytes() == SWEEPS_OWN
    assert after == before  # the .ipynb files in analysis/ are not executed in place


def test_script_runs_from_the_repository_root(tmp_path):
    """`python analysis/figure3.py` in the root of a checkout reads that checkout's
    runs/demo/results.jsonl and saves into runs/demo/notebooks/."""
    checkout = tmp_path / "checkout"
    (checkout / "analysis").mkdir(parents=True)
    shutil.copy(NOTEBOOKS / "figure3.py", checkout / "analysis")
    (checkout / "runs" / "demo").mkdir(parents=True)
    demo = sweep_folder(checkout / "runs" / "demo")
    done = run(["analysis/figure3.py"], checkout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{demo / 'notebooks' / 'fig3.png'}" in done.stdout
    assert (demo / "notebooks" / "fig3.png").stat().st_size > 10_000
    assert (demo / "analysis" / "fig3.png").read_bytes() == SWEEPS_OWN


def test_missing_results_say_what_to_run_first(tmp_path):
    missing = tmp_path / "runs" / "demo" / "results.jsonl"
    done = run(["analysis/run_notebooks.py"], ROOT, LMUSCALE_RESULTS=str(missing))
    assert done.returncode == 1
    assert f"{missing}: no such results file. Run `make demo` first" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_figure5_refuses_what_the_command_refuses(tmp_path):
    # Byte-level runs with no transformer beyond the LMU's budget: `python -m lmuscale.analysis`
    # does not draw Figure 5, and says why; the notebook prints the same line and saves none.
    from lmuscale.analysis import analyse

    rows = [{**r, "tokenizer": "bytes"} for r in paper_rows(tenx=False)]
    (tmp_path / "runs").mkdir()
    table = write_jsonl(tmp_path / "runs" / "results.jsonl", rows)
    report = analyse(table, tmp_path / "analysis", n_boot=20)
    (refusal,) = [line for line in report.refusals if line.startswith("Figure 5: not drawn")]
    done = run([str(NOTEBOOKS / "figure5.py")], tmp_path, LMUSCALE_RESULTS=str(table))
    assert done.returncode == 0, done.stderr
    assert refusal in done.stdout.splitlines()
    assert not (tmp_path / "runs" / "notebooks" / "fig5.png").exists()
