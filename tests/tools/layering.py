#!/usr/bin/env python3
"""The folders' includes run one way (ctest layering).

  layering.py REPO

- The library (include/fsdp/, src/) and its tests (tests/lib/) never include the trainer (trainer/).
- The trainer includes the library only through its public headers ("fsdp/..."), the I/O
  layer's file helpers ("io/files.h") and the CUDA kernels' shared helpers ("kernels/..."),
  besides its own "model/..." and "train/...".
- Among the library's folders (include/fsdp as "fsdp", src/comm, src/shard, ...) the include graph
  has no cycle.
Prints `layering: ok`.
"""
import os
import re
import sys

from check_report import finish

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def sources(root):
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".h", ".cpp", ".cu", ".cuh")):
                yield os.path.join(folder, name)


def includes(path):
    return INCLUDE.findall(open(path, encoding="utf-8", errors="replace").read())


def main():
    repo = os.path.abspath(sys.argv[1])
    problems = []
    trainer_folders = {"model", "train"}
    for path in sources(f"{repo}/trainer"):
        for inc in includes(path):
            top = inc.split("/")[0]
            if top in trainer_folders or top in ("fsdp", "kernels") or inc == "io/files.h" or "/" not in inc:
                continue
            problems.append(f"{os.path.relpath(path, repo)} includes \"{inc}\": the trainer uses the library "
                            "through include/fsdp/ (and io/files.h, kernels/) only")
    for path in sources(f"{repo}/tests/lib"):
        for inc in includes(path):
            if inc.split("/")[0] in trainer_folders:
                problems.append(f"{os.path.relpath(path, repo)} includes \"{inc}\": the library's tests use the "
                                "library alone (their model: tests/lib/test_llama.h)")
    edges = {}
    for root, folder_of in ((f"{repo}/src", lambda p: os.path.relpath(p, f"{repo}/src").split("/")[0]),
                            (f"{repo}/include/fsdp", lambda p: "fsdp")):
        for path in sources(root):
            here = folder_of(path)
            for inc in includes(path):
                top = inc.split("/")[0]
                if top in trainer_folders:
                    problems.append(f"{os.path.relpath(path, repo)} includes \"{inc}\": the library never uses "
                                    "the trainer")
                elif "/" in inc and top != here:
                    edges.setdefault(here, set()).add(top)
    # The public headers are one node with their implementation: "fsdp" -> x is allowed only
    # where x never reaches back to a header (no cycle through src either).
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                problems.append("include cycle: " + " -> ".join(trail + [node, nxt]))
            elif nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    graph = ", ".join(f"{a} -> {' '.join(sorted(b))}" for a, b in sorted(edges.items()))
    finish("layering", problems, f"folders: {graph}")


if __name__ == "__main__":
    main()
