"""Run the notebooks of this folder top to bottom on a sweep's results, from any working folder:
``python analysis/run_notebooks.py [NAME ...]`` (``make notebooks`` installs their extra first).

The results are ``$LMUSCALE_RESULTS`` (default ``runs/demo/results.jsonl``, which ``make demo``
writes). The executed notebooks, and the figures they save, go to a ``notebooks`` folder beside
the results: never to the sweep's ``analysis`` folder, and the ``.ipynb`` files here stay as
they are."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("fit_power_laws", "figure3", "figure5")


def main(names: list[str]) -> int:
    if {"-h", "--help"} & set(names):
        print(__doc__)
        return 0
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        print(
            f"no notebook {', '.join(unknown)}: the notebooks are {', '.join(NAMES)}",
            file=sys.stderr,
        )
        return 2
    default = HERE.parent / "runs" / "demo" / "results.jsonl"
    results = Path(os.environ.get("LMUSCALE_RESULTS", default)).resolve()
    if not results.is_file():
        print(
            f"{results}: no such results file. Run `make demo` first (it writes "
            f"{default.relative_to(HERE.parent)}), or set LMUSCALE_RESULTS to a sweep's "
            "results.jsonl.",
            file=sys.stderr,
        )
        return 1
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
    except ImportError as error:
        print(
            f"{error}: install the notebooks extra, pip install -e '.[notebooks]'", file=sys.stderr
        )
        return 1
    from lmuscale.files import atomic_write_bytes

    out = results.parent / "notebooks"
    out.mkdir(exist_ok=True)
    os.environ["LMUSCALE_RESULTS"] = str(results)  # the kernel inherits it
    for name in names or NAMES:
        notebook = nbformat.read(HERE / f"{name}.ipynb", as_version=4)
        # The kernel starts in this folder, as it does when Jupyter opens the notebook.
        client = NotebookClient(
            notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": HERE}}
        )
        try:
            client.execute()
        except CellExecutionError as error:
            print(f"analysis/{name}.ipynb failed:\n{error}", file=sys.stderr)
            return 1
        atomic_write_bytes(out / f"{name}.ipynb", nbformat.writes(notebook).encode())
        print(f"{name}: {out / name}.ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
