"""The packed layouts of 4-bit and 6-bit weights that ``int4_linear`` / ``int6_linear`` read:
packing a quantized tensor (``pack_int4``, ``pack_int6``) and reading it back (``unpack_*``), in
plain torch. Two layouts each: blocks of 8 output columns (the AVX2 tiles), and pairs of blocks
whose groups alternate (the AVX-512 VNNI and AMX tiles); both give the same values. The byte order
within a group is spelled out in ``int4.cpp`` and ``int6.cpp``."""
from __future__ import annotations

import torch


def _paired_by_default() -> bool:
    """The layout of this CPU's fastest kernel: paired where AVX-512 VNNI is."""
    from tokenleap import kernels
    return kernels.vnni_supported()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
              paired: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit weights ``W[n, k] = scale[n, k // 32] * q[n, k] + mn[n, k // 32]`` -> ``int4_linear``'s
    operands: q uint8 [N, K] in 0..15 (N a multiple of 8 -- of 16 when paired -- and K of 32), scale
    and mn float [N, K/32] (rounded to float16 here). Blocked: packed uint8 [N/8, K/8, 8, 4] and
    float16 [N/8, K/32, 2, 8]; paired: uint8 [N/16, K/32, 2, 128] and float16 [N/16, K/32, 2, 2, 8],
    each pair of 8-column blocks' groups alternating (layouts in ``int4.cpp``). ``paired`` None: the
    layout of this CPU's fastest kernel (paired where AVX-512 VNNI is). Both give the same values."""
    n, k = q.shape
    if paired is None:
        paired = _paired_by_default()
    if n % (16 if paired else 8) or k % 32:
        raise ValueError(f"pack_int4: [{n}, {k}] needs N a multiple of {16 if paired else 8} and K of 32")
    if paired:  # the blocked layout's pairs of blocks, their groups interleaved
        packed, sm = pack_int4(q, scale, mn, paired=False)  # [N/8, K/8, 8, 4], [N/8, G, 2, 8]
        return (packed.reshape(n // 16, 2, k // 32, 128).transpose(1, 2).contiguous(),
                sm.reshape(n // 16, 2, k // 32, 2, 8).transpose(1, 2).contiguous())
    q5 = q.to(torch.uint8).reshape(n // 8, 8, k // 8, 2, 4)  # [blocks, col, kstep, lo/hi, t]
    byte = q5[:, :, :, 0] | (q5[:, :, :, 1] << 4)  # [blocks, col, kstep, t]
    packed = byte.permute(0, 2, 1, 3).contiguous()  # [blocks, kstep, col, t]
    sm = torch.stack([scale.half(), mn.half()], dim=-1)  # [N, G, 2]
    sm = sm.reshape(n // 8, 8, k // 32, 2).permute(0, 2, 3, 1).contiguous()  # [blocks, G, 2, col]
    return packed, sm


def int4_rows_per_entry(packed: torch.Tensor) -> int:
    """Weight rows per index of ``pack_int4``'s packed tensor's first dimension (a block: 8; paired: 16)."""
    return 16 if packed.shape[-1] == 128 else 8


def unpack_int4(packed: torch.Tensor, sm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_int4`` (either layout): (q uint8 [N, K], scale float32 [N, K/32], mn float32 [N, K/32])."""
    if int4_rows_per_entry(packed) == 16:  # paired -> blocked
        npairs, groups = packed.shape[:2]
        packed = packed.transpose(1, 2).reshape(npairs * 2, groups * 4, 8, 4)
        sm = sm.transpose(1, 2).reshape(npairs * 2, groups, 2, 8)
    nb, ks = packed.shape[:2]
    byte = packed.permute(0, 2, 1, 3)  # [blocks, col, kstep, t]
    q = torch.stack([byte & 0x0F, byte >> 4], dim=3).reshape(nb * 8, ks * 8)
    s = sm.permute(0, 3, 1, 2).reshape(nb * 8, sm.shape[1], 2).float()  # [N, G, 2]
    return q, s[..., 0].contiguous(), s[..., 1].contiguous()


def pack_int6(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
              paired: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """6-bit weights ``W[n, k] = d[n, k // 256] * sc[n, k // 16] * (q[n, k] - 32)`` (a Q6_K tensor) ->
    ``int6_linear``'s operands: q uint8 [N, K] in 0..63 (N a multiple of 8, K of 256), sc int8
    [N, K/16], d float [N, K/256]. Blocked: packed uint8 [N/8, K/32, 208] and d float32
    [N/8, K/256, 8]; paired (N a multiple of 16): [N/16, K/32, 2, 208] and [N/16, K/256, 2, 8], each
    pair of 8-column blocks' groups alternating (layouts in ``int6.cpp``). ``paired`` None: paired
    where the CPU has AVX-512 VNNI and N allows it. Both give the same values."""
    n, k = q.shape
    if paired is None:
        paired = n % 16 == 0 and _paired_by_default()
    if paired:
        if n % 16:
            raise ValueError(f"pack_int6: the paired layout needs N a multiple of 16, not {n}")
        packed, dd = pack_int6(q, sc, d, paired=False)  # [N/8, G, 208], [N/8, S, 8]
        return (packed.reshape(n // 16, 2, k // 32, 208).transpose(1, 2).contiguous(),
                dd.reshape(n // 16, 2, k // 256, 8).transpose(1, 2).contiguous())
    q6 = q.to(torch.uint8).reshape(n // 8, 8, k // 32, 4, 2, 4)  # [blocks, col, group, kstep, lo/hi, t]
    low = q6 & 0x0F
    lo_plane = (low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [blocks, group, kstep, col, t]
    top = (q6 >> 4).reshape(n // 8, 8, k // 32, 2, 2, 2, 4)  # [blocks, col, group, pair, step in pair, lo/hi, t]
    hi_plane = (top[:, :, :, :, 0, 0] | (top[:, :, :, :, 0, 1] << 2) | (top[:, :, :, :, 1, 0] << 4)
                | (top[:, :, :, :, 1, 1] << 6)).permute(0, 2, 3, 1, 4)  # [blocks, group, pair, col, t]
    scales = sc.to(torch.int8).view(torch.uint8).reshape(n // 8, 8, k // 32, 2).permute(0, 2, 3, 1)  # [blocks, group, half, col]
    packed = torch.cat([lo_plane.reshape(n // 8, k // 32, 128), hi_plane.reshape(n // 8, k // 32, 64),
                        scales.reshape(n // 8, k // 32, 16)], dim=-1).contiguous()
    dd = d.float().reshape(n // 8, 8, k // 256).permute(0, 2, 1).contiguous()  # [blocks, super, col]
    return packed, dd


def int6_rows_per_entry(packed: torch.Tensor) -> int:
    """Weight rows per index of ``pack_int6``'s packed tensor's first dimension (a block: 8; paired: 16)."""
    return 16 if packed.dim() == 4 else 8


def unpack_int6(packed: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_int6`` (either layout): (q uint8 [N, K], sc int8 [N, K/16], d float32 [N, K/256])."""
    if int6_rows_per_entry(packed) == 16:  # paired -> blocked
        packed = packed.transpose(1, 2).reshape(-1, packed.shape[1], packed.shape[3])
        d = d.transpose(1, 2).reshape(-1, d.shape[1], d.shape[3])
    nb, groups = packed.shape[:2]
    lo_plane = packed[..., :128].reshape(nb, groups, 4, 8, 4).permute(0, 3, 1, 2, 4)  # [blocks, col, group, kstep, t]
    hi_plane = packed[..., 128:192].reshape(nb, groups, 2, 8, 4).permute(0, 3, 1, 2, 4)  # [blocks, col, group, pair, t]
    low = torch.stack([lo_plane & 0x0F, lo_plane >> 4], dim=4)  # [blocks, col, group, kstep, lo/hi, t]
    top = torch.stack([(hi_plane >> s) & 3 for s in (0, 2, 4, 6)], dim=4)  # [blocks, col, group, pair, 4, t]
    q = low | (top.reshape(low.shape) << 4)
    sc = packed[..., 192:].reshape(nb, groups, 2, 8).permute(0, 3, 1, 2).contiguous().view(torch.int8)
    return (q.reshape(nb * 8, groups * 32), sc.reshape(nb * 8, groups * 2),
            d.permute(0, 2, 1).reshape(nb * 8, d.shape[1]))
