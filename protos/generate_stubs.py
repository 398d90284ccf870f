"""Generate the Python stubs of `protos/splitspec/v1/*.proto` (the one script that does).

    python -m protos.generate_stubs            # rewrite the committed stubs
    python -m protos.generate_stubs --check    # exit 1 if they drift from the .proto files

Stubs are committed so that installing splitspec needs no protoc; a test runs `--check`.
They are produced with the grpcio-tools version pinned in pyproject.toml.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_SUBDIR = pathlib.Path("protos", "splitspec", "v1")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: pathlib.Path, repo_root: pathlib.Path = REPO_ROOT) -> dict[str, bytes]:
    """Compile `repo_root/protos/splitspec/v1/*.proto` into `out_root`; return {name: bytes}."""
    from grpc_tools import protoc

    protos = sorted((repo_root / PROTO_SUBDIR).glob("*.proto"))
    args = ["protoc", f"-I{repo_root}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *[str(p.relative_to(repo_root)) for p in protos]]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return {p.name: p.read_bytes() for p in (out_root / PROTO_SUBDIR).iterdir() if p.name.endswith(SUFFIXES)}


def committed_stubs(repo_root: pathlib.Path = REPO_ROOT) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (repo_root / PROTO_SUBDIR).iterdir() if p.name.endswith(SUFFIXES)}


def drifted(repo_root: pathlib.Path = REPO_ROOT) -> list[str]:
    """Names of stubs that differ from, or are missing next to, what the .proto files give."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp), repo_root)
    committed = committed_stubs(repo_root)
    return sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report drift")
    args = parser.parse_args(argv)
    if args.check:
        bad = drifted()
        if bad:
            print(f"stubs drift from the .proto files: {bad}; run python -m protos.generate_stubs", file=sys.stderr)
            return 1
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in generate(pathlib.Path(tmp)).items():
            (REPO_ROOT / PROTO_SUBDIR / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
