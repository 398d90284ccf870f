"""`splitspec train draft`: distil a small draft model from the target, on CPU.

The recipe (every step is deterministic for a given seed, corpus and thread count):

1. **Corpus** (cached in `OUT/corpus.pt`, so a resumed run does not rebuild it):
   - the target's own greedy answers to the prompt set kept in the repo
     (`proposers/data/train_prompts.jsonl`), plus prompts built from the local Python
     standard library: "summarise this docstring" and "add a docstring to this function"
     (self-distillation, as EAGLE and Medusa do: the draft learns what *this* target says);
     with `self_prompts`, also the chat prompts the target wrote itself
     (`proposers/data/self_prompts.jsonl`, `splitspec train prompts`, as in Magpie);
   - chunks of standard-library source, labelled with the target's argmax at each
     position (teacher forcing), so the draft also learns the target on code.
   A few answers are held out to measure top-1 agreement with the target.
   The answers come from the serving engine itself (`engine_answers`: continuous batching
   and n-gram speculation, whose greedy output is the target's own tokens). They are the
   costly part of a recipe, so those of the bundled target are kept in the repo
   (`proposers/data/target_answers.jsonl.gz`, `AnswerCache`): a run generates only the
   answers the file lacks and adds them to it (`splitspec train answers` does only that).
   The file also pins them: batch composition can flip a token where the target's top two
   logits tie within float rounding, so two fresh runs may differ there.
2. **Vocabulary subset**: the `vocab_subset` ids the target emits most often in that corpus
   (plus its EOS ids), as in FR-Spec / EAGLE-3. The draft's LM head has one row per subset
   id, so a draft step costs a fraction of a full 49,152-row head; its argmax column c is
   the target id `vocab_ids[c]`, exactly. A target token outside the subset is simply never
   drafted (the verifier then emits it as the bonus token).
3. **Model**: `len(init_layers)` Llama decoder layers initialised from those layers of the
   target, then the target's final norm; the input embeddings and the LM head rows are the
   target's own and stay frozen, so the saved asset holds only the layers and the norm
   (loaded with the target's embeddings by `load_trained_draft`).
4. **Training**: cross-entropy against the target's next token (its greedy choice), AdamW
   with warm-up and cosine decay, gradient clipping; a checkpoint every
   `checkpoint_every` steps (`--resume` continues from it).
5. **Output** (`OUT/`): `model.safetensors` (bfloat16 layers and norm, int32 `vocab_ids`),
   `config.json` (HF Llama config plus a `splitspec` block: base model, vocabulary
   fingerprint sha256, weights sha256) and `train_info.json` (the command, the recipe,
   corpus sizes, held-out agreement, timings).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import gzip
import hashlib
import json
import logging
import math
import pathlib
import re
import sys
import sysconfig
import time
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from verifier.models.llama import LlamaModel, dense, rotate_half
from verifier.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PROMPTS_PATH = pathlib.Path(__file__).parent / "data" / "train_prompts.jsonl"
#: Where `splitspec train draft` writes by default, and where the draft proposer looks for
#: the draft trained for the bundled model.
BUNDLED_DRAFT_DIR = pathlib.Path(__file__).parent / "assets" / "smollm2-135m-draft"
#: Where `splitspec train eagle` writes an EAGLE-1 head by default (the committed one's).
BUNDLED_EAGLE_DIR = pathlib.Path(__file__).parent / "assets" / "smollm2-135m-eagle"
#: Where `splitspec train eagle --arch eagle3` writes by default (the committed EAGLE-3 head's).
BUNDLED_EAGLE3_DIR = pathlib.Path(__file__).parent / "assets" / "smollm2-135m-eagle3"
#: The head the eagle proposer loads without a `path`: the EAGLE-3 one, which drafts better
#: on every workload of the benchmark at the EAGLE-1 head's cost per call (README, "Training
#: proposers").
DEFAULT_EAGLE_DIR = BUNDLED_EAGLE3_DIR
CONFIG_FILE, WEIGHTS_FILE, INFO_FILE = "config.json", "model.safetensors", "train_info.json"
#: The bundled target's greedy answers to the training prompts (`AnswerCache`), kept in the repo.
ANSWERS_PATH = pathlib.Path(__file__).parent / "data" / "target_answers.jsonl.gz"
#: Chat prompts the bundled target wrote itself (`splitspec train prompts`), kept in the repo.
SELF_PROMPTS_PATH = pathlib.Path(__file__).parent / "data" / "self_prompts.jsonl"


@dataclasses.dataclass(frozen=True)
class TrainDraftConfig:
    #: Target layers copied as the draft's initial layers (their number is the draft's depth).
    init_layers: tuple[int, ...] = (0, 1, 29)
    #: Rows of the draft's LM head: the most frequent target tokens of the corpus.
    vocab_subset: int = 8192
    #: Prompts from the repo's prompt set (all when 0), and prompts built from the stdlib.
    num_prompts: int = 0
    num_docstring_prompts: int = 64
    num_function_prompts: int = 64
    #: Also the chat prompts the target wrote itself (`SELF_PROMPTS_PATH`, all of them).
    self_prompts: bool = False
    #: Longest answer the target writes per prompt.
    max_answer_tokens: int = 128
    #: Tokens of standard-library source labelled by the target.
    source_tokens: int = 30_000
    source_chunk: int = 256
    #: Held-out answers for the agreement figure.
    eval_sequences: int = 40
    steps: int = 450
    tokens_per_step: int = 6144
    lr: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 20
    eval_every: int = 40
    generate_batch: int = 32
    seed: int = 0
    #: Read and extend the repo's cache of the bundled target's answers (`ANSWERS_PATH`);
    #: off, or for another target, every answer is generated.
    answer_cache: bool = True
    #: Distil the target's distribution, not only its token (as EAGLE's classification loss
    #: does): the loss at each labelled position is the cross-entropy against the target's
    #: probabilities of its `distil_top` likeliest tokens of the vocabulary subset (softmax
    #: over the subset, renormalised over those), from one target pass over the corpus
    #: (`target_features`); 0: the target's token alone.
    distil_top: int = 0
    #: A proposer trained before by this recipe (for the draft: a `splitspec train draft`
    #: output with as many layers as `init_layers`; for EAGLE: a head, e.g. the committed
    #: one) whose weights the training starts from, instead of the target's layers: more
    #: training of a proposer whose checkpoint is gone, with a fresh optimiser and
    #: learning-rate schedule.
    init_from: str | None = None

    def __post_init__(self) -> None:
        if not self.init_layers:
            raise ValueError("init_layers must name at least one target layer")
        for name in ("vocab_subset", "steps", "tokens_per_step", "generate_batch", "max_answer_tokens",
                     "source_chunk", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_prompts", "num_docstring_prompts", "num_function_prompts", "source_tokens",
                     "eval_sequences", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.distil_top <= self.vocab_subset:
            raise ValueError(f"distil_top must be in [0, vocab_subset = {self.vocab_subset}], got {self.distil_top}")


# ---------------------------------------------------------------------------- corpus
def stdlib_files() -> list[pathlib.Path]:
    """The standard library's own .py files (no site-packages, no tests), sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def stdlib_prompts(num_docstrings: int, num_functions: int, rng: np.random.Generator) -> list[str]:
    """"Summarise this docstring" and "add a docstring to this function" prompts drawn
    from the standard library (docstrings of 300-1500 characters; undocumented functions
    of 4-25 lines)."""
    docs: list[str] = []
    funcs: list[str] = []
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and 300 <= len(doc) <= 1500:
                    docs.append(doc)
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) is None:
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= 25:
                    funcs.append(_dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])))
    pick = lambda xs, n: [xs[i] for i in sorted(rng.permutation(len(xs))[: min(n, len(xs))])]
    out = [f"Summarize the following text in two sentences.\n\n{d}" for d in pick(docs, num_docstrings)]
    out += [f"Add a docstring to this function. Reply with the full code only.\n\n```\n{f}\n```"
            for f in pick(funcs, num_functions)]
    return out


def _dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code)


def load_prompt_set(path: pathlib.Path = PROMPTS_PATH) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def answer_engine(model: LlamaModel, tokenizer: Tokenizer, batch: int, max_model_len: int, max_waiting: int,
                  controller=None):
    """The serving engine that writes the corpus answers: `batch` slots, n-gram drafts under
    `controller` (default: the goodput controller, which profiles the step time first)."""
    from proposers.ngram import NgramProposer
    from verifier.controller import Controller, ControllerSettings
    from verifier.engine import Engine, EngineConfig

    controller = controller or Controller(ControllerSettings(policy="goodput"), ("ngram",))
    config = EngineConfig(max_num_seqs=batch, max_model_len=max_model_len, max_waiting=max_waiting)
    return Engine(model, tokenizer, config, {"ngram": NgramProposer()}, controller)


def engine_answers(engine, prompts: list[list[int]], max_tokens: int, progress=None) -> list[list[int]]:
    """The target's greedy continuation of each prompt (up to and including an EOS id, at
    most `max_tokens`), made by the serving engine (`answer_engine`): continuous batching,
    n-gram speculation. Greedy speculation emits exactly the target's own tokens. Unlike
    plain batched decoding, which waits for a batch's longest answer, it keeps every slot
    busy and drafts what the answers quote; by how much that is faster on the prompt set
    is not measured yet."""
    from verifier.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def one(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params):
            tokens.extend(out.token_ids)
        if progress is not None:
            progress(1)
        return tokens

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run()) if prompts else []


@torch.inference_mode()
def teacher_labels(model: LlamaModel, chunks: list[list[int]], progress=None) -> list[list[int]]:
    """The target's argmax after each position of each chunk (teacher forcing)."""
    cache = model.new_cache(1, max(len(c) for c in chunks))
    out = []
    for chunk in chunks:
        slot = cache.allocate()
        logits = model.forward(torch.tensor(chunk, dtype=torch.int64), [slot], [len(chunk)], cache)
        out.append(logits.argmax(-1).tolist())
        cache.free(slot)
        if progress is not None:
            progress(1)
    return out


def source_chunks(tokenizer: Tokenizer, num_tokens: int, chunk: int, rng: np.random.Generator) -> list[list[int]]:
    files = stdlib_files()
    chunks: list[list[int]] = []
    total = 0
    for i in rng.permutation(len(files)):
        try:
            ids = tokenizer.encode(files[i].read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        for s in range(0, len(ids) - chunk // 2, chunk):
            chunks.append(ids[s : s + chunk])
            total += len(chunks[-1])
            if total >= num_tokens:
                return chunks
    return chunks


class AnswerCache:
    """A target's greedy answers by prompt, in a gzip JSON-lines file.

    Line 1 is `{"model": ID}` (the bundled target: `bundled:<GGUF sha256>`); then one
    `{"prompt_sha256": ..., "max_tokens": N, "answer": [ids]}` per prompt, where the prompt
    is the hash of its token ids (chat template applied) and the answer its greedy
    continuation, stopped at an EOS id (kept) or after N tokens. A file written for another
    model is ignored and replaced on `save`.

    A greedy answer's first n tokens are the answer at max_tokens n, so an entry serves any
    request for at most its own N tokens (or any N at all, if it ended at an EOS)."""

    def __init__(self, path: pathlib.Path, model_id: str, eos_ids) -> None:
        self.path, self.model_id, self.eos_ids = pathlib.Path(path), model_id, set(eos_ids)
        self._entries: dict[str, tuple[int, list[int]]] = {}
        if self.path.is_file():
            with gzip.open(self.path, "rt", encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
            if lines and lines[0].get("model") == model_id:
                for e in lines[1:]:
                    self._entries[e["prompt_sha256"]] = (int(e["max_tokens"]), list(e["answer"]))

    @staticmethod
    def key(prompt: list[int]) -> str:
        return hashlib.sha256(np.asarray(prompt, dtype=np.int64).tobytes()).hexdigest()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: list[int], max_tokens: int) -> list[int] | None:
        entry = self._entries.get(self.key(prompt))
        if entry is None:
            return None
        n, answer = entry
        ended = bool(answer) and answer[-1] in self.eos_ids
        if max_tokens <= n or ended:
            return answer[:max_tokens]
        return None  # shorter than asked for, and not finished

    def put(self, prompt: list[int], max_tokens: int, answer: list[int]) -> None:
        k = self.key(prompt)
        old = self._entries.get(k)
        if old is None or max_tokens >= old[0]:
            self._entries[k] = (max_tokens, list(answer))

    def save(self) -> None:
        """Write the file whole (entries sorted by key, gzip without a timestamp), atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
            lines = [{"model": self.model_id}] + [{"prompt_sha256": k, "max_tokens": n, "answer": a}
                                                  for k, (n, a) in sorted(self._entries.items())]
            gz.write("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode())
        tmp.replace(self.path)


def bundled_answer_cache(base: str, cfg: "TrainDraftConfig", eos_ids) -> AnswerCache | None:
    """The repo's answer cache when the recipe asks for it and the target is the bundled model."""
    if not cfg.answer_cache or base != "bundled":
        return None
    from verifier.models.bundled import BUNDLED_SHA256

    return AnswerCache(ANSWERS_PATH, f"bundled:{BUNDLED_SHA256}", eos_ids)


def cached_greedy_answers(model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]], max_tokens: int,
                          batch: int, cache: AnswerCache | None, progress=None,
                          controller=None) -> tuple[list[list[int]], int]:
    """The target's greedy answers (`engine_answers`), taking what `cache` holds and adding
    the rest to it (saved after every `8 * batch` new answers, so an interrupted run keeps
    its work). Returns the answers and how many came from the cache."""
    answers = [None if cache is None else cache.get(p, max_tokens) for p in prompts]
    hits = sum(a is not None for a in answers)
    if progress is not None and hits:
        progress(hits)
    missing = [i for i, a in enumerate(answers) if a is None]
    if not missing:
        return answers, hits
    engine = answer_engine(model, tokenizer, batch, max(len(prompts[i]) for i in missing) + max_tokens + 16,
                           len(missing), controller)
    step = 8 * batch if cache is not None else len(missing)
    for start in range(0, len(missing), step):
        chunk = missing[start : start + step]
        for i, a in zip(chunk, engine_answers(engine, [prompts[i] for i in chunk], max_tokens, progress)):
            answers[i] = a
            if cache is not None:
                cache.put(prompts[i], max_tokens, a)
        if cache is not None:
            cache.save()
    return answers, hits


@dataclasses.dataclass
class Corpus:
    #: Training sequences: token ids, and per position the target's next token (-1: no loss).
    train: list[tuple[list[int], list[int]]]
    held_out: list[tuple[list[int], list[int]]]
    stats: dict


def recipe_prompts(tokenizer: Tokenizer, cfg: TrainDraftConfig, rng: np.random.Generator) -> list[list[int]]:
    """The recipe's prompts as token ids (chat template applied): the first `num_prompts`
    of the repo's prompt set (all when 0), then the standard-library prompts drawn by `rng`,
    then (`self_prompts`) the prompts the target wrote itself."""
    convs = load_prompt_set()
    if cfg.num_prompts:
        convs = convs[: cfg.num_prompts]
    texts = [c[0]["content"] for c in convs] + stdlib_prompts(cfg.num_docstring_prompts, cfg.num_function_prompts, rng)
    if cfg.self_prompts:
        if not SELF_PROMPTS_PATH.is_file():
            raise ValueError(f"self_prompts: {SELF_PROMPTS_PATH.name} is missing; `splitspec train prompts` writes it")
        texts += [c[0]["content"] for c in load_prompt_set(SELF_PROMPTS_PATH)]
    return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def fill_answer_cache(target: LlamaModel, tokenizer: Tokenizer, cfg: TrainDraftConfig, base: str,
                      log=print) -> dict:
    """`splitspec train answers`: generate the recipe's answers that the repo's cache lacks
    and add them to it, without training (answers are the slow part of a recipe, so they
    can be made ahead, e.g. for more prompts than the last run used)."""
    cache = bundled_answer_cache(base, cfg, tokenizer.eos_token_ids)
    if cache is None:
        raise ValueError("the answer cache holds the bundled target's answers only (and answer_cache must be on)")
    prompts = recipe_prompts(tokenizer, cfg, np.random.default_rng(cfg.seed))
    t0 = time.perf_counter()
    bar = _Progress(len(prompts), "target answers", log)
    answers, hits = cached_greedy_answers(target, tokenizer, prompts, cfg.max_answer_tokens, cfg.generate_batch,
                                          cache, bar.update)
    bar.close()
    return {"prompts": len(prompts), "cached": hits, "generated": len(prompts) - hits,
            "answer_tokens": sum(len(a) for a in answers), "cache_entries": len(cache),
            "seconds": round(time.perf_counter() - t0, 1)}


#: Words that say nothing of a prompt's topic (for `benchmark_guard`).
_GENERIC_WORDS = frozenset("""a about an and are as at be between can cup difference do does explain few for
fun fact give good how i in is it keep make me name of old on or play sentences short should small some
start suggest tell ten the three tips to way what while why write year you your""".split())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _stem(word: str) -> str:
    """A plural folded to its singular, roughly: octopuses, cats, rules -> octopus, cat, rule."""
    if word.endswith(("uses", "sses", "xes", "ches", "shes")):
        return word[:-2]
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")) else word


def benchmark_guard(workloads=("chat", "summarize", "code_edit")):
    """A predicate that is true for a text near a benchmark prompt of `workloads`: one that
    shares a run of eight words with one (quotes it), or holds two of a chat prompt's topic
    words, or its only one (its words outside `_GENERIC_WORDS`, plurals folded: "octopus"
    for "Tell me a fun fact about octopuses", "chess" and "rule" for "Can you explain the
    rules of chess in a few sentences?"). Self-written training prompts that it flags are
    dropped, so that none is on a benchmark prompt's topic."""
    from cluster.workloads import load_conversations

    runs: set[tuple[str, ...]] = set()
    topics: list[set[str]] = []
    for name in workloads:
        for conv in load_conversations(name):
            words = _words(" ".join(m["content"] for m in conv))
            runs.update(tuple(words[i : i + 8]) for i in range(len(words) - 7))
            if name == "chat":
                topics.append({_stem(w) for w in words if w not in _GENERIC_WORDS})

    def near(text: str) -> bool:
        words = _words(text)
        if any(tuple(words[i : i + 8]) in runs for i in range(len(words) - 7)):
            return True
        stems = {_stem(w) for w in words}
        return any(len(t & stems) >= min(len(t), 2) for t in topics if t)

    return near


def user_turn_prefix(tokenizer: Tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message begins (the system turn,
    then the user turn's header): what the target continues to write a user's prompt."""
    marker = "\x00splitspec\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    return tokenizer.encode(text[: text.index(marker)])


def select_self_prompts(samples: list[list[int]], tokenizer: Tokenizer, near) -> tuple[list[str], dict]:
    """The prompts kept from sampled user turns (token ids, ending at an EOS id when the
    turn ended), in order, and how many were dropped for each reason: unfinished (no EOS),
    short (fewer than 3 words), duplicate (the same words as a kept one, case and
    punctuation aside) and near_benchmark (`near`)."""
    eos = set(tokenizer.eos_token_ids)
    kept: list[str] = []
    seen: set[str] = set()
    counts = {"unfinished": 0, "short": 0, "duplicate": 0, "near_benchmark": 0}
    for ids in samples:
        if not ids or ids[-1] not in eos:
            counts["unfinished"] += 1
            continue
        text = tokenizer.decode(ids[:-1]).strip()
        words = " ".join(_words(text))
        reason = ("short" if len(text.split()) < 3 else "duplicate" if words in seen
                  else "near_benchmark" if near(text) else None)
        if reason:
            counts[reason] += 1
        else:
            seen.add(words)
            kept.append(text)
    return kept, counts


def write_self_prompts(target: LlamaModel, tokenizer: Tokenizer, num: int, seed: int = 0, batch: int = 32,
                       max_tokens: int = 64, temperature: float = 1.0, top_p: float = 0.95,
                       path: pathlib.Path = SELF_PROMPTS_PATH, log=print) -> dict:
    """`splitspec train prompts`: `num` chat prompts written by the target itself, as in
    Magpie: the target continues `user_turn_prefix` (sampled, request i seeded with
    `seed + i`), and what it writes up to its end-of-turn token is a user's prompt. Kept:
    samples that end within `max_tokens`, hold at least 3 words, are not a duplicate and
    are not near a benchmark prompt (`benchmark_guard`). `path` is rewritten whole, in the
    prompt set's format, in sampling order. Returns counts and timings.

    A rerun with the same seed writes nearly the same prompts, not always the very same:
    the engine's n-gram controller sizes its passes by measured step times, and float
    rounding in a pass of another size can flip a sampled token."""
    from verifier.sampling_params import SamplingParams

    prefix = user_turn_prefix(tokenizer)
    engine = answer_engine(target, tokenizer, batch, len(prefix) + max_tokens + 16, num)
    bar = _Progress(num, "self-written prompts", log)

    async def one(i: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + i)
        out: list[int] = []
        async for o in engine.generate(prefix, params):
            out.extend(o.token_ids)
        bar.update(1)
        return out

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(num))))

    t0 = time.perf_counter()
    samples = asyncio.run(run()) if num else []
    bar.close()
    kept, counts = select_self_prompts(samples, tokenizer, benchmark_guard())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in kept))
    return {"sampled": num, "kept": len(kept), **counts, "sampled_tokens": sum(map(len, samples)),
            "seconds": round(time.perf_counter() - t0, 1), "out": str(path)}


def build_corpus(model: LlamaModel, tokenizer: Tokenizer, cfg: TrainDraftConfig, log=print,
                 answer_cache: AnswerCache | None = None) -> Corpus:
    rng = np.random.default_rng(cfg.seed)
    prompts = recipe_prompts(tokenizer, cfg, rng)
    t0 = time.perf_counter()
    bar = _Progress(len(prompts), "target answers", log)
    answers, cached = cached_greedy_answers(model, tokenizer, prompts, cfg.max_answer_tokens, cfg.generate_batch,
                                            answer_cache, bar.update)
    bar.close()
    t_answers = time.perf_counter() - t0
    seqs = []
    for p, a in zip(prompts, answers):
        # Position len(p) - 1 + j predicts answer token j (the target's greedy choice).
        labels = [-1] * (len(p) - 1) + a
        seqs.append((p + a[:-1], labels))
    order = rng.permutation(len(seqs))
    held = [seqs[i] for i in order[: cfg.eval_sequences]]
    train = [seqs[i] for i in order[cfg.eval_sequences :]]
    t0 = time.perf_counter()
    chunks = source_chunks(tokenizer, cfg.source_tokens, cfg.source_chunk, rng) if cfg.source_tokens else []
    if chunks:
        bar = _Progress(len(chunks), "source labels", log)
        train += list(zip(chunks, teacher_labels(model, chunks, bar.update)))
        bar.close()
    stats = {
        "prompts": len(prompts),
        "answer_tokens": sum(len(a) for a in answers),
        "answers_s": round(t_answers, 1),
        "answers_cached": cached,
        "source_tokens": sum(len(c) for c in chunks),
        "source_s": round(time.perf_counter() - t0, 1),
        "train_sequences": len(train),
        "held_out_sequences": len(held),
    }
    return Corpus(train, held, stats)


def frequent_ids(corpus: Corpus, size: int, vocab_size: int, always: set[int]) -> np.ndarray:
    """The `size` target ids most often labelled in the training corpus (ties: lower id
    first), always including `always` (EOS ids), sorted by id."""
    counts = np.zeros(vocab_size, np.int64)
    for _, labels in corpus.train:
        lab = np.asarray(labels)
        np.add.at(counts, lab[lab >= 0], 1)
    return most_counted(counts, size, always).astype(np.int32)


def most_counted(counts: np.ndarray, size: int, always) -> np.ndarray:
    """The `size` ids of the highest `counts` (ties: lower id first), always including
    `always`, sorted by id (int64). `counts` is changed in place for `always`."""
    for i in always:
        counts[i] = np.iinfo(np.int64).max
    ranked = np.lexsort((np.arange(counts.size), -counts))[: min(size, counts.size)]
    return np.sort(ranked).astype(np.int64)


# ---------------------------------------------------------------------------- model
class _Layer(nn.Module):
    def __init__(self, w) -> None:  # dense(): a serving engine may have packed the target's layers
        super().__init__()
        self.input_norm = nn.Parameter(w.input_norm.float().clone())
        self.wqkv = nn.Parameter(dense(w.wqkv).float().clone())
        self.bqkv = None if w.bqkv is None else nn.Parameter(w.bqkv.float().clone())
        self.wo = nn.Parameter(dense(w.wo).float().clone())
        self.post_norm = nn.Parameter(w.post_norm.float().clone())
        self.w_gate_up = nn.Parameter(dense(w.w_gate_up).float().clone())
        self.w_down = nn.Parameter(dense(w.w_down).float().clone())


def copy_layer(layer: _Layer, w, source: str, input_norm: bool = True) -> None:
    """Set a layer under training to a loaded one's weights (`LayerWeights`, e.g. of a
    trained proposer): its projections, post-attention norm, q/k/v biases (which both must
    have or lack) and, unless `input_norm` is False, its input norm."""
    if (layer.bqkv is None) != (w.bqkv is None):
        raise ValueError(f"{source}'s q/k/v biases do not match the target layer's")
    names = ("wqkv", "wo", "post_norm", "w_gate_up", "w_down") + (("input_norm",) if input_norm else ())
    with torch.no_grad():
        for name in names:
            getattr(layer, name).copy_(dense(getattr(w, name)))
        if layer.bqkv is not None:
            layer.bqkv.copy_(w.bqkv)


def subset_head(target: LlamaModel, vocab_ids: np.ndarray) -> torch.Tensor:
    """The target's LM-head rows of the vocabulary subset, float32 [S, hidden]: column c of
    a head or draft under training is target id `vocab_ids[c]`."""
    return target.lm_head.float()[torch.from_numpy(vocab_ids).long()].contiguous()


def soft_cross_entropy(logits: torch.Tensor, cols: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the cross-entropy of `logits` [N, S] against soft labels
    (`soft_labels`: columns int64 [N, K], probabilities [N, K])."""
    return -(p * F.log_softmax(logits, dim=-1).gather(1, cols)).sum(-1).mean()


def register_target_buffers(net: nn.Module, target: LlamaModel, vocab_ids: np.ndarray) -> None:
    """The frozen tensors a head or draft under training reads from the target (float32, not
    saved with it): `embed`, `head` (the LM-head rows of the vocabulary subset), `cos`, `sin`."""
    net.register_buffer("embed", target.embed.float(), persistent=False)
    net.register_buffer("head", subset_head(target, vocab_ids), persistent=False)
    net.register_buffer("cos", target._cos.float(), persistent=False)
    net.register_buffer("sin", target._sin.float(), persistent=False)


class DraftNet(nn.Module):
    """The draft for training: a plain causal decoder over padded [B, L] batches, with the
    same weight layout as `verifier.models.llama.LayerWeights`."""

    def __init__(self, target: LlamaModel, init_layers: tuple[int, ...], vocab_ids: np.ndarray) -> None:
        super().__init__()
        c = target.config
        self.config = c
        self.layers = nn.ModuleList(_Layer(target.layers[i]) for i in init_layers)
        self.norm = nn.Parameter(target.final_norm.float().clone())
        register_target_buffers(self, target, vocab_ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [B, L] -> hidden states after the final norm [B, L, hidden]."""
        c = self.config
        h = F.embedding(ids, self.embed)
        for layer in self.layers:
            h = decoder_layer(h, layer, c, self.cos, self.sin)
        return F.rms_norm(h, (c.hidden_size,), self.norm, c.rms_norm_eps)


def decoder_layer(h: torch.Tensor, layer: _Layer, c, cos: torch.Tensor, sin: torch.Tensor,
                  input_norm: bool = True) -> torch.Tensor:
    """One Llama decoder layer over padded rows h [B, L, hidden] with plain causal attention
    (the training form of `verifier.models.llama`); `input_norm=False` skips the input norm
    (an EAGLE head's layer). cos, sin: the model's [max_position, head_dim] tables."""
    B, L, _ = h.shape
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    cos, sin = cos[:L].view(1, L, 1, D), sin[:L].view(1, L, 1, D)
    x = F.rms_norm(h, (c.hidden_size,), layer.input_norm, c.rms_norm_eps) if input_norm else h
    qkv = F.linear(x, layer.wqkv, layer.bqkv)
    qk = qkv[..., : (H + Hkv) * D].view(B, L, H + Hkv, D)
    qk = qk * cos + rotate_half(qk) * sin
    q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
    v = qkv[..., (H + Hkv) * D :].view(B, L, Hkv, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = h + F.linear(o.transpose(1, 2).reshape(B, L, H * D), layer.wo)
    x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
    gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, layer.w_down)


def length_groups(lengths: list[int], tokens_per_step: int, rng: np.random.Generator) -> Iterator[list[int]]:
    """Endless groups of sequence indices of about `tokens_per_step` padded tokens each:
    sequences of similar length together (sorted within windows of 64, so a batch pads
    little but epochs still differ), the order reshuffled every epoch."""
    while True:
        order = rng.permutation(len(lengths))
        groups: list[list[int]] = []
        for i in range(0, len(order), 64):
            cur: list[int] = []
            for j in sorted(order[i : i + 64], key=lambda j: lengths[j]):
                if cur and lengths[j] * (len(cur) + 1) > tokens_per_step:  # sorted: j is the longest
                    groups.append(cur)
                    cur = []
                cur.append(int(j))
            if cur:
                groups.append(cur)
        for g in rng.permutation(len(groups)):
            yield groups[g]


@torch.inference_mode()
def target_features(model: LlamaModel, seqs: list[tuple[list[int], list[int]]], progress=None,
                    hidden_layers: tuple[int, ...] | None = None, soft: tuple[torch.Tensor, int] | None = None
                    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The target's final hidden states (bfloat16 [len, hidden]) of every position of each
    sequence; with `hidden_layers`, the states entering those layers ([len, n * hidden]).

    `soft` = (the LM-head rows of the vocabulary subset [S, hidden], K): also each
    position's soft label (`soft_labels`), as a second list."""
    cache = model.new_cache(1, max(len(x) for x, _ in seqs))
    H = model.config.hidden_size
    layers = None if hidden_layers is None else tuple(hidden_layers) + ((len(model.layers),) if soft else ())
    out, labels = [], []
    for ids, _ in seqs:
        slot = cache.allocate()
        last = torch.tensor([len(ids) - 1])
        _, hidden = model.forward(torch.tensor(ids, dtype=torch.int64), [slot], [len(ids)], cache, last,
                                  hidden_index=torch.arange(len(ids)), hidden_layers=layers)
        if soft is not None:
            if hidden_layers is None:
                final = hidden
            else:  # the last layer's output, before the final norm
                hidden, final = hidden[:, :-H], F.rms_norm(hidden[:, -H:].float(), (H,), model.final_norm.float(),
                                                           model.config.rms_norm_eps)
            labels.append(soft_labels(final.float() @ soft[0].t(), soft[1]))
        out.append(hidden.to(torch.bfloat16))
        cache.free(slot)
        if progress is not None:
            progress(1)
    return out if soft is None else (out, labels)


def soft_labels(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's soft label at each position from its logits over the vocabulary subset
    [n, S]: (the subset columns of its k likeliest tokens, int16 [n, k]; their probabilities
    under the softmax over the subset, renormalised over the k, float16 [n, k])."""
    top, cols = logits.float().topk(k, dim=-1)
    return cols.to(torch.int16), torch.softmax(top, dim=-1).to(torch.float16)


def _pad(seqs, group, remap) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(seqs[j][0]) for j in group)
    ids = np.zeros((len(group), L), np.int64)
    labels = np.full((len(group), L), -100, np.int64)
    for r, j in enumerate(group):
        x, y = seqs[j]
        ids[r, : len(x)] = x
        y = np.asarray(y)
        mapped = np.where(y >= 0, remap[np.maximum(y, 0)], -100)
        labels[r, : len(y)] = mapped
    return torch.from_numpy(ids), torch.from_numpy(labels)


def _pad_soft(soft, group, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft labels (`soft_labels`) of `group`'s sequences padded as `_pad` pads them:
    (columns int64 [B, L, K], probabilities [B, L, K]); position t's is its label's."""
    K = soft[group[0]][0].shape[1]
    cols = torch.zeros(len(group), length, K, dtype=torch.int64)
    p = torch.zeros(len(group), length, K)
    for r, j in enumerate(group):
        c, q = soft[j]
        cols[r, : c.shape[0]], p[r, : c.shape[0]] = c.long(), q.float()
    return cols, p


def _soft_labels_of(target: LlamaModel, seqs, vocab_ids: np.ndarray, k: int, out: pathlib.Path, resume: bool,
                    log=print) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's soft labels (`soft_labels`): one target pass per sequence, saved as
    OUT/soft_labels.pt, which `resume` reuses when its subset and k are these."""
    path = out / "soft_labels.pt"
    if resume and path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved["k"] == k and np.array_equal(saved["vocab_ids"], vocab_ids) and len(saved["labels"]) == len(seqs):
            log(f"soft labels: reused {path.name}")
            return saved["labels"]
    bar = _Progress(len(seqs), "target soft labels", log)
    _, labels = target_features(target, seqs, bar.update, soft=(subset_head(target, vocab_ids), k))
    bar.close()
    torch.save({"k": k, "vocab_ids": vocab_ids, "labels": labels}, path)
    return labels


@torch.no_grad()
def agreement(net: DraftNet, seqs, remap: np.ndarray) -> float:
    """Fraction of labelled positions where the draft's argmax is the target's token."""
    hit = total = 0
    for j in range(len(seqs)):
        ids, labels = _pad(seqs, [j], remap)
        pred = (net(ids) @ net.head.t()).argmax(-1)
        # Positions whose label is outside the subset count as misses.
        y = np.asarray(seqs[j][1])
        mask = torch.from_numpy(y >= 0)
        hit += int(((pred[0] == labels[0]) & mask).sum())
        total += int(mask.sum())
    return hit / max(total, 1)


def _lr(cfg: TrainDraftConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class _Progress:
    """A one-line progress bar on stderr (a plain line per 10% when not a terminal)."""

    def __init__(self, total: int, what: str, log=print) -> None:
        self.total, self.what, self.done, self.start = total, what, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def update(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        line = f"{self.what}: {self.done}/{self.total} [{elapsed:.0f}s elapsed, {eta:.0f}s left] {extra}"
        decile = self.done * 10 // max(self.total, 1)
        if self.tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif decile != self._last_decile:
            self._last_decile = decile
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------- recipe
def load_or_build_corpus(target: LlamaModel, tokenizer: Tokenizer, cfg: TrainDraftConfig, out: pathlib.Path,
                         reuse: pathlib.Path | None, log=print, base: str = "bundled") -> Corpus:
    """The corpus at `reuse` when it exists, else a fresh one (saved as OUT/corpus.pt),
    its answers taken from and added to the repo's answer cache (bundled target only)."""
    if reuse is not None and reuse.is_file():
        saved = torch.load(reuse, weights_only=False)
        corpus = Corpus(saved["train"], saved["held_out"], saved["stats"])
        log(f"corpus: reused {reuse.name} ({corpus.stats})")
        return corpus
    cache = bundled_answer_cache(base, cfg, tokenizer.eos_token_ids)
    if cache is not None:
        log(f"answer cache: {len(cache)} answers in {cache.path.name}")
    corpus = build_corpus(target, tokenizer, cfg, log, cache)
    torch.save(dataclasses.asdict(corpus), out / "corpus.pt")
    log(f"corpus: {corpus.stats}")
    return corpus


def vocab_subset(corpus: Corpus, size: int, vocab_size: int, eos_ids) -> tuple[np.ndarray, np.ndarray, float]:
    """(vocab_ids, remap: target id -> draft column or -100, share of training labels covered)."""
    vocab_ids = frequent_ids(corpus, size, vocab_size, set(eos_ids))
    remap = np.full(vocab_size, -100, np.int64)
    remap[vocab_ids] = np.arange(vocab_ids.size)
    labels = np.concatenate([np.asarray(y) for _, y in corpus.train])
    labels = labels[labels >= 0]
    return vocab_ids, remap, float((remap[labels] >= 0).mean())


def fit(net: nn.Module, cfg: TrainDraftConfig, out: pathlib.Path, batch_loss, batches_from, evaluate,
        resume: bool, log=print) -> tuple[list[dict], float]:
    """AdamW with warm-up and cosine decay, gradient clipping, held-out `evaluate()` every
    `eval_every` steps (a float, the agreement, or a dict of named figures) and a checkpoint
    every `checkpoint_every` (`resume` continues from it). `batches_from(step)` gives the
    batch iterator, `batch_loss(batch)` the loss.
    Returns (history, training seconds)."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, history = 0, []
    ckpt_path = out / "checkpoint.pt"
    if resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        step, history = ckpt["step"], ckpt["history"]
        log(f"resumed at step {step}")
    if step == 0:
        figures = _figures(evaluate())
        history.append({"step": 0, **figures})
        log(f"step 0: {_describe(figures)}")
    batches = batches_from(step)
    bar = _Progress(cfg.steps, "training", log)
    bar.done = step
    started = time.perf_counter()
    ewma = None
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        loss = batch_loss(next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        value = loss.item()
        ewma = value if ewma is None else 0.95 * ewma + 0.05 * value
        bar.update(1, f"loss {ewma:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            figures = _figures(evaluate())
            history.append({"step": step, "loss": round(ewma, 4), **figures})
            log(f"{chr(10) if bar.tty else ''}step {step}: loss {ewma:.3f}, {_describe(figures)}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "step": step, "history": history},
                       ckpt_path)
    bar.close()
    return history, time.perf_counter() - started


def _figures(value: float | dict) -> dict:
    """`evaluate()`'s result as history fields: a float is the held-out agreement."""
    figures = value if isinstance(value, dict) else {"held_out_agreement": value}
    return {k: round(v, 4) for k, v in figures.items()}


def _describe(figures: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ').replace('held out', 'held-out')} {v:.4f}" for k, v in figures.items())


def round_to_bfloat16(net: nn.Module) -> None:
    """The weights as they will be saved, so that the figures reported are theirs."""
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def write_outputs(out: pathlib.Path, target: LlamaModel, tokenizer: Tokenizer, num_layers: int, splitspec: dict,
                  info: dict, log=print, extra_config: dict | None = None) -> None:
    """config.json (an HF Llama config of the trained layers plus the `splitspec` block, to
    which the vocabulary fingerprint and the weights' sha256 are added; `extra_config` adds
    or replaces fields) and train_info.json."""
    from verifier.models.vocab import VocabFingerprint

    fp = VocabFingerprint.of(tokenizer)
    c = target.config
    config = {
        "model_type": c.architecture, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position,
        "tie_word_embeddings": True, "attention_bias": c.attention_bias, "torch_dtype": "bfloat16",
        "splitspec": {
            **splitspec,
            "tokenizer_fingerprint": {
                "vocab_type": fp.vocab_type, "vocab_size": fp.vocab_size, "bos_token_id": fp.bos_token_id,
                "eos_token_ids": list(fp.eos_token_ids), "token_texts_sha256": fp.token_texts_sha256,
            },
            "weights_sha256": hashlib.sha256((out / WEIGHTS_FILE).read_bytes()).hexdigest(),
        },
    }
    config.update(extra_config or {})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    info = {**info, "torch": torch.__version__, "threads": torch.get_num_threads()}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log(f"saved {out / WEIGHTS_FILE} ({(out / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB), "
        f"held-out agreement {info['held_out_agreement']:.4f}")


def train_draft(target: LlamaModel, tokenizer: Tokenizer, out_dir: str | pathlib.Path, cfg: TrainDraftConfig,
                base: str, command: str, resume: bool = False, log=print) -> dict:
    """Run the recipe (module docstring); returns the `train_info.json` dict."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    corpus = load_or_build_corpus(target, tokenizer, cfg, out, out / "corpus.pt" if resume else None, log, base)
    vocab_ids, remap, coverage = vocab_subset(corpus, cfg.vocab_subset, target.config.vocab_size,
                                              tokenizer.eos_token_ids)
    log(f"vocabulary subset: {vocab_ids.size} ids cover {coverage:.4f} of the training labels")
    net = DraftNet(target, cfg.init_layers, vocab_ids)
    if cfg.init_from:
        start_draft_from(net, cfg.init_from, target, tokenizer)
        log(f"starting from the draft in {cfg.init_from}")
    soft = _soft_labels_of(target, corpus.train, vocab_ids, cfg.distil_top, out, resume, log) if cfg.distil_top else None

    def batch_loss(batch) -> torch.Tensor:
        ids, y, labels = batch
        mask = y != -100
        logits = net(ids)[mask] @ net.head.t()
        if labels is None:
            return F.cross_entropy(logits, y[mask])
        cols, p = labels
        return soft_cross_entropy(logits, cols[mask], p[mask])

    def batches_from(step: int):
        # A resumed run draws a fresh, still deterministic, order.
        rng = np.random.default_rng(cfg.seed + 1 + step)
        lengths = [len(x) for x, _ in corpus.train]
        for g in length_groups(lengths, cfg.tokens_per_step, rng):
            ids, y = _pad(corpus.train, g, remap)
            yield ids, y, None if soft is None else _pad_soft(soft, g, ids.shape[1])

    history, train_s = fit(net, cfg, out, batch_loss, batches_from,
                           lambda: agreement(net, corpus.held_out, remap), resume, log)
    round_to_bfloat16(net)
    final = agreement(net, corpus.held_out, remap)
    save_draft(net, vocab_ids, out)
    info = {
        "command": command, "recipe": dataclasses.asdict(cfg), "corpus": corpus.stats,
        "vocab_subset_coverage": round(coverage, 4), "history": history, "held_out_agreement": round(final, 4),
        "train_s": round(train_s, 1), "total_s": round(time.perf_counter() - started, 1),
    }
    write_outputs(out, target, tokenizer, len(cfg.init_layers),
                  {"kind": "draft", "embeddings": "target", "base_model": base, "vocab_subset": int(vocab_ids.size)},
                  info, log)
    return info


def start_draft_from(net: DraftNet, path: str | pathlib.Path, target: LlamaModel, tokenizer: Tokenizer) -> None:
    """Set `net`'s trained weights (its layers and final norm) to the draft in `path`, loaded
    and checked as the proposer loads it (`load_trained_draft`: sha256, vocabulary, sizes).
    The LM-head rows are not taken: they are the target's, for this corpus's subset."""
    from proposers.draft_model import load_trained_draft
    from verifier.models.vocab import VocabFingerprint

    draft, _ = load_trained_draft(path, target, VocabFingerprint.of(tokenizer))
    if len(draft.layers) != len(net.layers):
        raise ValueError(f"{path}: a draft of {len(draft.layers)} layers cannot start one of {len(net.layers)} "
                         f"(init_layers)")
    for i, (mine, theirs) in enumerate(zip(net.layers, draft.layers)):
        copy_layer(mine, theirs, f"{path}: the draft's layer {i}")
    with torch.no_grad():
        net.norm.copy_(draft.final_norm.float())


def save_draft(net: DraftNet, vocab_ids: np.ndarray, out: pathlib.Path) -> None:
    """Write the layers (HF names, bfloat16), the final norm and `vocab_ids`."""
    tensors = {"model.norm.weight": net.norm.detach(), "splitspec.vocab_ids": torch.from_numpy(vocab_ids)}
    for i, layer in enumerate(net.layers):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = layer.input_norm.detach()
        tensors.update(layer_tensors(layer, net.config, f"model.layers.{i}"))
    save_bfloat16(tensors, out)


def layer_tensors(layer: _Layer, c, prefix: str) -> dict[str, torch.Tensor]:
    """The decoder layer's projections and post-attention norm under HF Llama names
    (`prefix.self_attn.q_proj.weight`, ...); the input norm is the caller's to name, as an
    EAGLE-1 head's layer has none."""
    H, Hkv, D, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    q, k, v = layer.wqkv.detach().split([H * D, Hkv * D, Hkv * D])
    gate, up = layer.w_gate_up.detach().split([I, I])
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
        f"{prefix}.self_attn.v_proj.weight": v, f"{prefix}.self_attn.o_proj.weight": layer.wo.detach(),
        f"{prefix}.post_attention_layernorm.weight": layer.post_norm.detach(),
        f"{prefix}.mlp.gate_proj.weight": gate, f"{prefix}.mlp.up_proj.weight": up,
        f"{prefix}.mlp.down_proj.weight": layer.w_down.detach(),
    }
    if layer.bqkv is not None:
        for name, b in zip("qkv", layer.bqkv.detach().split([H * D, Hkv * D, Hkv * D])):
            tensors[f"{prefix}.self_attn.{name}_proj.bias"] = b
    return tensors


def save_bfloat16(tensors: dict[str, torch.Tensor], out: pathlib.Path) -> None:
    """Write `tensors` to OUT/model.safetensors, floating-point ones as bfloat16."""
    from safetensors.torch import save_file

    tensors = {k: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for k, t in tensors.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
