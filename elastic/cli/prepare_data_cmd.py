"""`elastic prepare-data INPUT... --out DIR`: text files -> a tokenizer and token shards for `--data DIR`.

Trains a byte-level BPE tokenizer on the inputs (`--vocab-size N`) or takes an existing one
(`--tokenizer tokenizer.json`), encodes every input in order (`<|endoftext|>` between two files
when the tokenizer has it) and writes into DIR: `tokens-NNNNN.bin` (nanoGPT's uint16 ids, at
most `--shard-tokens` each), `tokenizer.json` and `meta.json` (elastic/records/prepared_data.py:
vocabulary size, token count, shards, sources). Everything runs offline.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from elastic.cli.main import UsageError
from elastic.records.prepared_data import (
    MAX_VOCAB,
    META_NAME,
    TOKENIZER_NAME,
    PreparedData,
    ShardInfo,
    SourceInfo,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEFAULT_VOCAB = 4096
"""Target vocabulary of a trained tokenizer when --vocab-size is not given."""
DEFAULT_SHARD_TOKENS = 1 << 27
"""Ids per shard by default (256 MiB files)."""
PROGRESS_MIN_BYTES = 1 << 20
"""Inputs at least this large show a progress bar."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "prepare-data",
        help="train a BPE tokenizer on text files (or take one) and write token shards for --data",
        description="Tokenize text files into the nanoGPT .bin shards `elastic run --data DIR` reads, with "
        "a byte-level BPE tokenizer trained here (Hugging Face tokenizers, offline) or given as tokenizer.json.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="UTF-8 text files, encoded in this order")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write (new or empty)")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help=f"train a tokenizer of at most this many ids (default {DEFAULT_VOCAB})"
    )
    parser.add_argument("--tokenizer", type=Path, default=None, help="use this tokenizer.json instead of training one")
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="most token ids per .bin shard"
    )
    parser.set_defaults(func=_run)


def _check_args(args: argparse.Namespace) -> None:
    """UsageError (one line, exit 2) for inputs that are not files, clashing flags, or an --out
    that already holds something (nothing is ever overwritten)."""
    for path in args.inputs:
        if not path.is_file():
            raise UsageError(f"input {path} is not a file")
    if args.tokenizer is not None and args.vocab_size is not None:
        raise UsageError("--vocab-size trains a tokenizer; --tokenizer uses an existing one: give one of them")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise UsageError(f"--tokenizer {args.tokenizer} is not a file")
    if args.vocab_size is not None and not 258 <= args.vocab_size <= MAX_VOCAB:
        raise UsageError(f"--vocab-size must be in [258, {MAX_VOCAB}] (uint16 token files), got {args.vocab_size}")
    if args.shard_tokens < 1:
        raise UsageError(f"--shard-tokens must be >= 1, got {args.shard_tokens}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise UsageError(f"--out {args.out} exists and is not an empty directory; nothing was written")


def _tokenizer(args: argparse.Namespace) -> tuple[Tokenizer, str]:
    """The tokenizer (trained, or read from --tokenizer) and where it came from; UsageError if unusable."""
    from elastic.data.prepare import load_tokenizer, train_tokenizer, vocab_bound

    if args.tokenizer is not None:
        try:
            tokenizer, origin = load_tokenizer(args.tokenizer), str(args.tokenizer.resolve())
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        target = DEFAULT_VOCAB if args.vocab_size is None else args.vocab_size
        if sum(p.stat().st_size for p in args.inputs) >= PROGRESS_MIN_BYTES:
            print(f"elastic prepare-data: training a byte-level BPE tokenizer of {target} ids", file=sys.stderr)
        try:
            tokenizer = train_tokenizer(args.inputs, vocab_size=target, show_progress=sys.stderr.isatty())
        except Exception as exc:  # tokenizers raises a plain Exception, e.g. for a file that is not UTF-8
            raise UsageError(f"cannot train a tokenizer on the inputs: {_train_error(args.inputs, exc)}") from None
        origin = f"trained: byte-level BPE, target vocabulary {target}"
    if vocab_bound(tokenizer) > MAX_VOCAB:
        raise UsageError(f"the tokenizer has {vocab_bound(tokenizer)} ids; uint16 token files hold at most {MAX_VOCAB}")
    return tokenizer, origin


def _train_error(inputs: list[Path], exc: Exception) -> str:
    """Why training failed, in words: the first input that is not UTF-8, else the library's message."""
    from elastic.data.prepare import text_chunks

    for path in inputs:
        try:
            for _ in text_chunks(path):
                pass
        except UnicodeDecodeError as bad:
            return f"input {path} is not UTF-8 text: {bad.reason}"
    return str(exc).splitlines()[0]


def _run(args: argparse.Namespace) -> int:
    from elastic.data.prepare import SEPARATOR, ShardWriter, vocab_bound

    _check_args(args)
    tokenizer, origin = _tokenizer(args)
    created = not args.out.exists()
    args.out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(directory=args.out, shard_tokens=args.shard_tokens)
    try:
        separator = tokenizer.token_to_id(SEPARATOR)
        sources = _encode_all(args.inputs, tokenizer, writer, separator)
        shards = [ShardInfo(name=name, tokens=count) for name, count in writer.finish()]
    except BaseException:  # a bad input or Ctrl-C: remove what was written, so --out is as it was
        writer.discard()
        if created:
            shutil.rmtree(args.out, ignore_errors=True)
        raise
    if args.tokenizer is not None:
        shutil.copyfile(args.tokenizer, args.out / TOKENIZER_NAME)
    else:
        tokenizer.save(str(args.out / TOKENIZER_NAME))
    meta = PreparedData(
        vocab_size=vocab_bound(tokenizer),
        tokens=sum(s.tokens for s in shards),
        shards=shards,
        sources=sources,
        tokenizer_origin=origin,
        separator_id=separator,
    )
    meta.save(args.out)
    print(
        f"elastic prepare-data: {meta.tokens} tokens from {len(sources)} files in {len(shards)} shards, "
        f"vocabulary {meta.vocab_size} ids: {args.out} ({META_NAME}, {TOKENIZER_NAME}, tokens-*.bin)",
        flush=True,
    )
    return 0


def _encode_all(inputs: list[Path], tokenizer: Tokenizer, writer: Any, separator: int | None) -> list[SourceInfo]:
    """Encode every input into `writer`, the separator between two files; UsageError for a file
    that is not UTF-8 text."""
    import numpy as np

    from elastic.data.prepare import encode_file

    sizes = [p.stat().st_size for p in inputs]
    bar = ProgressBar(total=sum(sizes), label="tokenizing") if sum(sizes) >= PROGRESS_MIN_BYTES else None
    sources: list[SourceInfo] = []
    for k, (path, size) in enumerate(zip(inputs, sizes, strict=True)):
        if sources and separator is not None:
            writer.write(np.array([separator], dtype=np.uint16))
        before = sum(sizes[:k])

        def progress(read: int, before: int = before) -> None:
            if bar is not None:
                bar.update(before + read)

        try:
            count = encode_file(tokenizer, path, writer, progress=progress)
        except UnicodeDecodeError as exc:
            raise UsageError(f"input {path} is not UTF-8 text: {exc.reason}") from None
        sources.append(SourceInfo(path=str(path.resolve()), bytes=size, tokens=count))
    if bar is not None:
        bar.close()
    return sources


class ProgressBar:
    """A one-line progress bar on stderr: redrawn in place on a terminal, a line per 10% elsewhere."""

    def __init__(self, *, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._shown = -1  # last percentage (tty) or tenth (elsewhere) drawn

    def render(self, done: int) -> str:
        """The bar for `done` of `total` bytes: label, bar, percentage, MiB and MiB/s."""
        frac = min(done / self.total, 1.0)
        filled = int(frac * self.width)
        rate = done / max(time.monotonic() - self.started, 1e-9) / 2**20
        return (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:3.0f}% "
            f"{done / 2**20:.1f}/{self.total / 2**20:.1f} MiB {rate:.1f} MiB/s"
        )

    def update(self, done: int) -> None:
        """Draw the bar if it moved by a percent (terminal) or a tenth (log file)."""
        step = int(min(done / self.total, 1.0) * (100 if self.tty else 10))
        if step == self._shown:
            return
        self._shown = step
        self.stream.write(("\r" if self.tty else "") + self.render(done) + ("" if self.tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        """Draw 100% (unless drawn) and end the line."""
        self.update(self.total)
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()
