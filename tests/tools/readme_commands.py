#!/usr/bin/env python3
"""Every command block of the README and docs/ runs as written (ctest readme_commands).

  readme_commands.py REPO BUILD_DIR

Runs each ```bash block of REPO/README.md, then of each docs/*.md, in order, as a user who has
run the two set-up commands would: in one scratch directory that sees the repository's files
(build/ included) and keeps what the blocks write, with HOME there too, as on a machine without GPUs (CI's: the
launcher starts CPU ranks). A block that cannot run on such a machine says why on the line
before it: `<!-- not run by tests: REASON -->` (the set-up commands themselves, runs that need
GPUs or several hosts); an empty reason is an error. Fails on the first block that exits non-zero,
printing its output. Prints `readme_commands: ok` at the end.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

MARKER = re.compile(r"<!--\s*not run by tests:(.*?)-->")


def blocks(readme):
    """(line number, text, reason not run or None) of each ```bash block."""
    lines = open(readme).read().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip().startswith("```bash"):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            before = next((lines[j] for j in range(start - 2, -1, -1) if lines[j].strip()), "")
            marked = MARKER.search(before)
            found.append((start, "\n".join(body), marked.group(1).strip() if marked else None))
        i += 1
    return found


def main():
    repo, build = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    pages = ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(f"{repo}/docs") if n.endswith(".md"))
    with tempfile.TemporaryDirectory(prefix="readme-") as scratch:
        for name in os.listdir(repo):
            if name != ".git":
                os.symlink(f"{repo}/{name}", f"{scratch}/{name}")
        if os.path.realpath(f"{scratch}/build") != os.path.realpath(build):
            os.remove(f"{scratch}/build")
            os.symlink(build, f"{scratch}/build")
        env = dict(os.environ, HOME=scratch, CUDA_VISIBLE_DEVICES="")
        ccache = shutil.which("ccache")
        if ccache:  # a block's own CMake project (the installed-package example) compiles through the user's cache
            cache = subprocess.run([ccache, "--get-config", "cache_dir"], capture_output=True, text=True).stdout.strip()
            env.setdefault("CMAKE_CXX_COMPILER_LAUNCHER", ccache)
            env.setdefault("CCACHE_DIR", cache)
            env.update(CCACHE_BASEDIR=scratch, CCACHE_NOHASHDIR="1")  # the scratch folder's name differs each run
        ran = skipped = 0
        found = [(f"{page}:{line}", text, reason) for page in pages for line, text, reason in blocks(f"{repo}/{page}")]
        for where, text, reason in found:
            if reason is not None:
                if not reason:
                    sys.exit(f"readme_commands: FAIL: {where}: a block marked not run gives no reason")
                print(f"readme_commands: {where}: not run: {reason}")
                skipped += 1
                continue
            begin = time.time()
            done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + text], cwd=scratch, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
            if done.returncode != 0:
                print(done.stdout[-6000:])
                sys.exit(f"readme_commands: FAIL: {where}: exit {done.returncode}:\n{text}")
            print(f"readme_commands: {where}: ran in {time.time() - begin:.1f} s")
            ran += 1
        if ran == 0:
            sys.exit("readme_commands: FAIL: no block ran")
        print(f"readme_commands: {ran} blocks ran, {skipped} marked not run")
        print("readme_commands: ok")


if __name__ == "__main__":
    main()
