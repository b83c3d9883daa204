#!/usr/bin/env bash
# Fetches Debian's stock cloud kernel (the image package that `linux-image-cloud-amd64` depends
# on) with apt into resources/cache/ and prints the path of its vmlinuz (a bzImage). Also unpacks
# the ELF vmlinux inside it next to it (boot/vmlinux-VERSION), when the tool for its compression
# (lz4, xz, zstd or gzip) is there: that one boots through PVH without the decompressor.
#
# Idempotent: a kernel already unpacked is reused without touching the network. Needs apt-get
# and dpkg-deb (Debian); `apt-get update` runs only when apt does not know the package yet.
# Exits non-zero, with the reason on stderr, when the kernel cannot be had; the boot tests then
# skip loudly.
set -euo pipefail

root="$(cd "$(dirname "$0")" && pwd)"
cache="$root/cache/kernel"
meta=linux-image-cloud-amd64

# Unpacks the ELF vmlinux from bzImage $1 into $2: the payload's offset and length are in the
# setup header (setup_sects at 0x1f1, payload_offset at 0x248, payload_length at 0x24c).
extract_vmlinux() {
    local bz="$1" out="$2" sects offset length magic unpack
    [ -f "$out" ] && return 0
    sects=$(od -An -tu1 -j $((0x1f1)) -N1 "$bz" | tr -d ' ')
    offset=$(od -An -tu4 -j $((0x248)) -N4 "$bz" | tr -d ' ')
    length=$(od -An -tu4 -j $((0x24c)) -N4 "$bz" | tr -d ' ')
    offset=$(((sects + 1) * 512 + offset))
    magic=$(od -An -tx1 -j "$offset" -N4 "$bz" | tr -d ' ')
    case "$magic" in
        02214c18) unpack="lz4 -dc" ;;
        fd377a58) unpack="xz -dc" ;;
        28b52ffd) unpack="zstd -dc" ;;
        1f8b*) unpack="gzip -dc" ;;
        *) echo "fetch-kernel: unknown compression ($magic) in $bz: no vmlinux" >&2; return 0 ;;
    esac
    if ! command -v "${unpack%% *}" >/dev/null 2>&1; then
        echo "fetch-kernel: ${unpack%% *} not found: no vmlinux" >&2
        return 0
    fi
    # The decompressors stop at the end of their stream; a trailing size word is ignored.
    tail -c +$((offset + 1)) "$bz" | head -c "$length" | $unpack >"$out.tmp" 2>/dev/null || true
    if [ "$(od -An -tx1 -N4 "$out.tmp" | tr -d ' ')" = 7f454c46 ]; then
        mv "$out.tmp" "$out"
    else
        rm -f "$out.tmp"
        echo "fetch-kernel: unpacking the vmlinux from $bz failed" >&2
    fi
}

# busybox-static's binary, for the initramfs of the boot test on hosts with hardware
# virtualisation (resources/cache/kernel/busybox). Best effort.
fetch_busybox() {
    [ -x "$cache/busybox" ] && return 0
    local work
    work="$(mktemp -d "$cache/tmp.XXXXXX")"
    if (cd "$work" && apt-get download -q "${sandbox[@]}" busybox-static >&2) &&
        dpkg-deb -x "$work"/busybox-static_*.deb "$work/root" &&
        [ -x "$work/root/bin/busybox" ]; then
        mv "$work/root/bin/busybox" "$cache/busybox"
    else
        echo "fetch-kernel: busybox-static could not be fetched" >&2
    fi
    rm -rf "$work"
}

# As root, apt fetches as its sandbox user, which cannot write this directory.
sandbox=()
[ "$(id -u)" -eq 0 ] && sandbox=(-o APT::Sandbox::User=root)
mkdir -p "$cache"

# Already fetched: print it and stop.
if [ -f "$cache/vmlinuz.path" ]; then
    vmlinuz="$(cat "$cache/vmlinuz.path")"
    if [ -f "$vmlinuz" ]; then
        extract_vmlinux "$vmlinuz" "${vmlinuz/vmlinuz-/vmlinux-}"
        fetch_busybox
        echo "$vmlinuz"
        exit 0
    fi
fi

for tool in apt-get apt-cache dpkg-deb; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "fetch-kernel: $tool not found: this script needs Debian's apt and dpkg" >&2
        exit 1
    fi
done

# The metapackage depends on the versioned image package, e.g. linux-image-6.1.0-56-cloud-amd64.
image_package() {
    apt-cache depends "$meta" 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n 1
}
package="$(image_package)"
if [ -z "$package" ]; then
    echo "fetch-kernel: apt does not know $meta yet: running apt-get update" >&2
    apt-get update -qq >&2 || echo "fetch-kernel: apt-get update failed" >&2
    package="$(image_package)"
fi
if [ -z "$package" ]; then
    echo "fetch-kernel: cannot find the image package $meta depends on" >&2
    exit 1
fi

work="$(mktemp -d "$cache/tmp.XXXXXX")"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q "${sandbox[@]}" "$package" >&2) || {
    echo "fetch-kernel: apt-get download $package failed" >&2
    exit 1
}
deb="$(ls "$work"/*.deb)"
dest="$cache/$package"
rm -rf "$dest"
mkdir -p "$dest"
dpkg-deb -x "$deb" "$dest"
vmlinuz="$(ls "$dest"/boot/vmlinuz-* | head -n 1)"
if [ ! -f "$vmlinuz" ]; then
    echo "fetch-kernel: $deb holds no /boot/vmlinuz-*" >&2
    exit 1
fi
extract_vmlinux "$vmlinuz" "${vmlinuz/vmlinuz-/vmlinux-}"
fetch_busybox
echo "$vmlinuz" >"$cache/vmlinuz.path"
echo "$vmlinuz"
