"""Does a C++ TORCH_CHECK throw reach Python on this machine? One case per process."""
import sys
import torch
from tokenleap import kernels
kernels.available()
case = sys.argv[1]
try:
    if case == "int4":
        q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
        s = torch.rand(32, 2) * 0.02
        p, sm = kernels.pack_int4(q, s, -8 * s)
        torch.ops.tokenleap.int4_linear(torch.randn(2, 96), p, sm, None)
    elif case == "amx":
        packed = kernels.pack_bf16_amx(torch.randn(32, 64).bfloat16())
        torch.ops.tokenleap.bf16_amx_linear(torch.randn(2, 96), packed)
    elif case == "amxdtype":
        packed = kernels.pack_bf16_amx(torch.randn(32, 64).bfloat16())
        torch.ops.tokenleap.bf16_amx_linear(torch.randn(2, 64).bfloat16(), packed)
    elif case == "rows":
        torch.ops.tokenleap.amx_int8_rows(4)
        print("rows ok")
        raise SystemExit(0)
    print(case, "NO ERROR RAISED")
except RuntimeError as e:
    print(case, "raised:", str(e).splitlines()[0][:150])
