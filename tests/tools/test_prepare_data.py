"""fsdp-prepare-data (python/fsdpcpp/prepare_data.py) as users run it, with a tokenizer made here: what it
refuses before any work (an output that is an input or a directory, a tokenizer directory that is
not there), text that is not UTF-8 named with its byte offset, and a document of one long line
tokenised a piece at a time into the ids one call gives.

    build/python -m pytest tests/tools/test_prepare_data.py    (ctest prepare_data)
"""

import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "python", "fsdpcpp", "prepare_data.py")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    import tokenizers
    import transformers
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t7", eos_token="t9").save_pretrained(
        directory)
    return directory


def prepare(*args, cwd=None):
    done = subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=dict(os.environ, HF_HUB_OFFLINE="0"))
    return done.returncode, done.stdout + done.stderr


def prepare_here(capsys, *args):
    """prepare() in this process (no interpreter and transformers to start again): exit code and output."""
    sys.path.insert(0, os.path.dirname(TOOL))
    import prepare_data
    try:
        prepare_data.main(list(map(str, args)))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def tokens_of(path):
    data = open(path, "rb").read()
    header = np.frombuffer(data[:1024], dtype="<i4")
    return header[:3].tolist(), np.frombuffer(data[1024:], dtype="<u2").tolist()


def test_an_output_that_is_an_input_is_refused_whatever_the_flags(tokenizer_dir, tmp_path):
    text = tmp_path / "notes.bin"
    text.write_text("t1 t2 t3")
    code, out = prepare("--tokenizer", tokenizer_dir, text, "--out", text, "--overwrite")
    assert code == 2 and f"--out '{text}' is or holds the input" in out, out
    assert text.read_text() == "t1 t2 t3"


def test_an_output_directory_is_refused_before_the_work(tokenizer_dir, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("t1 t2")
    (tmp_path / "out.bin").mkdir()
    code, out = prepare("--tokenizer", tokenizer_dir, text, "--out", tmp_path / "out.bin", "--overwrite")
    assert code == 2 and "is a directory: name the token file" in out, out
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_missing_tokenizer_directory_is_not_looked_up_on_the_hub(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("t1 t2")
    code, out = prepare("--tokenizer", "no-such-tokenizer", text, "--out", tmp_path / "x.bin", cwd=tmp_path)
    assert code == 2 and "'no-such-tokenizer': no such directory (pass --hub" in out, out


def test_text_that_is_not_utf8_is_named_with_its_offset(tokenizer_dir, tmp_path):
    plain = tmp_path / "latin1.txt"
    plain.write_bytes("t1 t2 caf\xe9".encode("latin-1"))
    code, out = prepare("--tokenizer", tokenizer_dir, plain, "--out", tmp_path / "a.bin")
    assert code == 1 and f"{plain}: not UTF-8 text at byte 9" in out and "Traceback" not in out, out
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(b'{"text": "t1"}\n{"text": "t2 \xff"}\n')
    code, out = prepare("--tokenizer", tokenizer_dir, lines, "--out", tmp_path / "b.bin")
    assert code == 1 and f"{lines}: not UTF-8 text at byte 28" in out, out


def test_a_long_line_gives_the_ids_of_one_call(tokenizer_dir, tmp_path):
    import transformers
    sys.path.insert(0, os.path.dirname(TOOL))
    import prepare_data
    text = " ".join(f"t{(i * 7) % 256}" for i in range(500_000))  # 2.2 MB on one line: three pieces
    assert len(list(prepare_data.pieces(text))) == 3
    path = tmp_path / "long.txt"
    path.write_text(text)
    code, out = prepare("--tokenizer", tokenizer_dir, path, "--out", tmp_path / "long.bin")
    assert code == 0, out
    header, got = tokens_of(tmp_path / "long.bin")
    want = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"] + [9]
    assert header == [20240520, 1, len(want)] and got == want


def test_progress_shows_on_a_terminal_alone(tokenizer_dir, tmp_path):
    """On a terminal one line that updates (the bytes read, tokens, tokens/s, time left); piped,
    the lines a file alone; the same token file either way."""
    import json
    import pty
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"t1 t{i % 200} t3"}) + "\n" for i in range(50)))
    leader, follower = pty.openpty()
    done = subprocess.run([sys.executable, TOOL, "--tokenizer", tokenizer_dir, data, "--out", tmp_path / "a.bin"],
                          stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert done.returncode == 0, done.stdout
    terminal = shown.decode()
    assert "\rfsdp-prepare-data: " in terminal and "% of " in terminal and "k tokens/s" in terminal, terminal
    code, piped = prepare("--tokenizer", tokenizer_dir, data, "--out", tmp_path / "b.bin")
    assert code == 0 and "% of " not in piped and "50 document(s)" in piped, piped
    assert tokens_of(tmp_path / "a.bin") == tokens_of(tmp_path / "b.bin")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_corpus_directory_holds_the_ids_of_one_file_in_files_of_whole_documents(tokenizer_dir, tmp_path, capsys):
    """--out DIR/: the same ids as --out FILE.bin, cut into files of at most --shard-tokens that
    each end with a document's end (t9) unless a document is larger than a file; a directory with
    other files in it, a rerun without --overwrite and --shard-tokens for one file are refused."""
    import json
    data = tmp_path / "docs.jsonl"
    lengths = [3, 8, 1, 30, 5, 2, 12, 4]  # words; the 30-word document is larger than a file
    data.write_text("".join(json.dumps({"text": " ".join(f"t{10 + i}" for i in range(n))}) + "\n" for n in lengths))
    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", tmp_path / "one.bin")
    assert code == 0, out
    _, whole = tokens_of(tmp_path / "one.bin")
    corpus = tmp_path / "corpus"
    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", f"{corpus}/", "--shard-tokens", 16)
    assert code == 0 and "file(s))" in out, out
    names = sorted(os.listdir(corpus))
    assert names == [f"{i:06d}.bin" for i in range(len(names))] and len(names) >= 4, names
    parts = [tokens_of(corpus / name) for name in names]
    assert [i for _, ids in parts for i in ids] == whole
    for name, (header, ids) in zip(names, parts):
        assert header == [20240520, 1, len(ids)] and 0 < len(ids) <= 16, (name, header)
    splits = [name for name, (_, ids) in zip(names, parts) if ids[-1] != 9]
    assert len(splits) == 1, splits  # the 30-word document fills one file and ends in the next
    assert not os.path.exists(f"{corpus}.tmp")

    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", f"{corpus}/")
    assert code == 2 and "exists: pass --overwrite" in out, out
    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", f"{corpus}/", "--overwrite")
    assert code == 0 and sorted(os.listdir(corpus)) == ["000000.bin"], out  # the old files replaced
    (corpus / "notes.txt").write_text("mine")
    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", f"{corpus}/", "--overwrite")
    assert code == 2 and "holds files that are not token files (notes.txt)" in out, out
    assert (corpus / "notes.txt").read_text() == "mine"
    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", tmp_path / "two.bin", "--shard-tokens", 16)
    assert code == 2 and "--shard-tokens is the size of a corpus directory's files" in out, out
    code, out = prepare_here(capsys, "--tokenizer", tokenizer_dir, data, "--out", f"{tmp_path}/./")
    assert code == 2 and "name a directory of its own for the corpus" in out, out
