#!/usr/bin/env bash
# Find ONNX Runtime C/C++ headers for building libdflash_ops.so and print the include directory
# (the folder that holds onnxruntime_cxx_api.h) on stdout. Progress messages go to stderr.
#
# Search order:
#   1. $ORT_INCLUDE_DIR (explicit override)
#   2. /usr/include/onnxruntime (Debian/Ubuntu package libonnxruntime-dev)
#   3. headers fetched earlier into ops/build/ort-headers/
#   4. fetch Debian trixie's libonnxruntime-dev .deb with apt-get, using a private sources list and
#      private state/cache folders (the system's apt configuration is never touched), and unpack it
#      with dpkg -x into ops/build/ort-headers/.
# The library only needs headers: it gets the API table from the runtime at load time.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$here/build/ort-headers"
suite="${DFLASH_ORT_DEB_SUITE:-trixie}"

has_headers() { [ -f "$1/onnxruntime_c_api.h" ] && [ -f "$1/onnxruntime_cxx_api.h" ]; }

if [ -n "${ORT_INCLUDE_DIR:-}" ]; then
    if has_headers "$ORT_INCLUDE_DIR"; then echo "$ORT_INCLUDE_DIR"; exit 0; fi
    echo "get_ort_headers: ORT_INCLUDE_DIR=$ORT_INCLUDE_DIR has no onnxruntime_c_api.h /" \
         "onnxruntime_cxx_api.h" >&2
    exit 1
fi

for d in /usr/include/onnxruntime /usr/local/include/onnxruntime "$dest/usr/include/onnxruntime"; do
    if has_headers "$d"; then echo "$d"; exit 0; fi
done

how_to() {
    cat >&2 <<MSG
get_ort_headers: could not get the ONNX Runtime headers ($1).
Get them one of these ways, then run 'bash ops/build.sh' again:
  * Debian trixie or newer:  apt-get install libonnxruntime-dev
  * or download the onnxruntime release archive matching your onnxruntime version
    (onnxruntime-linux-x64-<version>.tgz from the ONNX Runtime GitHub releases), unpack it and run
       ORT_INCLUDE_DIR=/path/to/onnxruntime-linux-x64-<version>/include bash ops/build.sh
Headers of ONNX Runtime 1.17 (API 17) or newer work, with that or any newer onnxruntime.
MSG
    exit 1
}

command -v apt-get >/dev/null && command -v dpkg >/dev/null || how_to "apt-get/dpkg not found"

echo "get_ort_headers: fetching libonnxruntime-dev from Debian $suite (private apt state in $dest/apt)" >&2
apt_dir="$dest/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/deb"
echo "deb http://deb.debian.org/debian $suite main" > "$apt_dir/sources.list"
apt_opts=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir/cache"
    -o "APT::Sandbox::User=root"
)
apt-get "${apt_opts[@]}" -qq update >&2 || how_to "apt-get update of the $suite list failed"
( cd "$apt_dir/deb" && apt-get "${apt_opts[@]}" -qq download libonnxruntime-dev >&2 ) \
    || how_to "apt-get download libonnxruntime-dev failed"
deb="$(ls "$apt_dir"/deb/libonnxruntime-dev_*.deb 2>/dev/null | head -n 1)"
[ -n "$deb" ] || how_to "no .deb was downloaded"
dpkg -x "$deb" "$dest" || how_to "dpkg -x $deb failed"

rm -rf "$apt_dir/lists" "$apt_dir/cache"  # the package lists are no longer needed
inc="$dest/usr/include/onnxruntime"
has_headers "$inc" || how_to "the package $deb has no headers under usr/include/onnxruntime"
echo "get_ort_headers: headers from $(basename "$deb") in $inc" >&2
echo "$inc"
