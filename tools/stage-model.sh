#!/bin/bash
# Stages one large file (e.g. a fetched GGUF) on a machine that can only receive the working tree
# of this checkout, a limited number of bytes per transfer, and keeps files between transfers
# only while it stays up: the file is cut into numbered chunks here, each transfer carries one
# chunk, and the far side appends it to a partial file, checking every chunk's sha256 and the
# whole file's at the end.
#
#   here:   tools/stage-model.sh split FILE [DEST] [CHUNK_MIB]
#             cuts FILE into .stage/model/00, 01, ... (git-ignored) and writes .stage/model/MANIFEST
#             (name, size, sha256, chunk size, each chunk's sha256, DEST). DEST is where the file
#             goes on the far side (default: FILE's path with $HOME written as ~, so a file fetched
#             with `doublesparse fetch` lands in the far side's cache and --model-path <name> finds
#             it). CHUNK_MIB defaults to what fits beside the working tree in 64 MiB, less 2 MiB.
#           tools/stage-model.sh plan       prints, for each transfer, the paths to carry
#   there:  tools/stage-model.sh receive    appends the chunks present under .stage/model/ in
#             order (a chunk already appended is dropped, so a repeated transfer is harmless; a
#             chunk that arrives before its predecessor waits), deletes each appended chunk, and
#             once all bytes are in, checks the sha256 and moves the file to DEST. Prints how many
#             bytes it holds and which chunk comes next. Exit status 0 unless a check failed.
#           tools/stage-model.sh status     the same report without appending
#
# Procedure, for a file of N chunks (the 1.1 GB Qwen2.5-Coder-1.5B GGUF: 19 or 20 transfers):
#   1. Here, in the checkout that the transfers send: `tools/stage-model.sh split FILE`.
#   2. Transfer i (i = 00 .. N-1) carries `.stage/model/MANIFEST` and `.stage/model/<i>` and runs
#      `bash tools/stage-model.sh receive`. The chunks must reach one machine that stays up
#      between transfers (it keeps files written outside the carried paths, and the partial file
#      lives under DEST's folder); when a machine is released between transfers the partial
#      file is lost, and `receive` on a fresh one reports chunk 00 as next.
#   3. The last transfer may chain the real work: `bash tools/stage-model.sh receive && ...`.
#      Python packages the far side lacks (the `gguf` reader: see shared/tools or
#      `pip download --no-deps --only-binary=:all: --python-version 3.12 gguf==0.19.0`) travel as
#      wheels beside the chunk, within the same byte limit.
# The chunk files are plain byte ranges: `cat .stage/model/[0-9]* > FILE` also reassembles them.
set -euo pipefail
dir=.stage/model
manifest=$dir/MANIFEST
die() { echo "stage-model: $*" >&2; exit 1; }
field() { sed -n "s/^$1=//p" "$manifest"; }
expand_home() { case "$1" in "~"/*) echo "$HOME/${1#\~/}" ;; *) echo "$1" ;; esac; }

cmd=${1:-}
case "$cmd" in
split)
  file=${2:?usage: stage-model.sh split FILE [DEST] [CHUNK_MIB]}
  [ -f "$file" ] || die "$file does not exist"
  file=$(cd "$(dirname "$file")" && pwd)/$(basename "$file")
  dest=${3:-$file}
  case "$dest" in "$HOME"/*) dest="~/${dest#"$HOME"/}" ;; esac
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.stage/' "$exclude" 2>/dev/null || echo '/.stage/' >> "$exclude"
  if [ -n "${4:-}" ]; then
    chunk=$(( $4 * 1048576 ))
  else
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    chunk=$(( (64 * 1048576 - tree - 2 * 1048576 - 4096) / 1048576 * 1048576 ))
  fi
  [ "$chunk" -ge 1048576 ] || die "no room for a chunk beside the working tree"
  size=$(stat -c %s "$file")
  last=$(( (size + chunk - 1) / chunk - 1 ))
  width=$(( ${#last} > 2 ? ${#last} : 2 ))
  rm -rf "$dir" && mkdir -p "$dir"
  split -b "$chunk" -d -a "$width" "$file" "$dir/"
  {
    echo "name=$(basename "$file")"
    echo "dest=$dest"
    echo "size=$size"
    echo "sha256=$(sha256sum "$file" | cut -d' ' -f1)"
    echo "chunk=$chunk"
    echo "chunks=$(ls "$dir" | grep -c '^[0-9]')"
    (cd "$dir" && sha256sum [0-9]* | sed 's/^\([0-9a-f]*\)  \(.*\)/part \2 \1/')
  } > "$manifest.tmp"
  mv "$manifest.tmp" "$manifest"
  echo "$(field chunks) chunks of $(( chunk / 1048576 )) MiB in $dir; destination there: $(field dest)"
  ;;
plan)
  [ -f "$manifest" ] || die "no $manifest: run split first"
  for p in $(sed -n 's/^part \([0-9]*\) .*/\1/p' "$manifest"); do
    echo "carry [\"$manifest\", \"$dir/$p\"]  command: bash tools/stage-model.sh receive"
  done
  ;;
receive|status)
  [ -f "$manifest" ] || die "no $manifest here: carry it with each chunk"
  dest=$(expand_home "$(field dest)")
  size=$(field size) chunk=$(field chunk) chunks=$(field chunks) sum=$(field sha256)
  partial=$dest.partial
  if [ -f "$dest" ] && [ "$(stat -c %s "$dest")" = "$size" ]; then
    rm -f "$dir"/[0-9]*
    echo "staged: $dest ($size bytes)"
    exit 0
  fi
  mkdir -p "$(dirname "$dest")"
  have=$( [ -f "$partial" ] && stat -c %s "$partial" || echo 0)
  if [ $(( have % chunk )) -ne 0 ] && [ "$have" -ne "$size" ]; then  # an append cut short
    have=$(( have / chunk * chunk ))
    truncate -s "$have" "$partial"
  fi
  if [ "$cmd" = receive ]; then
    for f in $(ls "$dir" | grep '^[0-9][0-9]*$' | sort -n); do
      off=$(( 10#$f * chunk ))
      if [ "$off" -lt "$have" ]; then rm -f "$dir/$f"; continue; fi
      [ "$off" -eq "$have" ] || break
      want=$(sed -n "s/^part $f //p" "$manifest")
      got=$(sha256sum "$dir/$f" | cut -d' ' -f1)
      if [ "$got" != "$want" ]; then rm -f "$dir/$f"; die "chunk $f is corrupt (sha256 $got); send it again"; fi
      cat "$dir/$f" >> "$partial"
      rm -f "$dir/$f"
      have=$(stat -c %s "$partial")
    done
    if [ "$have" -eq "$size" ]; then
      got=$(sha256sum "$partial" | cut -d' ' -f1)
      [ "$got" = "$sum" ] || { rm -f "$partial"; die "assembled file has sha256 $got, expected $sum; start again"; }
      mv "$partial" "$dest"
      echo "staged: $dest ($size bytes, sha256 ok)"
      exit 0
    fi
  fi
  next=$(sed -n 's/^part \([0-9]*\) .*/\1/p' "$manifest" | sed -n "$(( have / chunk + 1 ))p")
  echo "have $have of $size bytes; next chunk: $next (of $chunks: 0 .. $(( chunks - 1 )))"
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [ -z "$cmd" ] || exit 2
  ;;
esac
