"""Prompt sets kept in the repo: benchmark workloads and exactness-test prompts.

Each `NAME.jsonl` line is `{"messages": [...]}` in OpenAI chat format:
- `code_edit`: edit given code and reply with all of it — the answer quotes the prompt,
  so n-gram prompt lookup pays (DESIGN.md: ~4.5 tokens per pass);
- `summarize`: summarise a given paragraph — partial quoting;
- `chat`: free chat — little to quote (~1.3 tokens per pass).
"""

from __future__ import annotations

import json
import pathlib

WORKLOAD_DIR = pathlib.Path(__file__).parent
WORKLOADS = tuple(sorted(p.stem for p in WORKLOAD_DIR.glob("*.jsonl")))


def load_conversations(name: str) -> list[list[dict]]:
    """The conversations of workload `name`; unknown names raise `ValueError`."""
    path = WORKLOAD_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"unknown workload {name!r}; known: {list(WORKLOADS)}")
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def load_prompts(name: str, tokenizer) -> list[list[int]]:
    """Token ids of each conversation rendered with the model's chat template."""
    return [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in load_conversations(name)]
