"""Every notebook under notebooks/ executes without errors (nbclient, kernel python3), and is
committed with its outputs stripped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user"], check=True)
    return "python3"


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"cell {i} has outputs; run notebooks/strip_outputs.py"
            assert cell.execution_count is None, f"cell {i} has an execution count"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executes_without_errors(path, kernel, tmp_path):
    nb = nbformat.read(path, as_version=4)
    # The kernel uses JAX's persistent compilation cache, as this test process does (conftest):
    # LLM() itself leaves jax.config alone, and compiling every program afresh costs minutes.
    nb.cells.insert(0, nbformat.v4.new_code_cell(_CACHE_ON))
    env_dir = str(path.parent)
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=600,
                                     resources={"metadata": {"path": env_dir}})
    client.execute()          # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    # a plot was drawn (quickstart: throughput against batch size; lora_finetune: the training loss)
    assert any(o.output_type == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    nbformat.write(nb, tmp_path / path.name)     # the executed copy, for a look when it fails


_CACHE_ON = ("from jaxserve.engine.llm_engine import enable_compilation_cache\n"
             "enable_compilation_cache(None)")

_LIFETIME = _CACHE_ON + r"""
import gc, json, sys
from jaxserve import LLM, SamplingParams

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
          kv_cache_memory_bytes=32 << 20, warmup=False)
rss, deleted = [], []
for i in range(4):
    with LLM(**kw) as llm:          # as a notebook cell re-run would: create, use, free
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
        arrays = [llm.llm_engine.runner.cache.k, llm.llm_engine.runner.cache.v]
    deleted.append(all(a.is_deleted() for a in arrays))
    del llm, arrays
    gc.collect()
    rss.append(rss_mib())
try:
    LLM(**kw).shutdown() or None
    llm = LLM(**kw); llm.shutdown(); llm.generate("Hi")
    after_shutdown = "no error"
except RuntimeError as e:
    after_shutdown = str(e)
print(json.dumps({"rss": rss, "deleted": deleted, "after_shutdown": after_shutdown,
                  "repr": repr(llm)}))
"""


@pytest.mark.slow
def test_llm_shutdown_frees_memory_across_recreation():
    """Re-running `llm = LLM(...)` in a notebook must not pile up device memory: shutdown (or
    the context manager) deletes the KV cache arrays, and four create/free rounds keep the
    process RSS flat (each round's weights alone are ~0.5 GiB in f32)."""
    out = subprocess.run([sys.executable, "-c", _LIFETIME], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(result["deleted"])
    growth = result["rss"][-1] - result["rss"][0]
    assert growth < 200, f"RSS grew {growth:.0f} MiB over 3 re-creations: {result['rss']}"
    assert "shut down" in result["after_shutdown"]
    assert result["repr"] == "LLM(shut down)"
