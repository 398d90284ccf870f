"""One OpenMP team per process (`verifier.models.threads`): counted as OS threads in a
fresh interpreter, so that no other test's torch work is in the count.

With torch at 2 threads, a thread that runs a parallel op owns a team of 1 more thread;
the expectations below are those counts, worked by hand."""

import json
import subprocess
import sys

import pytest

from verifier.models.threads import _openmp_runtime

pytestmark = pytest.mark.skipif(_openmp_runtime() is None, reason="torch has no OpenMP runtime with pause")


def _run(code: str) -> dict:
    prelude = (
        "import json, os, torch\n"
        "torch.set_num_threads(2)\n"
        "import time\n"
        "def count():\n"  # once settled: a freed team's threads exit just after the call returns
        "    last = None\n"
        "    for _ in range(25):\n"
        "        n = len(os.listdir('/proc/self/task'))\n"
        "        if n == last:\n"
        "            return n\n"
        "        last = n\n"
        "        time.sleep(0.2)\n"
        "    return n\n"
        "x = torch.randn(1024, 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_frees_only_the_calling_threads_team():
    got = _run(
        "from verifier.models.threads import release_openmp_threads, run_on_cpu_worker\n"
        "n0 = count()\n"
        "x @ x\n"
        "main = count()\n"                      # + main's team member
        "run_on_cpu_worker(lambda: x @ x)\n"
        "both = count()\n"                      # + the worker and its team member
        "ok = release_openmp_threads()\n"
        "after = count()\n"                     # - main's team member
        "again = run_on_cpu_worker(release_openmp_threads)\n"  # not on the model thread
        "print(json.dumps(dict(n0=n0, main=main, both=both, ok=ok, after=after, again=again, last=count())))\n")
    n0 = got["n0"]
    assert (got["main"], got["both"], got["after"], got["last"]) == (n0 + 1, n0 + 3, n0 + 2, n0 + 2)
    assert got["ok"] is True and got["again"] is False


def test_an_engine_leaves_one_team_after_loading_on_another_thread():
    # The model is loaded (and its KV cache allocated) on the main thread, the passes run
    # on the model thread: afterwards only the model thread's team is left, however much
    # torch work the loading did on main.
    got = _run(
        "import asyncio\n"
        "from verifier.models.loader import load_model_and_tokenizer\n"
        "from verifier.engine import Engine, EngineConfig\n"
        "from verifier.sampling_params import SamplingParams\n"
        "n0 = count()\n"
        "model, tok = load_model_and_tokenizer(None, None, 'float32')\n"
        "x @ x\n"
        "loaded = count()\n"
        "engine = Engine(model, tok, EngineConfig(max_num_seqs=4))\n"
        "ids = tok.encode('The capital of France is')\n"
        "res = asyncio.run(engine.generate_all([ids] * 4, SamplingParams(max_tokens=8, temperature=0.0)))\n"
        "print(json.dumps(dict(n0=n0, loaded=loaded, done=count(), tokens=[len(r.token_ids) for r in res])))\n")
    n0 = got["n0"]
    assert got["loaded"] == n0 + 1  # main's team member
    assert got["tokens"] == [8] * 4
    assert got["done"] == n0 + 2  # the model thread and its team member; main's is gone
