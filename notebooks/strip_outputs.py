"""Clear outputs and execution counts of notebooks before committing:
    python notebooks/strip_outputs.py [notebook.ipynb ...]   (default: every notebook here)"""

import sys
from pathlib import Path

import nbformat


def strip(path) -> bool:
    """Strip one notebook in place; True when it changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    after = nbformat.writes(nb)
    if after != before:
        Path(path).write_text(after)
    return after != before


if __name__ == "__main__":
    paths = sys.argv[1:] or sorted(Path(__file__).parent.glob("*.ipynb"))
    for p in paths:
        if strip(p):
            print(f"stripped {p}")
