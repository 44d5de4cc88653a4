#!/usr/bin/env bash
# The target's own answers (scripts/scale_regenerate.sh) kept in git, so that a fresh machine goes on with the
# regeneration where it stood instead of redoing hours of it (about 0.65 answers/s on one core through vLLM's CPU
# server: 3,000 answers are 80 minutes). The answers are text, a few hundred bytes each compressed; the archive
# stops at MAX_KIB (default 6,144) in all, so the repository never carries more than a few MiB of them.
#
#   bash scripts/scale_archive.sh save       # the lines of $R/regenerated-R.jsonl not yet archived -> the next part
#   bash scripts/scale_archive.sh restore    # $R/regenerated-R.jsonl rebuilt from the parts where it holds fewer lines
#   bash scripts/scale_archive.sh status     # what is archived, what is on disk
#
# $A/parts.tsv lists the parts: file, first line, end line (lines of regenerated-R.jsonl), sha256 of the part's
# uncompressed lines. `restore` checks every part against it and that the file on disk is a prefix of the archive,
# and stops with one line naming the file that differs; nothing already written is lost (a longer file on disk is
# left as it is). scripts/scale_regenerate.sh restores before it resumes.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
R=${R:-runs/scale}
A=${A:-datasets/smollm2-135m-regenerated}
MAX_KIB=${MAX_KIB:-6144}
SRC=$R/regenerated-R.jsonl
LIST=$A/parts.tsv

archived_end() { [ -s "$LIST" ] && tail -n 1 "$LIST" | cut -f3 || echo 0; }
lines_of() { [ -f "$1" ] && wc -l < "$1" || echo 0; }  # complete lines: a record is written as one line

# the archive's lines, every part checked against its sha256, to stdout
unpack() {
  [ -s "$LIST" ] || return 0
  local part first end sha
  while IFS=$'\t' read -r part first end sha; do
    local got
    got=$(gzip -dc "$A/$part" | sha256sum | cut -d' ' -f1) || { echo "$A/$part: cannot be read" >&2; return 1; }
    [ "$got" = "$sha" ] || { echo "$A/$part: its lines do not match $LIST (sha256 $got, listed $sha)" >&2; return 1; }
    [ "$(gzip -dc "$A/$part" | wc -l)" -eq "$((end - first))" ] || { echo "$A/$part: not lines $first-$end" >&2; return 1; }
    gzip -dc "$A/$part"
  done < "$LIST"
}

case ${1:-status} in
  save)
    [ -f "$SRC" ] || { echo "no $SRC: nothing to archive" >&2; exit 2; }
    start=$(archived_end) end=$(lines_of "$SRC")
    [ "$end" -ge "$start" ] || { echo "$SRC has $end lines, the archive $start: restore first" >&2; exit 2; }
    [ "$end" -gt "$start" ] || { echo "nothing new: $A holds lines 0-$start, $SRC has $end"; exit 0; }
    # the file on disk must go on from the archive, not be another regeneration
    unpack > "$SRC.archived" || { rm -f "$SRC.archived"; exit 2; }
    trap 'rm -f "$SRC.archived"' EXIT
    if ! cmp -s "$SRC.archived" <(head -n "$start" "$SRC"); then
      echo "$SRC: its first $start lines are not the archived ones; R=... for another run, or move it aside" >&2
      exit 2
    fi
    mkdir -p "$A"
    part=part-$(printf %02d "$(( $(lines_of "$LIST") + 1 ))").jsonl.gz
    sed -n "$((start + 1)),${end}p" "$SRC" | gzip -n -9 > "$A/$part.tmp"
    used=$(du -k -c "$A/$part.tmp" "$A"/*.gz | tail -n 1 | cut -f1)
    if [ "$used" -gt "$MAX_KIB" ]; then
      rm -f "$A/$part.tmp"
      echo "the archive would hold $used KiB, over MAX_KIB=$MAX_KIB: keep the answers past line $start outside git" >&2
      exit 2
    fi
    mv "$A/$part.tmp" "$A/$part"
    sha=$(gzip -dc "$A/$part" | sha256sum | cut -d' ' -f1)
    printf '%s\t%s\t%s\t%s\n' "$part" "$start" "$end" "$sha" >> "$LIST"
    echo "$A/$part: lines $start-$end of $SRC ($(du -k "$A/$part" | cut -f1) KiB; the archive $used KiB)"
    ;;
  restore)
    total=$(archived_end) have=$(lines_of "$SRC")
    [ "$total" -gt 0 ] || { echo "$A holds no answers yet"; exit 0; }
    if [ "$have" -ge "$total" ]; then
      unpack > "$SRC.archived" || { rm -f "$SRC.archived"; exit 2; }
      trap 'rm -f "$SRC.archived"' EXIT
      cmp -s "$SRC.archived" <(head -n "$total" "$SRC") \
        || { echo "$SRC: its first $total lines are not the archived ones; move it aside to restore" >&2; exit 2; }
      echo "$SRC already holds the $total archived lines ($have in all)"
      exit 0
    fi
    mkdir -p "$R"
    unpack > "$SRC.restore" || { rm -f "$SRC.restore"; exit 2; }
    if [ "$have" -gt 0 ] && ! cmp -s <(head -n "$have" "$SRC.restore") <(head -n "$have" "$SRC"); then
      rm -f "$SRC.restore"
      echo "$SRC: its $have lines are not the archive's first ones; move it aside to restore" >&2
      exit 2
    fi
    mv "$SRC.restore" "$SRC"
    echo "$SRC: $total lines from $A (it held $have)"
    ;;
  status)
    echo "$A: lines 0-$(archived_end) in $(lines_of "$LIST") parts, $(cat /dev/null "$A"/*.gz | wc -c) bytes"
    echo "$SRC: $(lines_of "$SRC") lines"
    ;;
  *) echo "usage: bash scripts/scale_archive.sh save|restore|status" >&2; exit 2 ;;
esac
