#!/usr/bin/env python3
"""The kernel cache entry smoe would write on a GPU (crates/cuda/src/lib.rs, compile_kernels),
made here with NVRTC and no GPU, so that a device call carries its PTX instead of compiling it
there (and so that a kernel that does not compile is caught before a device call).

    pip install --target /tmp/nvrtc "nvidia-cuda-nvrtc==13.0.*"
    python3 bench/ptx_cache.py [ARCH]      # ARCH: sm_90 (default)

Writes target/ptxcache/smoe/kernels-<fnv1a64 of the source>-<ARCH>.ptx; a device call sets
XDG_CACHE_HOME=$PWD/target/ptxcache. The sources are concatenated in lib.rs's order (its
`KERNELS`), read from there. On a compile error, prints NVRTC's log and exits 1.
"""
import ctypes, os, re, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
src_dir = os.path.join(root, "crates/cuda/src")
arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
lib_rs = open(os.path.join(src_dir, "lib.rs")).read()
block = re.search(r"const KERNELS: &str = concat!\((.*?)\);", lib_rs, re.S).group(1)
names = re.findall(r'include_str!\("([^"]+)"\)', block)
src = "".join(open(os.path.join(src_dir, n)).read() for n in names).encode()
h = 0xCBF29CE484222325
for b in src:
    h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
nvrtc = os.environ.get("NVRTC", "/tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13")
# NVRTC opens its builtins library by name: load it from beside it first.
ctypes.CDLL(os.path.join(os.path.dirname(nvrtc), "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(nvrtc)
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, None, 0, None, None) == 0
opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
rc = lib.nvrtcCompileProgram(prog, 1, opts)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
if rc != 0:
    sys.stderr.write(log.value.decode(errors="replace"))
    sys.exit(1)
if log.value.strip():
    sys.stderr.write(log.value.decode(errors="replace"))
lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
lib.nvrtcGetPTX(prog, ptx)
d = os.path.join(root, "target/ptxcache/smoe")
os.makedirs(d, exist_ok=True)
p = f"{d}/kernels-{h:016x}-{arch}.ptx"
open(p, "w").write(ptx.value.decode())
print(p, f"({len(names)} sources)")
