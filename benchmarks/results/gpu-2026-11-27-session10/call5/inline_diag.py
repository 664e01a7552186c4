"""Which error messages crash a torch extension on this machine: one tiny extension built with load_inline,
each function called in its own process."""
import os
import subprocess
import sys
import time

from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <sstream>
void err_text() { TORCH_CHECK(false, "text only ", at::kFloat); }
void err_int() { TORCH_CHECK(false, "an int ", int64_t(5)); }
void err_shape() { auto t = at::empty({2, 5}); TORCH_CHECK(false, "a shape ", t.sizes()); }
void err_to_string() { TORCH_CHECK(false, "to_string ", std::to_string(int64_t(5))); }
std::string stream_int() { std::ostringstream ss; ss << int64_t(5); return ss.str(); }
'''
FUNCS = ["err_text", "err_int", "err_shape", "err_to_string", "stream_int"]
if len(sys.argv) > 1:
    mod = load_inline("diag_ext", cpp_sources=SRC, functions=FUNCS, build_directory="/tmp/diag_ext",
                      verbose=False)
    try:
        print(sys.argv[1], "->", repr(getattr(mod, sys.argv[1])()))
    except Exception as e:
        print(sys.argv[1], "-> raised", type(e).__name__, str(e).splitlines()[0][:80])
    sys.exit(0)
os.makedirs("/tmp/diag_ext", exist_ok=True)
t0 = time.time()
load_inline("diag_ext", cpp_sources=SRC, functions=FUNCS, build_directory="/tmp/diag_ext", verbose=False)
print(f"built in {time.time() - t0:.0f} s; CXX={os.environ.get('CXX')}", flush=True)
for f in FUNCS:
    r = subprocess.run([sys.executable, __file__, f], capture_output=True, text=True, timeout=60)
    print(f"{f}: rc={r.returncode} {r.stdout.strip()[:120]}", flush=True)
