"""The notebooks in analysis/ run top to bottom on a small results file, and each .ipynb holds
the same cells as its jupytext .py twin."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from results_files import paper_rows, write_jsonl

NOTEBOOKS = Path(__file__).resolve().parent.parent / "analysis"
NAMES = ("fit_power_laws", "figure3", "figure5")


def cells(notebook) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


@pytest.mark.parametrize("name", NAMES)
def test_ipynb_matches_its_py_twin(name):
    paired = jupytext.read(NOTEBOOKS / f"{name}.py")
    stored = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert cells(stored) == cells(paired), f"run: jupytext --sync analysis/{name}.py"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    results = write_jsonl(tmp_path / "results.jsonl", paper_rows())
    monkeypatch.setenv("LMUSCALE_RESULTS", str(results))
    monkeypatch.setenv("LMUSCALE_N_BOOT", "30")
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    kinds = {k for o in outputs for k in o.get("data", {})}
    if name == "fit_power_laws":
        assert "24 runs" in text and "LMU, 25,000 steps: lmu-55k" in text
        assert "text/markdown" in kinds
    else:
        figure = tmp_path / "analysis" / f"fig{name[-1]}"
        assert "image/png" in kinds
        assert Path(f"{figure}.png").stat().st_size > 10_000 and Path(f"{figure}.pdf").exists()
    if name == "figure5":
        assert "lmu-1000k: loss" in text and "inf" in text
