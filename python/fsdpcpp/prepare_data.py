"""fsdp-prepare-data: text or JSONL files -> a token file fsdp-train reads (--data FILE.bin).

    fsdp-prepare-data --tokenizer DIR FILE [FILE ...] --out DATA.bin [--field text] [--overwrite] [--hub]

DIR is a Hugging Face tokenizer directory (the --init-from model's own: tokenizer.json,
tokenizer_config.json, ...), loaded by transformers' AutoTokenizer; with --hub, a Hub repository's
name to download. FILE must be UTF-8 (a byte that is not is named with its offset). A FILE ending in .jsonl holds
one JSON object a line, its --field the document; any other FILE is one document. Each document is
tokenised as the tokenizer does by default (its BOS, if it adds one), followed by its EOS token
where it has one, so documents stay apart. DATA.bin gets llm.c's layout: a header of 256 int32
(magic 20240520 for uint16 ids, 20240801 where an id needs 32 bits; version 1; the token count),
then the ids, little-endian. It is written beside DATA.bin as the ids come (one document's held at
a time) and renamed into place once complete; an existing DATA.bin is replaced only with
--overwrite, and never an input file. A document longer than a million characters is tokenised a
piece at a time, cut where whitespace follows a word. On a terminal one line shows the progress
(bytes read, tokens, tokens/s, time left); elsewhere a line a file.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

MAGIC_UINT16, MAGIC_UINT32 = 20240520, 20240801
MAX_TOKENS = 2**31 - 1  # the header counts tokens in an int32


CHUNK_CHARS = 1 << 20  # a document longer than this is tokenised a piece at a time


def decoded(data, path, offset):
    """`data` (bytes of `path` from byte `offset`) as UTF-8 text; a byte that is not UTF-8 ends the
    run naming the file and its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"fsdp-prepare-data: {path}: not UTF-8 text at byte {offset + e.start} "
                         f"({data[e.start:e.start + 4]!r}...): convert it to UTF-8 (iconv), or leave it out")


def documents(path, field):
    """The documents of one input file, in order, each with the bytes of the file read so far."""
    if not path.endswith(".jsonl"):
        with open(path, "rb") as f:
            data = f.read()
        yield decoded(data, path, 0), len(data)
        return
    with open(path, "rb") as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            line, offset = decoded(raw, path, offset), offset + len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"fsdp-prepare-data: {path}:{number}: not JSON ({e.msg})")
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise SystemExit(f"fsdp-prepare-data: {path}:{number}: no text field '{field}' "
                                 f"(pass --field NAME to read another)")
            yield record[field], offset


def pieces(text):
    """`text` in pieces of at most about CHUNK_CHARS, each cut where whitespace follows a word (the
    tokenizers' pre-tokenisers split there too), so that a long document's tokens are those of the
    whole while the tokenizer holds one piece at a time (one call on a 22 MB line took 4 GB)."""
    start = 0
    while len(text) - start > CHUNK_CHARS:
        end = start + CHUNK_CHARS
        cut = next((i for i in range(end, start + CHUNK_CHARS // 2, -1)
                    if text[i].isspace() and not text[i - 1].isspace()), end)
        yield text[start:cut]
        start = cut
    yield text[start:]


def token_ids(tokenizer, text):
    """The document's ids as one call on it would give them, its special tokens (BOS) once."""
    ids = []
    for i, piece in enumerate(pieces(text)):
        ids += tokenizer(piece, add_special_tokens=i == 0)["input_ids"]
    return ids


class TokenFile:
    """DATA.bin written as the ids come: the header (its token count written last) and the ids into
    DATA.bin.tmp, renamed into place by publish(); close() without it removes the partial file."""

    def __init__(self, out, vocab_size):
        self.out, self.tmp, self.count = out, out + ".tmp", 0
        self.magic, self.dtype = (MAGIC_UINT32, "<u4") if vocab_size > 2**16 else (MAGIC_UINT16, "<u2")
        self.file = open(self.tmp, "wb")
        self.file.write(np.zeros(256, dtype="<i4").tobytes())

    def add(self, ids):
        if self.count + len(ids) > MAX_TOKENS:
            raise SystemExit(f"fsdp-prepare-data: more than {MAX_TOKENS} tokens: split the input into several files")
        self.file.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.count += len(ids)

    def publish(self):
        header = np.zeros(256, dtype="<i4")
        header[:3] = (self.magic, 1, self.count)
        self.file.seek(0)
        self.file.write(header.tobytes())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.out)

    def close(self):
        if not self.file.closed:
            self.file.close()
            os.remove(self.tmp)


class Progress:
    """One line on a terminal (stderr) that updates at most twice a second: the bytes read of all
    inputs, the tokens so far, tokens/s and the time left at that rate. Nothing elsewhere."""

    def __init__(self, total_bytes):
        self.total, self.shown = max(total_bytes, 1), False
        self.start = time.monotonic()
        self.last = self.start - 1  # the first document shows at once
        self.on = sys.stderr.isatty()

    def update(self, done_bytes, tokens):
        now = time.monotonic()
        if not self.on or now - self.last < 0.5:
            return
        self.last, elapsed = now, now - self.start
        left = elapsed * (self.total - done_bytes) / max(done_bytes, 1)
        sys.stderr.write(f"\rfsdp-prepare-data: {100 * done_bytes / self.total:5.1f}% of {self.total / 1e6:.1f} MB, "
                         f"{tokens / 1e6:.2f} M tokens, {tokens / max(elapsed, 1e-9) / 1e3:.0f} k tokens/s, "
                         f"{int(left) // 60}:{int(left) % 60:02d} left ")
        sys.stderr.flush()
        self.shown = True

    def end(self):
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


def main(argv=None):
    p = argparse.ArgumentParser(prog="fsdp-prepare-data", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="text files, or .jsonl files of documents")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a Hugging Face tokenizer directory (the --init-from model's)")
    p.add_argument("--out", required=True, metavar="DATA.bin", help="the token file to write")
    p.add_argument("--field", default="text", help="the document's field in .jsonl files (default text)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--hub", action="store_true",
                   help="--tokenizer names a Hugging Face Hub repository to download (else a local directory)")
    args = p.parse_args(argv)
    if not args.out.endswith(".bin"):
        p.error(f"--out '{args.out}' must end in .bin (fsdp-train reads other names as text)")
    for path in args.files:
        if not os.path.isfile(path):
            p.error(f"cannot read '{path}': no such file")
        if os.path.realpath(path) == os.path.realpath(args.out):
            p.error(f"--out '{args.out}' is the input '{path}': write the tokens to a file of their own")
    if os.path.isdir(args.out):
        p.error(f"--out '{args.out}' is a directory: name the token file to write")
    if os.path.exists(args.out) and not args.overwrite:
        p.error(f"--out '{args.out}' exists: pass --overwrite to replace it, or write elsewhere")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out '{args.out}': the directory '{os.path.dirname(args.out)}' does not exist")
    if not args.hub and not os.path.isdir(args.tokenizer):
        p.error(f"--tokenizer '{args.tokenizer}': no such directory (pass --hub to download a tokenizer of that "
                "name from the Hugging Face Hub)")
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=not args.hub)
    except (OSError, ValueError) as e:
        p.error(f"--tokenizer '{args.tokenizer}': no Hugging Face tokenizer there ({e})")
    vocab_size = len(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    progress = Progress(sum(os.path.getsize(path) for path in args.files))
    tokens = TokenFile(args.out, vocab_size)
    try:
        files_done = 0
        for path in args.files:
            before, count = tokens.count, 0
            for text, read in documents(path, args.field):
                tokens.add(token_ids(tokenizer, text) + eos)
                count += 1
                progress.update(files_done + read, tokens.count)
            files_done += os.path.getsize(path)
            progress.end()
            print(f"fsdp-prepare-data: {path}: {count} document(s), {tokens.count - before} tokens", flush=True)
        tokens.publish()
    finally:
        progress.end()
        tokens.close()
    print(f"fsdp-prepare-data: wrote {args.out}: {tokens.count} tokens of a {vocab_size}-id vocabulary "
          f"(llm.c {'uint32' if vocab_size > 2**16 else 'uint16'})")


if __name__ == "__main__":
    sys.exit(main())
