"""A minimal extension built here: does a TORCH_CHECK with a formatted message reach Python?"""
import sys, torch
from torch.utils.cpp_extension import load_inline
print("torch", torch.__version__, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI)
src = r'''
#include <torch/extension.h>
void plain(int64_t k) { TORCH_CHECK(k == 0, "plain message"); }
void formatted(int64_t k) { TORCH_CHECK(k == 0, "x has ", k, " inputs"); }
'''
m = load_inline("abi_probe", cpp_sources=src, functions=["plain", "formatted"], build_directory=None, verbose=False)
fn = getattr(m, sys.argv[1])
try:
    fn(3)
except RuntimeError as e:
    print(sys.argv[1], "raised:", str(e).splitlines()[0])
