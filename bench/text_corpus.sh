#!/usr/bin/env bash
# Real English text for loss curves (fsdp-train --data reads a text file as bytes): the Vim help
# files (Debian's vim-runtime, /usr/share/vim/vim*/doc/*.txt, 9.5 MB), concatenated in name order;
# the first 95% of the bytes for training, the last 5% held out. GPU machines lack vim-runtime, so
# the files are made here and carried (an ignored folder, named in the device call's carry).
#   bash bench/text_corpus.sh DIR      -> DIR/vim-docs-train.txt, DIR/vim-docs-eval.txt
set -euo pipefail
dir=${1:?output folder}
docs=$(ls -d /usr/share/vim/vim*/doc 2>/dev/null | head -1)
[ -n "$docs" ] || { echo "text_corpus.sh: no /usr/share/vim/vim*/doc: apt-get install vim-runtime" >&2; exit 1; }
mkdir -p "$dir"
cat $(ls "$docs"/*.txt | sort) > "$dir/vim-docs.txt"
bytes=$(stat -c %s "$dir/vim-docs.txt")
train=$((bytes * 95 / 100))
head -c "$train" "$dir/vim-docs.txt" > "$dir/vim-docs-train.txt"
tail -c +"$((train + 1))" "$dir/vim-docs.txt" > "$dir/vim-docs-eval.txt"
rm "$dir/vim-docs.txt"
echo "text_corpus.sh: $train training bytes, $((bytes - train)) held out, from $docs"
