"""The cases of the kernel contract sweep (tests/kernels/test_kernel_contract.py), derived from the
registry alone: every linear kernel (`candidates(target)` for every target: third-party kernels, then
`KERNELS`) and every expert-group kernel (`MOE_KERNELS`: the fused ones and `<kernel>_experts` for each
entry of `KERNELS`), each on every target it declares, with every canonical source weight below whose
scheme it takes and whose LinearSpec its `can_implement` accepts (the first of a few shapes that fits).

Source weights are "exact" unless marked otherwise: every value they carry (integer scales, FP8 scales,
dense values, biases) is representable in bf16, fp16 and fp32, so a layout that keeps the codes and
casts scales / values to the dtype it stores must give the canonical dequantization back bit for bit.
The non-exact variants carry what real checkpoints do (fp16 GPTQ scales, fp32 FP8 scales, an fp32
dense weight, GGUF Q4_1's fp16 scales and float minimums), which a layout may round to its stored dtype.
Float-minimum weights (w = q * s + m, `float_zeros`) reach every kernel that declares
`takes_float_zeros`; the others refuse them in `can_implement`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kernels.base import (
    DenseWeight,
    Fp4Format,
    Fp4Weight,
    Fp8Strategy,
    Fp8Weight,
    LinearKernel,
    LinearSpec,
    ShardSpec,
    SourceWeight,
    WeightScheme,
)
from kernels.moe_base import MoEKernel, MoESpec
from kernels.registry import MOE_KERNELS, candidates
from kernels.targets import Target
from tests.kernels.test_cpu_kernels import fp8_weight, int_weight

ACT_DTYPES = ("bfloat16", "float16", "float32")
# (N, K) of a linear layer, tried in order until the kernel accepts the spec: small first (the GPU
# kernels run in the Triton interpreter). 128 x 256 fits every built-in kernel's shape rules.
LINEAR_SHAPES = ((128, 256), (256, 512), (192, 384), (96, 320))
# (hidden H, intermediate I) of an expert group: w13 is (2I, H), w2 (H, I). Marlin needs N % 64 == 0
# and K % 128 == 0 for both parts.
MOE_SHAPES = ((128, 128), (256, 128), (256, 256))
NUM_EXPERTS = 3
TOP_K = 2
LINEAR_NAME = "model.layers.0.self_attn.qkv_proj"
MOE_NAME = "model.layers.1.mlp.experts"


@dataclass(frozen=True)
class Variant:
    """One canonical source weight (scheme and quantization parameters) of the sweep."""

    label: str
    scheme: WeightScheme
    # Every value is representable in bf16, fp16 and fp32 (module docstring): lossless layouts must
    # dequantize it bit for bit.
    exact: bool = True
    bits: int = 16
    group_size: int = -1
    symmetric: bool = True
    act_order: bool = False
    int8_activations: bool = False
    fp8_strategy: Fp8Strategy | None = None
    block_size: tuple[int, int] | None = None
    # FP8 per-tensor: one (distinct) scale per shard of the layer's spec, as a checkpoint holding
    # q/k/v or gate/up separately has; without it one scale covers the whole layer (online FP8).
    shard_scales: bool = False
    # A float minimum per group instead of integer zero points (GGUF Q4_1 / Q4_K; symmetric=False).
    float_zeros: bool = False
    fp4_format: Fp4Format | None = None
    codebook: str = ""  # the codes index bitsandbytes' value table of this name (NF4 / FP4)

    def spec(
        self, n: int, k: int, act_dtype: str, *, name: str, shards: tuple[ShardSpec, ...], bias: bool
    ) -> LinearSpec:
        """The spec of an (N, K) layer holding this weight."""
        return LinearSpec(
            name=name,
            scheme=self.scheme,
            n=n,
            k=k,
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            act_order=self.act_order,
            fp8_strategy=self.fp8_strategy,
            block_size=self.block_size,
            has_bias=bias,
            act_dtype=act_dtype,
            int8_activations=self.int8_activations,
            shards=shards,
            float_zeros=self.float_zeros,
            fp4_format=self.fp4_format,
            codebook=self.codebook,
        )

    def weight(self, n: int, k: int, *, shards: tuple[ShardSpec, ...], bias: bool, seed: int) -> SourceWeight:
        """The canonical (N, K) weight, drawn from `seed`."""
        if self.scheme == "int":
            scale_dtype = torch.bfloat16 if self.exact else torch.float16
            w = int_weight(
                n,
                k,
                bits=self.bits,
                group_size=self.group_size,
                symmetric=self.symmetric or self.float_zeros,
                act_order=self.act_order,
                # bf16 scales in [1e-3, 0.021): fp16 normals, so exact in both
                scale_dtype=scale_dtype,
                seed=seed,
            )
            w.bias = _bias(n, seed) if bias else None
            if self.float_zeros:
                w.mins = _mins(w.scales.shape, scale_dtype, seed)
            if self.codebook:  # fp32 absmax, as bitsandbytes stores them
                w.codebook = NF4_VALUES
                w.scales = w.scales.float()
            return w
        if self.scheme == "fp8":
            fw = self._fp8_weight(n, k, shards, seed)
            fw.bias = _bias(n, seed) if bias else None
            return fw
        if self.scheme == "fp4":
            return self._fp4_weight(n, k, shards, seed, bias)
        gen = torch.Generator().manual_seed(seed)
        if self.exact:  # integers of 8 significant bits times a power of two: bf16 = fp16 = fp32
            dense = (torch.randint(-128, 128, (n, k), generator=gen) * 2.0**-10).to(torch.bfloat16)
        else:
            dense = torch.randn(n, k, generator=gen) * 0.05
        return DenseWeight(dense, _bias(n, seed) if bias else None)

    def _fp8_weight(self, n: int, k: int, shards: tuple[ShardSpec, ...], seed: int) -> Fp8Weight:
        assert self.fp8_strategy is not None
        if not self.exact:  # amax / 448 scales in fp32, as a real checkpoint has them
            w = fp8_weight(n, k, self.fp8_strategy, seed=seed)
            w.bias = None
            return w
        gen = torch.Generator().manual_seed(seed)
        codes = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)  # a few subnormals too
        sizes: tuple[int, ...] = ()
        if self.fp8_strategy == "tensor":
            sizes = tuple(s.size for s in shards) if self.shard_scales and len(shards) > 1 else ()
            shape: tuple[int, ...] = (max(len(sizes), 1),)
        elif self.fp8_strategy == "channel":
            shape = (n,)
        else:
            assert self.block_size is not None
            bn, bk = self.block_size
            shape = (-(-n // bn), -(-k // bk))
        scale = exact_scales(shape, gen)
        if len(sizes) > 1:  # shards scaled by different powers of two: their scales surely differ
            scale = scale * 2.0 ** torch.arange(len(sizes), dtype=torch.float32)
        return Fp8Weight(codes, scale, self.fp8_strategy, block_size=self.block_size, shard_sizes=sizes)

    def _fp4_weight(self, n: int, k: int, shards: tuple[ShardSpec, ...], seed: int, bias: bool) -> Fp4Weight:
        """Random E2M1 codes (every code, -0 included); NVFP4: positive E4M3 block scales over the
        whole range a quantizer writes (448 * amax_block / amax_tensor, subnormals included) and one
        fp32 global multiplier per shard (shards of one fused layer share it, as llm-compressor and
        ModelOpt write them); MXFP4: E8M0 exponents around 2^-7."""
        assert self.fp4_format is not None
        gen = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        groups = k // (16 if self.fp4_format == "nvfp4" else 32)
        b = _bias(n, seed) if bias else None
        if self.fp4_format == "mxfp4":
            scales = torch.randint(120, 124, (n, groups), generator=gen, dtype=torch.uint8)
            return Fp4Weight(codes, scales, "mxfp4", bias=b)
        scales = (torch.rand(n, groups, generator=gen) * 448).clamp_min(2.0**-9).to(torch.float8_e4m3fn)
        sizes = tuple(s.size for s in shards) if len(shards) > 1 else ()
        g = torch.full((max(len(sizes), 1),), 1.0 / 3 * 2.0**-8)  # amax / (6 * 448)-like, not a power of 2
        return Fp4Weight(codes, scales, "nvfp4", g, sizes, b)


def exact_scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """float32 scales of 6 significant bits in [2^-7, 2^-6): exact in bf16, fp16 and fp32."""
    return torch.randint(32, 64, shape, generator=gen).float() * 2.0**-12


def _mins(shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(G, N) float minimums of a group's range (about -8 steps, as Q4_1 puts them): in bf16 integers of
    8 significant bits times 2^-10, exact in bf16, fp16 and fp32; in fp16 of 11 (bf16 rounds them)."""
    gen = torch.Generator().manual_seed(seed + 2)
    if dtype == torch.bfloat16:
        return (torch.randint(-160, 32, shape, generator=gen) * 2.0**-10).to(dtype)
    return (torch.rand(shape, generator=gen) * -0.19 + 0.03).to(dtype)


def _bias(n: int, seed: int) -> torch.Tensor:
    """(N,) bf16 bias of 8 significant bits in [-2, 2): exact in bf16, fp16 and fp32."""
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randint(-128, 128, (n,), generator=gen) * 2.0**-6).to(torch.bfloat16)


# bitsandbytes' NF4 table (its quant_map), as fp32
NF4_VALUES = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=torch.float32,
)  # fmt: skip

VARIANTS: tuple[Variant, ...] = (
    Variant("int4-g64-sym", "int", bits=4, group_size=64),
    Variant("int4-g128-asym", "int", bits=4, group_size=128, symmetric=False),
    Variant("int4-channel-sym", "int", bits=4, group_size=-1),
    Variant("int4-channel-asym", "int", bits=4, group_size=-1, symmetric=False),
    Variant("int4-g32-sym", "int", bits=4, group_size=32),
    Variant("int4-g64-asym-actorder", "int", bits=4, group_size=64, symmetric=False, act_order=True),
    Variant("int8-channel-sym-a8", "int", bits=8, group_size=-1, int8_activations=True),
    Variant(  # --int8-activations on GGUF Q4_1 / Q4_K
        "int4-g32-floatmin-a8",
        "int",
        bits=4,
        group_size=32,
        symmetric=False,
        float_zeros=True,
        int8_activations=True,
    ),
    Variant("int8-g64-sym-actorder", "int", bits=8, group_size=64, act_order=True),
    Variant("int8-g128-asym", "int", bits=8, group_size=128, symmetric=False),
    Variant("int2-g128-asym-actorder", "int", bits=2, group_size=128, symmetric=False, act_order=True),
    Variant("int4-g64-asym-fp16scales", "int", exact=False, bits=4, group_size=64, symmetric=False),
    Variant("fp8-tensor", "fp8", bits=8, fp8_strategy="tensor"),
    Variant("fp8-tensor-shards", "fp8", bits=8, fp8_strategy="tensor", shard_scales=True),
    Variant("fp8-channel", "fp8", bits=8, fp8_strategy="channel"),
    Variant("fp8-block128", "fp8", bits=8, fp8_strategy="block", block_size=(128, 128)),
    Variant("fp8-block48x64", "fp8", bits=8, fp8_strategy="block", block_size=(48, 64)),
    Variant("fp8-channel-fp32scales", "fp8", exact=False, bits=8, fp8_strategy="channel"),
    Variant("nvfp4", "fp4", bits=4, group_size=16, fp4_format="nvfp4"),
    Variant("mxfp4", "fp4", bits=4, group_size=32, fp4_format="mxfp4"),
    Variant("dense", "dense"),
    Variant("dense-fp32", "dense", exact=False),
    Variant("int4-g32-floatmin", "int", bits=4, group_size=32, symmetric=False, float_zeros=True),
    Variant("int6-g16-sym", "int", bits=6, group_size=16),  # GGUF Q6_K
    Variant("int5-g32-sym", "int", bits=5, group_size=32),  # GGUF Q5_0
    Variant("int5-g32-floatmin", "int", bits=5, group_size=32, symmetric=False, float_zeros=True),  # Q5_K
    Variant("nf4-g64", "int", exact=False, bits=4, group_size=64, codebook="nf4"),  # bitsandbytes
    Variant(  # GGUF Q4_1: fp16 scales and minimums
        "int4-g32-floatmin-fp16", "int", exact=False, bits=4, group_size=32, symmetric=False, float_zeros=True
    ),
)


def seed_of(label: str) -> int:
    """A stable seed per case, so that cases draw different weights and reruns the same."""
    return zlib.crc32(label.encode()) % (1 << 31)


def gate_up_shards(i: int) -> tuple[ShardSpec, ...]:
    return (ShardSpec("gate_proj", i), ShardSpec("up_proj", i))


def linear_shards(n: int) -> tuple[ShardSpec, ...]:
    """A fused q/k/v-like layer of unequal shards (only FP8 per-shard scales look at them)."""
    return (ShardSpec("q_proj", n // 2), ShardSpec("k_proj", n // 4), ShardSpec("v_proj", n - 3 * (n // 4)))


# --------------------------------------------------------------------------------------------
# Linear kernels
# --------------------------------------------------------------------------------------------


def linear_kernels() -> dict[str, LinearKernel]:
    """Every linear kernel the registry offers on any target, by name."""
    return {kernel.name: kernel for target in Target for kernel in candidates(target)}


@dataclass(frozen=True)
class LinearCase:
    kernel: str
    target: Target
    variant: Variant
    act_dtype: str
    n: int
    k: int

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.target.value}-{self.variant.label}-{self.act_dtype}"

    def spec(self) -> LinearSpec:
        return self.variant.spec(
            self.n, self.k, self.act_dtype, name=LINEAR_NAME, shards=linear_shards(self.n), bias=True
        )

    def weight(self) -> SourceWeight:
        """The canonical weight: the same for every kernel, target and act dtype of the variant."""
        seed = seed_of(f"{self.variant.label}-{self.n}x{self.k}")
        return self.variant.weight(self.n, self.k, shards=linear_shards(self.n), bias=True, seed=seed)


def linear_cases() -> list[LinearCase]:
    """Every (kernel, target, variant, act dtype) the kernel accepts, at the first shape it takes."""
    cases = []
    for name, kernel in linear_kernels().items():
        for target in sorted(kernel.targets, key=lambda t: t.value):
            for variant in VARIANTS:
                if variant.scheme not in kernel.schemes:
                    continue
                for act in ACT_DTYPES:
                    for n, k in LINEAR_SHAPES:
                        case = LinearCase(name, target, variant, act, n, k)
                        if kernel.can_implement(case.spec(), target) == (True, ""):
                            cases.append(case)
                            break
    return cases


# --------------------------------------------------------------------------------------------
# Expert-group kernels
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoECase:
    kernel: str
    target: Target
    variant: Variant
    act_dtype: str
    hidden: int
    inter: int

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.target.value}-{self.variant.label}-{self.act_dtype}"

    def spec(self) -> MoESpec:
        h, i, act = self.hidden, self.inter, self.act_dtype
        w13 = self.variant.spec(2 * i, h, act, name=f"{MOE_NAME}.w13", shards=gate_up_shards(i), bias=False)
        w2 = self.variant.spec(h, i, act, name=f"{MOE_NAME}.w2", shards=(), bias=False)
        return MoESpec(name=MOE_NAME, num_experts=NUM_EXPERTS, top_k=TOP_K, w13=w13, w2=w2)

    def experts(self) -> list[tuple[SourceWeight, SourceWeight]]:
        """Each local expert's canonical (w13 (2I, H): gate rows then up rows, w2 (H, I)); no biases
        (the fused expert kernels have none)."""
        h, i = self.hidden, self.inter
        out = []
        for e in range(NUM_EXPERTS):
            seed = seed_of(f"{self.variant.label}-{h}x{i}-expert{e}")
            w13 = self.variant.weight(2 * i, h, shards=gate_up_shards(i), bias=False, seed=seed)
            w2 = self.variant.weight(h, i, shards=(), bias=False, seed=seed + 1)
            out.append((w13, w2))
        return out


def moe_kernels() -> dict[str, MoEKernel]:
    return dict(MOE_KERNELS)


def moe_cases() -> list[MoECase]:
    cases = []
    for name, kernel in moe_kernels().items():
        for target in sorted(kernel.targets, key=lambda t: t.value):
            for variant in VARIANTS:
                if variant.scheme not in kernel.schemes:
                    continue
                for act in ACT_DTYPES:
                    for h, i in MOE_SHAPES:
                        case = MoECase(name, target, variant, act, h, i)
                        if kernel.can_implement(case.spec(), target) == (True, ""):
                            cases.append(case)
                            break
    return cases
