"""Prompt sets kept in the repo: benchmark workloads and exactness-test prompts.

Each `NAME.jsonl` line is `{"messages": [...]}` in OpenAI chat format:
- `code_edit`: edit given code and reply with all of it — the answer quotes the prompt,
  so n-gram prompt lookup pays (DESIGN.md: ~4.5 tokens per pass);
- `summarize`: summarise a given paragraph — partial quoting;
- `chat`: free chat — little to quote (~1.3 tokens per pass).

Mixes are compositions of those files, no data of their own:
- `mix`: `code_edit`, `summarize` and `chat` interleaved round-robin.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

WORKLOAD_DIR = pathlib.Path(__file__).parent
#: name -> the workloads it interleaves, in order.
MIXES: dict[str, tuple[str, ...]] = {"mix": ("code_edit", "summarize", "chat")}
WORKLOADS = tuple(sorted(p.stem for p in WORKLOAD_DIR.glob("*.jsonl"))) + tuple(MIXES)


def interleave(parts: Sequence[Sequence]) -> list:
    """Round-robin over `parts`; a part that runs out drops out of the rotation.

    >>> interleave([["a0", "a1", "a2"], ["b0"], ["c0", "c1"]])
    ['a0', 'b0', 'c0', 'a1', 'c1', 'a2']
    """
    return [part[i] for i in range(max(map(len, parts), default=0)) for part in parts if i < len(part)]


def load_conversations(name: str) -> list[list[dict]]:
    """The conversations of workload `name` (a file or a mix); unknown names raise `ValueError`."""
    if name in MIXES:
        return interleave([load_conversations(part) for part in MIXES[name]])
    path = WORKLOAD_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"unknown workload {name!r}; known: {list(WORKLOADS)}")
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def load_prompts(name: str, tokenizer) -> list[list[int]]:
    """Token ids of each conversation rendered with the model's chat template, as the
    server prefills them (`Tokenizer.encode_chat`)."""
    return [tokenizer.encode_chat(c) for c in load_conversations(name)]
