"""How the repository's own checks (doc_links.py, layering.py) end: each problem on a line of its
own under the check's name, a summary line, then `NAME: ok` or exit status 1."""
import sys


def finish(check: str, problems: list, summary: str) -> None:
    for p in problems:
        print(f"{check}: {p}")
    print(f"{check}: {summary}")
    if problems:
        sys.exit(1)
    print(f"{check}: ok")
