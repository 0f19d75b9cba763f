#!/usr/bin/env bash
# Prints the C/C++ flags a llama.cpp build needs on this processor beyond -march=native, or nothing.
#
# Today one case: a processor that lists AMX but cannot run it. Some virtual machines pass the CPUID
# bits through without enabling the tile state; llama.cpp built with -march=native then dies of an
# illegal instruction in its first batch large enough for its AMX kernels. The processor itself is
# asked: a ten-line probe configures a tile and zeroes it. GCC lets an explicit -mno- win over
# -march=native, so the flags printed turn AMX off and keep everything else native.
# Used by scripts/bootstrap.sh (llama-cpp-python) and bench/llama_server.py (llama-server).
set -u
grep -qw amx_tile /proc/cpuinfo 2>/dev/null || exit 0
command -v cc > /dev/null || exit 0
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cat > "$dir/probe.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64] __attribute__((aligned(64)));
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 1;
    memset(config, 0, sizeof config);
    config[0] = 1; config[16] = 64; config[48] = 16;  /* palette 1; tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
cc -O1 -mamx-tile "$dir/probe.c" -o "$dir/probe" 2> /dev/null || exit 0
{ "$dir/probe"; } > /dev/null 2>&1 || echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
