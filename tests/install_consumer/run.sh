#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then configures, builds and runs the consumer.
set -euo pipefail
build_dir=$1
work=$2
rm -rf "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$(dirname "$0")" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
