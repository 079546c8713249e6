#!/usr/bin/env bash
# Release tags from the CHANGELOG: each heading `## X.Y.Z (DATE, COMMIT)` names the commit that set
# that version in CMakeLists.txt; this makes the annotated tag vX.Y.Z there (a fresh clone of main
# has no tags), or with --check only verifies that every named commit exists, sets that version,
# and that any tag vX.Y.Z already made points at it.
#   bash scripts/tag_releases.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
check=false
case "${1:-}" in
  "") ;;
  --check) check=true ;;
  *) echo "tag_releases.sh: unknown argument '$1' (the only option is --check)" >&2; exit 2 ;;
esac
if ! git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  echo "tag_releases.sh: $(pwd) is not a git checkout: there is no history to tag"
  exit 77  # ctest's skip code
fi
if [ "$(git rev-parse --is-shallow-repository)" = true ]; then
  echo "tag_releases.sh: this clone is shallow, so the releases' commits are missing: 'git fetch --unshallow' first"
  exit 77  # ctest's skip code
fi
status=0 count=0
while read -r version date commit; do
  count=$((count + 1))
  if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "tag_releases.sh: $version names commit $commit, which this history lacks" >&2; status=1; continue
  fi
  if ! git show "$commit:CMakeLists.txt" | grep -q "^project(fsdp_cpp VERSION $version "; then
    echo "tag_releases.sh: $version names commit $commit, whose CMakeLists.txt sets another version" >&2; status=1; continue
  fi
  if git rev-parse -q --verify "refs/tags/v$version" > /dev/null; then
    tagged=$(git rev-parse "v$version^{commit}")
    if [ "$tagged" != "$(git rev-parse "$commit^{commit}")" ]; then
      echo "tag_releases.sh: tag v$version points at ${tagged:0:7}, the CHANGELOG at $commit: left as it is" >&2; status=1
    fi
  elif ! $check; then
    git tag -a "v$version" "$commit" -m "fsdp.cpp $version ($date)"
    echo "tag_releases.sh: tagged v$version at $commit"
  fi
done < <(sed -n 's/^## \([0-9][0-9.]*\) (\([0-9-]*\), \([0-9a-f]*\))$/\1 \2 \3/p' CHANGELOG.md)
if [ "$count" -eq 0 ]; then
  echo "tag_releases.sh: no heading '## X.Y.Z (DATE, COMMIT)' in CHANGELOG.md" >&2; exit 1
fi
[ "$status" -eq 0 ] && echo "tag_releases.sh: $count releases, each named commit sets its version"
exit $status
