#!/usr/bin/env bash
# `make drafters`: restores the drafters that live outside checkpoints/' 40 MB budget (a clone stays small) from the
# git history into the working tree. checkpoints/extra.txt lists them, a step folder and the commit that holds it per
# line; .gitignore keeps them out of the tree again.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! git rev-parse --git-dir >/dev/null 2>&1; then
  echo "make drafters: not a git checkout; the extra drafters live in the git history (clone the repository)" >&2; exit 2
fi
grep -v '^#' checkpoints/extra.txt | while read -r path rev; do
  [ -n "$path" ] || continue
  if ! git cat-file -e "$rev:$path/config.json" 2>/dev/null; then
    echo "make drafters: commit $rev (holding $path) is not in this clone; a shallow clone lacks it: git fetch --unshallow" >&2; exit 2
  fi
  git archive "$rev" -- "$path" | tar -x
  echo "restored $path ($(du -sh "$path" | cut -f1), from $rev)"
done
