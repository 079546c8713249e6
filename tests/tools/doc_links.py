#!/usr/bin/env python3
"""Every link and every path the docs and the code's comments name exists (ctest doc_links).

  doc_links.py REPO

In README.md, docs/*.md and the notes beside the code (src/*/README.md, trainer/*/README.md): each markdown link's target (relative
to the file) and each path in backticks that starts at a top-level folder of the repository
(`docs/...`, `bench/results/...`, `src/...`) must exist. In the code (C++, Python, shell and CMake
files outside bench/results/), each path to a file (one with an extension) or to a record
(bench/results/NAME) that starts at a top-level folder must exist too: a comment that cites a doc,
a record or another file stays true when they move. Paths with a placeholder (`<`, `*`, `N`,
`...`, `$`, a segment in capitals such as NAME) are patterns, not files, and are skipped. Commit
hashes stay in docs/results.md (the history): another page that names one in its prose (outside
its command blocks and record names) fails. bench/results/README.md indexes every record folder
(one row each, no row without its folder) and its Size line says what git tracks there. Prints
`doc_links: ok`.
"""
import os
import re
import subprocess
import sys

from check_report import finish

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\s]+)`")
IN_CODE = re.compile(r"(?<![\w/.$}-])([a-z]+/[\w.+-]+(?:/[\w.+-]+)*)")
CODE_FILES = (".cpp", ".h", ".cu", ".cuh", ".py", ".sh", ".cmake", "CMakeLists.txt")
# A commit hash in prose: 7-40 hex digits, letters and digits both, not part of a record's name.
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
PATTERN = re.compile(r"[<*{$]|\.\.\.|/N\b|-N\b|/[A-Z_]+(?:/|$)")  # bench/results/NAME is a pattern


def code_paths(repo, tops):
    """(file:line, path) for each repository path the code names: a file's or a record's."""
    for top in sorted(tops):
        for folder, dirs, names in os.walk(f"{repo}/{top}"):
            dirs[:] = [d for d in dirs if d != "__pycache__" and f"{folder}/{d}" != f"{repo}/bench/results"]
            for name in sorted(n for n in names if n.endswith(CODE_FILES)):
                path = f"{folder}/{name}"
                for number, line in enumerate(open(path, errors="replace"), 1):
                    for found in IN_CODE.findall(line):
                        found = found.rstrip(".,;:)")
                        record = found.startswith("bench/results/")
                        if found.split("/")[0] not in tops or PATTERN.search(found):
                            continue
                        if record or "." in found.rsplit("/", 1)[-1]:
                            yield f"{os.path.relpath(path, repo)}:{number}", found


def records_index(repo):
    """What bench/results/README.md gets wrong about the records beside it."""
    index = open(f"{repo}/bench/results/README.md").read()
    rows = set(re.findall(r"^\| `([^`/]+)/` \|", index, re.M))
    folders = {n for n in os.listdir(f"{repo}/bench/results") if os.path.isdir(f"{repo}/bench/results/{n}")}
    wrong = [f"bench/results/README.md: record {n} has no row" for n in sorted(folders - rows)]
    wrong += [f"bench/results/README.md: row {n}: no such folder" for n in sorted(rows - folders)]
    tracked = subprocess.run(["git", "-C", repo, "ls-files", "-z"], capture_output=True, text=True).stdout
    files = [f for f in tracked.split("\0") if f]
    records = [f for f in files if f.startswith("bench/results/")]
    size = sum(os.path.getsize(f"{repo}/{f}") for f in records if os.path.exists(f"{repo}/{f}"))
    said = f"Size: {size / 2**20:.1f} MiB in {len(records)} files (`du -cb` of the tracked files), " \
           f"{round(100 * len(records) / len(files))}% of the files git tracks."
    if files and said not in " ".join(index.split()):
        wrong.append(f"bench/results/README.md: the Size line should read '{said}'")
    return wrong


def main():
    repo = os.path.abspath(sys.argv[1])
    tops = {n for n in os.listdir(repo) if os.path.isdir(f"{repo}/{n}") and not n.startswith(".")} - {"build"}
    pages = ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(f"{repo}/docs") if n.endswith(".md"))
    pages += sorted(f"{top}/{sub}/README.md" for top in ("src", "trainer") for sub in os.listdir(f"{repo}/{top}")
                    if os.path.exists(f"{repo}/{top}/{sub}/README.md"))  # the mechanism notes beside the code
    wrong, checked = [], 0  # each problem in its own words
    for page in pages:
        text = open(f"{repo}/{page}").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands are run by readme_commands
        if page != "docs/results.md":
            wrong += [f"{page}: commit {c} in prose (history belongs in docs/results.md)" for c in COMMIT.findall(text)]
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            checked += 1
            if not os.path.exists(os.path.normpath(f"{repo}/{os.path.dirname(page)}/{target}")):
                wrong.append(f"{page}: link {target}: missing")
        for path in CODE.findall(text):
            path = path.rstrip(".,;:)")
            if path.split("/")[0] not in tops or "/" not in path or re.search(r"[<*{]|\.\.\.|/N\b|-N\b", path):
                continue
            checked += 1
            if not os.path.exists(f"{repo}/{path.split(':')[0]}"):
                wrong.append(f"{page}: `{path}`: missing")
    wrong += records_index(repo)
    for where, path in code_paths(repo, tops):
        checked += 1
        if not os.path.exists(f"{repo}/{path.split(':')[0]}"):
            wrong.append(f"{where}: {path}: missing")
    finish("doc_links", wrong, f"{checked} links and paths in {len(pages)} pages and the code, {len(wrong)} wrong")


if __name__ == "__main__":
    main()
