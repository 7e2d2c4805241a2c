#!/usr/bin/env bash
# Unpacks fio from Debian packages into .deps/fio (git-ignored), for a machine without
# fio and without internet (the GPU machine): run it here, carry .deps/fio there.
#
# `apt-get download fio`, then the packages of the shared libraries fio needs (ldd) that
# a plain Debian 12 / Ubuntu 22.04+ with Python 3 may lack: everything but BASE below
# (glibc, and what python3 and apt themselves link). Each is unpacked with dpkg -x; all
# but the binary, the libraries it loads and the packages' copyright files is removed.
# The benches (statepager.tools.bench.floor) find .deps/fio/usr/bin/fio and run it with
# LD_LIBRARY_PATH set to its library folders. Needs a Debian-family machine whose
# release matches the target's glibc or is older (Debian 12: glibc >= 2.34 needed).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-$PWD/.deps/fio}
# Present on a plain Debian/Ubuntu with Python 3 (glibc; libraries python3 and apt link).
BASE=${BASE:-"libc6 libgcc-s1 libstdc++6 zlib1g libssl3 libffi8 liblzma5 libbz2-1.0 \
libzstd1 libselinux1 libpcre2-8-0 libuuid1 libblkid1 libudev1 libgnutls30 libgmp10 \
libnettle8 libhogweed6 libidn2-0 libunistring2 libtasn1-6 libp11-kit0 libacl1 \
libcom-err2 libkeyutils1"}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST"
(cd "$work" && apt-get download fio >/dev/null)
dpkg -x "$work"/fio_*.deb "$DEST"
fio="$DEST/usr/bin/fio"

# The libraries fio loads, as this machine resolves them, and the package of each.
libs=$(ldd "$fio" | awk '/=>/ && $3 ~ /^\// {print $3}')
packages=""
for lib in $libs; do
  real=$(readlink -f "$lib")
  pkg=$(dpkg -S "$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true)
  pkg=${pkg%%:*}
  if [ -z "$pkg" ]; then
    echo "fetch_fio: no package owns $lib: install fio's dependencies here first" >&2
    exit 1
  fi
  case " $BASE " in *" $pkg "*) continue ;; esac
  case " $packages " in *" $pkg "*) ;; *) packages="$packages $pkg" ;; esac
done
if [ -n "$packages" ]; then
  # shellcheck disable=SC2086
  (cd "$work" && apt-get download $packages >/dev/null)
  for deb in "$work"/*.deb; do
    case "$deb" in */fio_*) continue ;; esac
    dpkg -x "$deb" "$DEST"
  done
fi

# Keep the binary, the libraries fio loads (and their symlinks), and the copyrights.
keep="$work/keep"
echo "$fio" >"$keep"
for lib in $libs; do
  name=$(basename "$lib")
  find "$DEST" -name "$name" >>"$keep"
  find "$DEST" -name "$name" -type l -exec readlink -f {} \; >>"$keep"
done
find "$DEST" -path '*/usr/share/doc/*/copyright' >>"$keep"
find "$DEST" \( -type f -o -type l \) | grep -vxFf "$keep" | xargs -r rm -f
find "$DEST" -depth -type d -empty -delete

# Run it as the bench will: with its own library folders first.
lib_path=$(find "$DEST" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)
LD_LIBRARY_PATH="$lib_path" "$fio" --version
echo "fetch_fio: $DEST ($(du -sh "$DEST" | cut -f1)), packages: fio$packages"
echo "fetch_fio: libraries taken from the system (BASE):"
LD_LIBRARY_PATH="$lib_path" ldd "$fio" | awk '/=>/ && $3 !~ /\.deps\/fio/ {print "  " $1}'
# PACK=1: also .deps/fio.tar.xz (about 17 MB instead of 68), for a copy with a size limit;
# scripts/gpu.sh unpacks it when .deps/fio is missing.
if [ -n "${PACK:-}" ]; then
  tar -C "$(dirname "$DEST")" -cf - "$(basename "$DEST")" | xz -T0 >"$DEST.tar.xz"
  echo "fetch_fio: $DEST.tar.xz ($(du -sh "$DEST.tar.xz" | cut -f1))"
fi
