"""Training data: text files, JSONL records and the Python standard library, as `Example`s.

Accepted inputs (`--data` takes several):
- a text file (any extension but .jsonl) or a directory of them: each file is one document;
- a `.jsonl` file, one record per line, each one of
  `{"text": ...}` (a document: every token is supervised),
  `{"prompt": ..., "completion": ...}` (loss on the completion and its EOS only),
  `{"messages": [{"role", "content"}, ...]}` (rendered with the chat template; loss on assistant turns);
- `stdlib`: the `.py` files of the running Python's standard library (present on every machine).

Documents longer than a sequence are cut into consecutive windows, each starting with <bos>.
Sampling is stateless: global example index -> (epoch, position in that epoch's permutation),
so a resumed or distributed run reads exactly the examples an uninterrupted single run would.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..inputs.tokenizer import Tokenizer
from .objective import Example

STDLIB = "stdlib"
# Generated tables and data blobs rather than code; skipped so the corpus is Python as people write it.
STDLIB_SKIP = ("site-packages/", "encodings/", "pydoc_data/", "lib2to3/tests/data/", "test/tokenizedata/")
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ""}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every .py file of the standard library except generated tables, sorted (a reproducible corpus)."""
    root = root or stdlib_root()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if not any(rel.startswith(s) or f"/{s}" in f"/{rel}" for s in STDLIB_SKIP) and p.is_file():
            files.append(p)
    return files


def held_out(name: str, fraction: float) -> bool:
    """Deterministic split by name: the same file is held out on every machine and every run."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def _read_text(path: Path, strict: bool = False) -> str:
    """A text file's contents. `strict` (the user's files): a file that is not UTF-8 is a one-line
    error naming it, not text with replacement characters trained on in silence."""
    if not strict:
        return path.read_text(encoding="utf-8", errors="replace")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); training data must be UTF-8") from None


def iter_records(paths: Iterable[str | Path]) -> Iterator[tuple[str, dict]]:
    """(name, record) for every document or JSONL record under `paths`; names are stable for splitting."""
    for spec in paths:
        if str(spec) == STDLIB:
            root = stdlib_root()
            for p in stdlib_files(root):
                yield f"stdlib/{p.relative_to(root).as_posix()}", {"text": _read_text(p)}
            continue
        path = Path(spec)
        if not path.exists():
            raise ValueError(f"training data {path} does not exist")
        files = sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else [path]
        for f in files:
            if f.suffix == ".jsonl":
                yield from _jsonl_records(f)
            elif path.is_file() or f.suffix in TEXT_SUFFIXES:
                yield str(f), {"text": _read_text(f, strict=True)}


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 (byte {e.start}: {e.reason}); JSONL must be UTF-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not (
                {"text"} <= rec.keys() or {"prompt", "completion"} <= rec.keys() or "messages" in rec
            ):
                raise ValueError(f'{path}:{n}: a record needs "text", "prompt" and "completion", or "messages"')
            yield f"{path}:{n}", rec


def document_examples(ids: list[int], seq_len: int, bos: int, eos: int) -> list[Example]:
    """Cut <doc> <eos> into windows of seq_len - 1 tokens, each prefixed by <bos>; all tokens supervised."""
    tokens = list(ids) + [eos]
    step = seq_len - 1
    out = []
    for s in range(0, len(tokens), step):
        chunk = tokens[s : s + step]
        out.append(Example([bos] + chunk, [False] + [True] * len(chunk), complete=s + step >= len(tokens)))
    return out


def prompt_completion_example(prompt: list[int], completion: list[int], seq_len: int, bos: int, eos: int) -> Example:
    """<bos> prompt completion <eos>, loss on completion + <eos>; long prompts lose their start."""
    completion = list(completion) + [eos]
    room = seq_len - 1
    keep_prompt = max(room - len(completion), min(len(prompt), room // 2))
    prompt = prompt[len(prompt) - keep_prompt :] if keep_prompt < len(prompt) else list(prompt)
    ids = [bos] + prompt + completion
    mask = [False] * (1 + len(prompt)) + [True] * len(completion)
    complete = len(ids) <= seq_len
    return Example(ids[:seq_len], mask[:seq_len], complete)


def chat_example(tok: Tokenizer, messages: list[dict], seq_len: int) -> Example:
    """Render a conversation with the chat template; supervise the tokens of assistant turns.

    An assistant turn's span is what rendering it adds after the generation prompt of the turns
    before it (its content and the end-of-turn token), which is exactly what generation produces.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tok.render_chat(messages[:i], add_generation_prompt=True) if i else ""
        upto = tok.render_chat(messages[: i + 1], add_generation_prompt=False)
        if not upto.startswith(before):
            raise ValueError("the chat template does not render conversations prefix by prefix; cannot find turns")
        spans.append((len(before), len(upto)))
    text = tok.render_chat(messages, add_generation_prompt=False)
    enc = tok._tok.encode(text, add_special_tokens=False)
    mask = [any(a <= s < b for a, b in spans) for s, _ in enc.offsets]
    ids = list(enc.ids)
    return Example(ids[:seq_len], mask[:seq_len], complete=len(ids) <= seq_len)


def record_examples(tok: Tokenizer, rec: dict, seq_len: int) -> list[Example]:
    bos, eos = tok.bos_token_id, tok.token_to_id(tok.eos_token)
    if "messages" in rec:
        return [chat_example(tok, rec["messages"], seq_len)]
    if "prompt" in rec:
        p = tok.encode(str(rec["prompt"]), add_special_tokens=False)
        c = tok.encode(str(rec["completion"]), add_special_tokens=False)
        return [prompt_completion_example(p, c, seq_len, bos, eos)]
    return document_examples(tok.encode(str(rec["text"]), add_special_tokens=False), seq_len, bos, eos)


def _batched_text_examples(tok: Tokenizer, texts: list[str], seq_len: int) -> list[Example]:
    """Documents tokenised in one batch call (the Rust tokenizer parallelises it)."""
    bos, eos = tok.bos_token_id, tok.token_to_id(tok.eos_token)
    out: list[Example] = []
    for enc in tok._tok.encode_batch(texts, add_special_tokens=False):
        out += document_examples(enc.ids, seq_len, bos, eos)
    return out


def load_examples(
    paths: Iterable[str | Path], tok: Tokenizer, seq_len: int, eval_fraction: float = 0.0
) -> tuple[list[Example], list[Example]]:
    """Tokenise everything under `paths`; split off `eval_fraction` of the documents/records by name."""
    train: list[Example] = []
    held: list[Example] = []
    texts: dict[bool, list[str]] = {False: [], True: []}
    for name, rec in iter_records(paths):
        is_eval = held_out(name, eval_fraction)
        if set(rec) == {"text"}:
            texts[is_eval].append(rec["text"])
            continue
        (held if is_eval else train).extend(record_examples(tok, rec, seq_len))
    train += _batched_text_examples(tok, texts[False], seq_len)
    held += _batched_text_examples(tok, texts[True], seq_len)
    if not train:
        raise ValueError("no training examples found in " + ", ".join(map(str, paths)))
    return train, held


class ExampleOrder:
    """Stateless epoch order of the training examples: global example index -> example, with a fresh
    permutation per epoch (not the denoising sampler, dgemma/engine/sampler.py)."""

    def __init__(self, examples: list[Example], seed: int):
        self.examples = examples
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.examples), generator=g).tolist()}
        return self._perms[epoch]

    def __getitem__(self, index: int) -> Example:
        n = len(self.examples)
        return self.examples[self._perm(index // n)[index % n]]
