# Sourced by tools/prepare-gpu-session (the on-device build of gpu-session's stage 1) and
# tools/check-gpu-deps-offline (not run on its own): unpacks the .deb bundle that
# tools/prepare-gpu-deps downloads (.gpu-deps/debs) into a private prefix, without root, and points
# CMake, the linker and the loader at it.
#
#   gpu_deps_system_complete       true when the system already has every build dependency
#   gpu_deps_unpack DEBS PREFIX    dpkg-deb -x each .deb into PREFIX (ar + tar without dpkg), then
#                                  the fix-ups below; fails if glibc is older than the bundle needs
#   gpu_deps_export PREFIX         CMAKE_PREFIX_PATH, LD_LIBRARY_PATH, PKG_CONFIG_PATH
#
# Fix-ups after extraction (what dpkg's maintainer scripts and an install into /usr would give):
#  - the update-alternatives links of OpenBLAS (libopenblas.so, libopenblas.so.0, libblas.so*,
#    liblapack.so*, cblas.h, f77blas.h, ...) are made as relative links beside the openblas-pthread
#    folders, so FindBLAS (BLA_VENDOR=OpenBLAS) and find_path(cblas.h) find them like on Debian;
#  - absolute /usr paths in the CMake config and pkg-config files (the "/usr move" checks of
#    spdlog, fmt, GTest and benchmark, OpenBLASConfig.cmake's paths, the .pc prefixes) are
#    rewritten to PREFIX/usr, and any absolute symbolic link is made to point into PREFIX.

GPU_DEPS_ARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

gpu_deps_system_complete() {
  local n d found
  for n in spdlog fmt nlohmann_json CLI11 GTest benchmark; do
    found=0
    for d in /usr /usr/local; do
      compgen -G "$d/lib/$GPU_DEPS_ARCH/cmake/$n*/" >/dev/null || compgen -G "$d/lib*/cmake/$n*/" >/dev/null ||
        compgen -G "$d/share/cmake/$n*/" >/dev/null && { found=1; break; }
    done
    ((found)) || return 1
  done
  [[ $(ldconfig -p 2>/dev/null) == *libopenblas.so* ]] || return 1
  [[ -e /usr/include/utf8proc.h ]] || return 1
  [[ -e /usr/include/cblas.h || -e /usr/include/$GPU_DEPS_ARCH/cblas.h ]] ||
    compgen -G "/usr/include/*openblas*/cblas.h" >/dev/null || compgen -G "/usr/include/$GPU_DEPS_ARCH/openblas*/cblas.h" >/dev/null
}

gpu_deps_unpack() {
  local debs=$1 prefix=$2 f
  compgen -G "$debs/*.deb" >/dev/null || { echo "gpu-deps: no .deb files in $debs (run tools/prepare-gpu-deps)" >&2; return 1; }
  mkdir -p "$(dirname "$prefix")"
  prefix=$(cd "$(dirname "$prefix")" && pwd)/$(basename "$prefix")
  local stamp
  stamp="$prefix $(cd "$debs" && ls *.deb | tr '\n' ' ')"
  if [[ -f "$prefix/.unpacked" && -z $(find "$debs" -name '*.deb' -newer "$prefix/.unpacked") &&
        "$(cat "$prefix/.unpacked")" == "$stamp" ]]; then
    return 0  # up to date
  fi
  if [[ -f "$debs/GLIBC_MIN" ]]; then
    local need have
    need=$(cat "$debs/GLIBC_MIN")
    have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    if [[ -n "$have" && "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]]; then
      echo "gpu-deps: the bundle's libraries need glibc >= $need, this machine has $have" >&2
      echo "gpu-deps: run tools/prepare-gpu-deps on a distribution no newer than this one" >&2
      return 1
    fi
  fi
  rm -rf "$prefix" "$prefix.tmp"
  mkdir -p "$prefix.tmp"
  for f in "$debs"/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$prefix.tmp"
    else  # no dpkg: a .deb is an ar archive holding data.tar.{xz,zst,gz}
      local member z
      member=$(ar t "$f" | grep '^data\.tar')
      case "$member" in *.xz) z=-J ;; *.zst) z=--zstd ;; *.gz) z=-z ;; *) z= ;; esac
      ar p "$f" "$member" | tar -x $z -C "$prefix.tmp" -f -
    fi
  done
  rm -rf "$prefix.tmp/usr/share/doc" "$prefix.tmp/usr/share/lintian"
  mv "$prefix.tmp" "$prefix"
  local usr=$prefix/usr lib=$prefix/usr/lib/$GPU_DEPS_ARCH inc=$prefix/usr/include/$GPU_DEPS_ARCH link
  # update-alternatives, as libopenblas0-pthread's and libopenblas-pthread-dev's postinst do.
  for f in "$lib"/openblas-pthread/lib{openblas,blas,lapack}.so*; do
    if [[ -e "$f" ]]; then ln -sfn "openblas-pthread/$(basename "$f")" "$lib/$(basename "$f")"; fi
  done
  for f in "$inc"/openblas-pthread/*.h; do
    if [[ -e "$f" ]]; then ln -sfn "openblas-pthread/$(basename "$f")" "$inc/$(basename "$f")"; fi
  done
  if [[ -e "$inc/openblas-pthread/cblas.h" ]]; then ln -sfn openblas-pthread/cblas.h "$inc/cblas-openblas.h"; fi
  # Absolute links (the debs have none today) point into the prefix.
  while IFS= read -r -d '' link; do
    ln -sfn "$prefix$(readlink "$link")" "$link"
  done < <(find "$prefix" -type l -lname '/*' -print0)
  # Absolute /usr paths in CMake and pkg-config files point into the prefix.
  while IFS= read -r -d '' f; do
    sed -i "s#\(^\|[^A-Za-z0-9_.~/-]\)/usr\([/\"]\|\$\)#\1$usr\2#g" "$f"
  done < <(find "$prefix" \( -name '*.cmake' -o -name '*.pc' \) -type f -print0)
  # Check every one: nothing but comments may still name /usr or /etc outside the prefix.
  local bad=0
  while IFS= read -r -d '' f; do
    if grep -v '^[[:space:]]*#' "$f" | sed "s#$prefix#PREFIX#g" | grep -qE '(^|[^A-Za-z0-9_.~/-])/(usr|etc)/'; then
      echo "gpu-deps: $f still names /usr or /etc" >&2; bad=1
    fi
  done < <(find "$prefix" \( -name '*.cmake' -o -name '*.pc' \) -type f -print0)
  ((bad == 0)) || return 1
  echo "$stamp" >"$prefix/.unpacked"
}

gpu_deps_export() {
  local usr=$1/usr
  local lib=$usr/lib/$GPU_DEPS_ARCH
  export CMAKE_PREFIX_PATH="$usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PKG_CONFIG_PATH="$lib/pkgconfig:$usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
}
