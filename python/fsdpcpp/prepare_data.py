"""fsdp-prepare-data: text or JSONL files -> token files fsdp-train reads (--data).

    fsdp-prepare-data --tokenizer DIR FILE [FILE ...] --out DATA.bin|CORPUS/ [--shard-tokens N]
                      [--field text] [--overwrite] [--hub]

DIR is a Hugging Face tokenizer directory (the --init-from model's own: tokenizer.json,
tokenizer_config.json, ...), loaded by transformers' AutoTokenizer; with --hub, a Hub repository's
name to download. FILE must be UTF-8 (a byte that is not is named with its offset). A FILE ending in .jsonl holds
one JSON object a line, its --field the document; any other FILE is one document. Each document is
tokenised as the tokenizer does by default (its BOS, if it adds one), followed by its EOS token
where it has one, so documents stay apart; documents go to the tokenizer in batches (a fast
tokenizer encodes a batch on all cores). A token file has llm.c's layout: a header of 256 int32
(magic 20240520 for uint16 ids, 20240801 where an id needs 32 bits; version 1; the token count),
then the ids, little-endian; it holds at most 2^31 - 1 tokens (the header's count). --out DATA.bin
writes one file; --out CORPUS/ (a directory: fsdp-train's --data CORPUS reads its files in name order
as one corpus) writes 000000.bin, 000001.bin, ... of at most --shard-tokens each, a new file starting
before a document that does not fit (one larger than a file is split). The ids are written as they
come (a batch of documents held at a time) beside the output (DATA.bin.tmp, CORPUS.tmp/) and renamed
into place once complete; an existing output is replaced only with --overwrite, never an input file,
and never a directory holding other files than token files. A document longer than a million
characters is tokenised a piece at a time, cut where whitespace follows a word. On a terminal one
line shows the progress (bytes read, tokens, tokens/s, time left); elsewhere a line a file.
"""
import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

MAGIC_UINT16, MAGIC_UINT32 = 20240520, 20240801
MAX_TOKENS = 2**31 - 1  # the header counts tokens in an int32
DEFAULT_SHARD_TOKENS = 10**9  # a corpus directory's files


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


def token_ids(tokenizer, texts):
    """Each document's ids as one call on it would give them (its special tokens, BOS, once): the first
    pieces of all documents in one batch call with the special tokens, the later pieces in another
    without, so a fast tokenizer encodes the batch in parallel."""
    split = [list(pieces(text)) for text in texts]
    firsts = tokenizer([p[0] for p in split], add_special_tokens=True)["input_ids"]
    later = [piece for p in split for piece in p[1:]]
    rest = iter(tokenizer(later, add_special_tokens=False)["input_ids"] if later else [])
    return [first + [i for _ in p[1:] for i in next(rest)] for first, p in zip(firsts, split)]


BATCH_CHARS = 1 << 22  # documents sent to the tokenizer together


def batches(docs):
    """(texts, bytes read after the last) of `docs` ((text, bytes read) pairs), about BATCH_CHARS a batch."""
    texts, chars = [], 0
    for text, read in docs:
        texts.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield texts, read
            texts, chars = [], 0
    if texts:
        yield texts, read


class TokenFile:
    """One token file written as the ids come: the header (its token count written last) and the ids
    into `path`, which publish() completes."""

    def __init__(self, path, dtype, magic):
        self.path, self.dtype, self.magic, self.count = path, dtype, magic, 0
        self.file = open(path, "wb")
        self.file.write(np.zeros(256, dtype="<i4").tobytes())

    def add(self, ids):
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


SHARD = "{:06d}.bin"  # a corpus directory's files


def is_shard(name):
    return len(name) == 10 and name.endswith(".bin") and name[:6].isdigit()


def remove(path):
    """A token file or a corpus directory, if there."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


class TokenOutput:
    """--out as the ids come: one file (at most MAX_TOKENS), or a directory of files of at most
    `shard_tokens` each; written beside it (.tmp), put in place by publish(), removed by close()
    without it. An existing output (checked by main) is replaced only once the new one is complete."""

    def __init__(self, out, vocab_size, shard_tokens):
        self.out, self.tmp, self.count = out.rstrip("/"), out.rstrip("/") + ".tmp", 0
        self.magic, self.dtype = (MAGIC_UINT32, "<u4") if vocab_size > 2**16 else (MAGIC_UINT16, "<u2")
        self.directory, self.shard_tokens = shard_tokens is not None, shard_tokens or MAX_TOKENS
        self.files = []
        if self.directory:
            os.makedirs(self.tmp)
        self.next_file()

    def next_file(self):
        if self.files:
            self.files[-1].publish()
        path = os.path.join(self.tmp, SHARD.format(len(self.files))) if self.directory else self.tmp
        self.files.append(TokenFile(path, self.dtype, self.magic))

    def add(self, ids):
        if not self.directory and self.count + len(ids) > MAX_TOKENS:
            raise SystemExit(f"fsdp-prepare-data: more than {MAX_TOKENS} tokens, the most one token file holds: "
                             f"write a directory of files instead (--out {os.path.splitext(self.out)[0]}/)")
        current = self.files[-1]
        if current.count and current.count + len(ids) > self.shard_tokens:  # a document stays in one file
            self.next_file()
        while ids:
            current = self.files[-1]
            if current.count == self.shard_tokens:  # a document larger than a file
                self.next_file()
                current = self.files[-1]
            room = self.shard_tokens - current.count
            current.add(ids[:room])
            self.count += min(room, len(ids))
            ids = ids[room:]

    def publish(self):
        self.files[-1].publish()
        old = self.out + ".old"
        if os.path.exists(self.out):  # main let it through: --overwrite
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        remove(old)

    def close(self):
        for f in self.files:
            if not f.file.closed:
                f.file.close()
        remove(self.tmp)


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


def check_output(p, args):
    """What --out may be, decided before any work: a new file or directory, or with --overwrite an
    existing token file or a directory of token files alone; never an input, never beside nothing."""
    corpus = args.out.endswith("/")
    out, tmp = args.out.rstrip("/"), args.out.rstrip("/") + ".tmp"
    if corpus and os.path.basename(out) in ("", ".", ".."):  # the working directory, /, a parent
        p.error(f"--out '{args.out}': name a directory of its own for the corpus (e.g. --out corpus/)")
    if not corpus and not args.out.endswith(".bin"):
        p.error(f"--out '{args.out}' must end in .bin (fsdp-train reads other names as text), or in / for a "
                "directory of token files")
    if args.shard_tokens is not None and (not corpus or not 1 <= args.shard_tokens <= MAX_TOKENS):
        p.error(f"--shard-tokens is the size of a corpus directory's files: give --out DIR/ and from 1 to {MAX_TOKENS}")
    for path in args.files:
        if not os.path.isfile(path):
            p.error(f"cannot read '{path}': no such file")
        inside = corpus and os.path.dirname(os.path.realpath(path)) in (os.path.realpath(out), os.path.realpath(tmp))
        if os.path.realpath(path) == os.path.realpath(out) or inside:
            p.error(f"--out '{args.out}' is or holds the input '{path}': write the tokens to a place of their own")
    if not corpus and os.path.isdir(out):
        p.error(f"--out '{args.out}' is a directory: name the token file to write, or write a directory of token "
                f"files with --out {out}/")
    if corpus and os.path.exists(out):
        if not os.path.isdir(out):
            p.error(f"--out '{args.out}': '{out}' is a file, not a directory")
        others = [name for name in os.listdir(out) if not is_shard(name)]
        if others:
            p.error(f"--out '{args.out}' holds files that are not token files ({', '.join(sorted(others)[:3])}): "
                    "write the corpus to a directory of its own")
    if os.path.exists(out) and (not corpus or os.listdir(out)) and not args.overwrite:
        p.error(f"--out '{args.out}' exists: pass --overwrite to replace it, or write elsewhere")
    if corpus and os.path.isdir(tmp):  # a stopped run's: only ever its token files
        if any(not is_shard(name) for name in os.listdir(tmp)):
            p.error(f"'{tmp}' holds other files than token files: move it out of the way")
        shutil.rmtree(tmp)
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        p.error(f"--out '{args.out}': the directory '{os.path.dirname(out)}' does not exist")
    return corpus


def main(argv=None):
    p = argparse.ArgumentParser(prog="fsdp-prepare-data", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="text files, or .jsonl files of documents")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a Hugging Face tokenizer directory (the --init-from model's)")
    p.add_argument("--out", required=True, metavar="DATA.bin|CORPUS/",
                   help="the token file to write, or (ending in /) a directory of token files")
    p.add_argument("--shard-tokens", type=int, metavar="N",
                   help=f"with --out CORPUS/: tokens a file holds at most (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--field", default="text", help="the document's field in .jsonl files (default text)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--hub", action="store_true",
                   help="--tokenizer names a Hugging Face Hub repository to download (else a local directory)")
    args = p.parse_args(argv)
    corpus = check_output(p, args)
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
    tokens = TokenOutput(args.out, vocab_size, (args.shard_tokens or DEFAULT_SHARD_TOKENS) if corpus else None)
    try:
        files_done = 0
        for path in args.files:
            before, count = tokens.count, 0
            for texts, read in batches(documents(path, args.field)):
                for ids in token_ids(tokenizer, texts):
                    tokens.add(ids + eos)
                count += len(texts)
                progress.update(files_done + read, tokens.count)
            files_done += os.path.getsize(path)
            progress.end()
            print(f"fsdp-prepare-data: {path}: {count} document(s), {tokens.count - before} tokens", flush=True)
        tokens.publish()
    finally:
        progress.end()
        tokens.close()
    kind = f"llm.c {'uint32' if vocab_size > 2**16 else 'uint16'}"
    print(f"fsdp-prepare-data: wrote {args.out}: {tokens.count} tokens of a {vocab_size}-id vocabulary ({kind}"
          + (f", {len(tokens.files)} file(s))" if corpus else ")"))


if __name__ == "__main__":
    sys.exit(main())
