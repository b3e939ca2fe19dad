"""Independent, per-element reference implementations of the layouts in docs/formats.md §1-§5.

Deliberately naive: Python loops over elements and Python ints, written straight from the prose of
docs/formats.md (the AutoGPTQ 3-bit bullet list, the `marlin_utils_test` reference construction with its
`perm` list, the CUDA-derived closed forms, DeepGEMM's per_block_cast_to_fp8 as described). Used
only by tests and by bench/repack.py (on small slices) to check the vectorized library code.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
AWQ_ORDER = {4: [0, 2, 4, 6, 1, 3, 5, 7], 8: [0, 2, 1, 3]}
MARLIN_INTERLEAVE = {4: [0, 2, 4, 6, 1, 3, 5, 7], 8: [0, 2, 1, 3]}


def to_int32(u: int) -> int:
    """uint32 value -> int32 value with the same bits."""
    u &= 0xFFFFFFFF
    return u - (1 << 32) if u >= (1 << 31) else u


def pack_sequence(values: list[int], bits: int) -> list[int]:
    """Standard packing of a 1-D run (zero-padded); 3-bit uses AutoGPTQ's 3-words-per-32 scheme."""
    if bits == 3:
        return _pack3_sequence(values)
    pf = 32 // bits
    padded = values + [0] * (-len(values) % pf)
    words = []
    for m in range(len(padded) // pf):
        word = 0
        for t in range(pf):
            word |= padded[pf * m + t] << (bits * t)
        words.append(to_int32(word))
    return words


def unpack_sequence(words: list[int], bits: int, count: int) -> list[int]:
    if bits == 3:
        return _unpack3_sequence(words)[:count]
    pf = 32 // bits
    mask = (1 << bits) - 1
    return [((words[i // pf] & 0xFFFFFFFF) >> (bits * (i % pf))) & mask for i in range(count)]


def _pack3_sequence(values: list[int]) -> list[int]:
    """docs/formats.md §1.1, bit by bit as the bullet list states it."""
    padded = values + [0] * (-len(values) % 32)
    words = []
    for u in range(len(padded) // 32):
        q = padded[32 * u : 32 * u + 32]
        w0 = w1 = w2 = 0
        for j in range(10):
            w0 |= q[j] << (3 * j)
        w0 |= (q[10] & 0b11) << 30
        w1 |= (q[10] >> 2) & 1
        for j in range(10):
            w1 |= q[11 + j] << (1 + 3 * j)
        w1 |= (q[21] & 1) << 31
        w2 |= (q[21] >> 1) & 0b11
        for j in range(10):
            w2 |= q[22 + j] << (2 + 3 * j)
        words += [to_int32(w0), to_int32(w1), to_int32(w2)]
    return words


def _unpack3_sequence(words: list[int]) -> list[int]:
    out = []
    for u in range(len(words) // 3):
        w0, w1, w2 = (words[3 * u + i] & 0xFFFFFFFF for i in range(3))
        q = [0] * 32
        for j in range(10):
            q[j] = (w0 >> (3 * j)) & 7
            q[11 + j] = (w1 >> (1 + 3 * j)) & 7
            q[22 + j] = (w2 >> (2 + 3 * j)) & 7
        q[10] = ((w0 >> 30) & 0b11) | ((w1 & 1) << 2)
        q[21] = ((w1 >> 31) & 1) | ((w2 & 0b11) << 1)
        out += q
    return out


def ref_pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(K, N) -> packed along K, one column at a time."""
    cols = [pack_sequence([int(v) for v in q[:, n].tolist()], bits) for n in range(q.shape[1])]
    return torch.tensor(cols, dtype=torch.int32).T.contiguous()


def ref_pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    rows = [pack_sequence([int(v) for v in q[r].tolist()], bits) for r in range(q.shape[0])]
    return torch.tensor(rows, dtype=torch.int32)


def ref_unpack_cols(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    return torch.tensor([unpack_sequence(row, bits, count) for row in packed.tolist()], dtype=torch.uint8)


def ref_awq_pack(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """(R, C) natural order -> AWQ-GEMM packing: nibble i of column c holds column pf*c + order[i]."""
    pf = 32 // bits
    order = AWQ_ORDER[bits]
    out = []
    for row in q.tolist():
        words = []
        for c in range(len(row) // pf):
            word = 0
            for i in range(pf):
                word |= int(row[pf * c + order[i]]) << (bits * i)
            words.append(to_int32(word))
        out.append(words)
    return torch.tensor(out, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Marlin (docs/formats.md §4)
# ---------------------------------------------------------------------------------------------


def ref_marlin_weight_perm(bits: int) -> list[int]:
    """`get_weight_perm` as described in docs/formats.md §4.2 step 2 (1024 entries)."""
    perm: list[int] = []
    for i in range(32):
        col = i // 4
        perm1 = []
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm += [p + 256 * j for p in perm1]
    il = MARLIN_INTERLEAVE[bits]
    out = []
    for g in range(len(perm) // len(il)):
        out += [perm[g * len(il) + il[t]] for t in range(len(il))]
    return out


def ref_marlin_repack(q: torch.Tensor, bits: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The reference construction: (K, N) codes -> tiles -> perm -> standard pack. Returns int32."""
    k, n = q.shape
    rows = q.tolist()
    if perm is not None:
        rows = [rows[int(p)] for p in perm.tolist()]
    wperm = ref_marlin_weight_perm(bits)
    pf = 32 // bits
    out = []
    for kt in range(k // 16):
        tiled = [0] * (16 * n)
        for nt16 in range(n // 16):
            for r in range(16):
                for c in range(16):
                    tiled[(nt16 * 16 + r) * 16 + c] = rows[16 * kt + r][16 * nt16 + c]
        res = [0] * (16 * n)
        for chunk in range(16 * n // 1024):
            for p in range(1024):
                res[1024 * chunk + p] = tiled[1024 * chunk + wperm[p]]
        out.append(pack_sequence(res, bits)[: 16 * n // pf])
    return torch.tensor(out, dtype=torch.int32)


def ref_marlin_closed_form(q: torch.Tensor, bits: int) -> torch.Tensor:
    """docs/formats.md §4.2 closed form (derived from the CUDA kernel), element by element."""
    k, n = q.shape
    rows = q.tolist()
    off = [0, 1, 8, 9]
    pf = 32 // bits
    out = [[0] * (16 * n // pf) for _ in range(k // 16)]

    def at(kt: int, nt: int, th: int, w: int, v: int) -> int:
        r = 16 * kt + 2 * (th % 4) + off[v % 4]
        c = 64 * nt + 16 * w + th // 4 + 8 * (v // 4)
        return rows[r][c]

    for kt in range(k // 16):
        for nt in range(n // 64):
            for th in range(32):
                for w in range(4):
                    if bits == 4:
                        word = 0
                        for t, v in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
                            word |= at(kt, nt, th, w, v) << (4 * t)
                        out[kt][128 * nt + 4 * th + w] = to_int32(word)
                    else:
                        for h in (0, 1):
                            word = 0
                            for t, s in enumerate([0, 2, 1, 3]):
                                word |= at(kt, nt, th, w, 4 * h + s) << (8 * t)
                            out[kt][256 * nt + 8 * th + 2 * w + h] = to_int32(word)
    return torch.tensor(out, dtype=torch.int32)


def ref_scale_perms() -> tuple[list[int], list[int]]:
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return scale_perm, single


def ref_permute_scales(s: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    scale_perm, single = ref_scale_perms()
    perm = scale_perm if (group_size < k and group_size != -1) else single
    flat = s.reshape(-1).tolist()
    out = []
    for chunk in range(len(flat) // len(perm)):
        out += [flat[chunk * len(perm) + p] for p in perm]
    return torch.tensor(out, dtype=s.dtype).reshape(s.shape)


def ref_permute_scales_closed_form(s: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    g, n = s.shape
    out = torch.empty_like(s)
    o = [0, 1, 8, 9, 16, 17, 24, 25]
    for r in range(g):
        if group_size != -1 and group_size < k:
            for c in range(n // 64):
                for i in range(8):
                    for j in range(8):
                        out[r, 64 * c + 8 * i + j] = s[r, 64 * c + i + 8 * j]
        else:
            for c in range(n // 32):
                for i in range(4):
                    for t in range(8):
                        out[r, 32 * c + 8 * i + t] = s[r, 32 * c + 2 * i + o[t]]
    return out


def ref_marlin_zero_points(zp: torch.Tensor, bits: int) -> torch.Tensor:
    """(G, N) -> scale_perm per 64-chunk, interleave, standard pack along N."""
    scale_perm, _ = ref_scale_perms()
    il = MARLIN_INTERLEAVE[bits]
    out = []
    for row in zp.tolist():
        permuted = []
        for chunk in range(len(row) // 64):
            permuted += [row[64 * chunk + p] for p in scale_perm]
        inter = []
        for gi in range(len(permuted) // len(il)):
            inter += [permuted[gi * len(il) + il[t]] for t in range(len(il))]
        out.append(pack_sequence(inter, bits))
    return torch.tensor(out, dtype=torch.int32)


def ref_marlin_zero_points_closed_form_4bit(zp: torch.Tensor) -> torch.Tensor:
    g, n = zp.shape
    il = [0, 2, 4, 6, 1, 3, 5, 7]
    out = []
    for r in range(g):
        words = []
        for m in range(n // 8):
            word = 0
            for t in range(8):
                word |= int(zp[r, 64 * (m // 8) + (m % 8) + 8 * il[t]]) << (4 * t)
            words.append(to_int32(word))
        out.append(words)
    return torch.tensor(out, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# FP8 (docs/formats.md §5), straightforward float32 re-implementations
# ---------------------------------------------------------------------------------------------


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def ref_fp8_cast_with_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """cvt(clamp(x * fp32(1/scale))) element by element through 0-dim fp32 tensors."""
    inv = _f32(1.0) / _f32(scale) if scale != 0 else _f32(0.0)
    flat = x.float().reshape(-1)
    vals = []
    for v in flat:
        y = (v * inv).item()
        y = max(-E4M3_MAX, min(E4M3_MAX, y))
        vals.append(y)
    return torch.tensor(vals, dtype=torch.float32).to(torch.float8_e4m3fn).reshape(x.shape)


def ref_fp8_per_tensor(w: torch.Tensor, shard_sizes: list[int]) -> tuple[torch.Tensor, list[float]]:
    out, scales, start = [], [], 0
    for size in shard_sizes:
        part = w[start : start + size]
        amax = max(abs(float(v)) for v in part.float().reshape(-1))
        scale = (_f32(amax) / _f32(E4M3_MAX)).item()
        scales.append(scale)
        out.append(ref_fp8_cast_with_scale(part, scale))
        start += size
    return torch.cat(out), scales


def ref_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    rows, scales = [], []
    for r in range(w.shape[0]):
        amax = max(abs(float(v)) for v in w[r].float())
        scale = (_f32(amax) / _f32(E4M3_MAX)).item()
        scales.append(scale)
        rows.append(ref_fp8_cast_with_scale(w[r : r + 1], scale))
    return torch.cat(rows), scales


def ref_fp8_per_block(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    sf = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            block = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            amax = max(float(block.abs().max()), 1e-4)  # zero padding never raises amax
            s = _f32(amax) / _f32(E4M3_MAX)
            sf[i, j] = s
            inv = _f32(1.0) / s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (block * inv).to(torch.float8_e4m3fn)
    return q, sf


def ref_requantize(
    q: torch.Tensor, scales: list[float], shard_sizes: list[int]
) -> tuple[torch.Tensor, float]:
    """Dequantize each shard through float16 (scale rounded to fp16, product rounded to fp16),
    then requantize with the max scale via the reciprocal multiply."""
    max_s = max(scales)
    parts, start = [], 0
    for s, size in zip(scales, shard_sizes, strict=True):
        q16 = q[start : start + size].float().to(torch.float16).float()
        s16 = float(torch.tensor(s, dtype=torch.float32).to(torch.float16))
        deq = (q16 * s16).to(torch.float16).float()  # exact fp32 product of two fp16, one rounding
        parts.append(ref_fp8_cast_with_scale(deq, max_s))
        start += size
    return torch.cat(parts), max_s
