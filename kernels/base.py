"""The contract every kernel file implements, and the canonical weights the converter hands to it.

Flow: a checkpoint reader (services/convert) unpacks any source format into one of the canonical
weight classes below (`IntWeight`, `Fp8Weight`, `Fp4Weight`, `DenseWeight`); the registry picks a
kernel for the layer's `LinearSpec` and target; `kernel.prepare(weight, spec)` (offline, CPU, pure
torch) returns the tensors the artifact stores; at runtime `kernel.apply(x, tensors, spec)` runs the layer.
`kernel.dequantize(tensors, spec)` inverts the layout (fp32 `[N, K]`), used by the converter's
verification and by `reference`, the pure-torch twin of `apply`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch

from kernels.errors import LayoutError
from kernels.targets import Target

WeightScheme = Literal["int", "fp8", "fp4", "dense"]
Fp8Strategy = Literal["tensor", "channel", "block"]
# NVFP4: E2M1 codes, an FP8 E4M3 scale per 16, an fp32 global multiplier per shard.
# MXFP4: E2M1 codes, a power-of-two E8M0 scale (a biased exponent byte) per 32.
Fp4Format = Literal["nvfp4", "mxfp4"]
FP4_GROUP_SIZE: dict[str, int] = {"nvfp4": 16, "mxfp4": 32}
# Value of each E2M1 code (bit 3 is the sign; code 8 is -0.0), the same in every FP4 format.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 255  # the one E8M0 byte that is not a power of two

# Whole-layer work (layout prep, verification) runs in blocks of output rows, so its temporaries stay
# bounded whatever the layer's size: about ROW_BLOCK_ELEMENTS elements per block, a multiple of
# ROW_BLOCK_MULTIPLE rows (row-blocked packs such as cpu_int4's 64/32/16-row blocks slice there).
# 1 MB of fp32 per temporary: glibc reuses such blocks one after the other, where 4-16 MB ones made a
# conversion's RSS grow by hundreds of MB (bench/convert.py --gguf-only)
ROW_BLOCK_ELEMENTS = 1 << 18
ROW_BLOCK_MULTIPLE = 64
ALL_ROWS = 1 << 30  # `bf16_op_rows` of an op that is bf16 at every batch size
RowBlocks = Iterator[tuple[slice, torch.Tensor]]  # (output rows, that block of an (N, K) weight)


def row_block_slices(n: int, k: int) -> list[slice]:
    """Consecutive slices of N output rows, each ≈ ROW_BLOCK_ELEMENTS / K rows (a multiple of
    ROW_BLOCK_MULTIPLE, the last shorter)."""
    per_block = ROW_BLOCK_ELEMENTS // max(k, 1)
    rows = max(ROW_BLOCK_MULTIPLE, per_block // ROW_BLOCK_MULTIPLE * ROW_BLOCK_MULTIPLE)
    return [slice(start, min(n, start + rows)) for start in range(0, n, rows)]


@dataclass(frozen=True)
class ShardSpec:
    """One logical shard of a fused layer (q/k/v of qkv_proj, gate/up of gate_up_proj), per rank."""

    name: str  # checkpoint module name, e.g. "model.layers.0.self_attn.q_proj"
    size: int  # output features of this shard on one rank


@dataclass(frozen=True)
class LinearSpec:
    """Everything a kernel needs to know about one (possibly fused) linear layer on one TP rank.

    Serialized into the manifest per layer; `n`/`k` are per rank, `k_full` is the whole layer's K.
    """

    name: str  # runtime module name, e.g. "model.layers.0.self_attn.qkv_proj"
    scheme: WeightScheme
    n: int  # output features on this rank
    k: int  # input features on this rank
    k_full: int = 0  # input features of the unsharded layer (0: same as k)
    bits: int = 16  # 2/3/4/8 for int, 8 for fp8, 16/32 for dense
    group_size: int = -1  # -1: one group spans all of K (channelwise)
    symmetric: bool = True
    act_order: bool = False
    fp8_strategy: Fp8Strategy | None = None
    block_size: tuple[int, int] | None = None  # FP8 block (rows of N, cols of K)
    row_parallel: bool = False
    has_bias: bool = False
    act_dtype: str = "bfloat16"  # activation dtype at runtime ("bfloat16" | "float16" | "float32")
    # The checkpoint was calibrated for dynamic per-token symmetric int8 activations (W8A8 int8);
    # W8A8 kernels take such layers, weight-only kernels run them as W8A16.
    int8_activations: bool = False
    shards: tuple[ShardSpec, ...] = ()
    # The zero is a float minimum per group, w = q * s + m (GGUF Q4_1 / Q4_K), not an integer code.
    float_zeros: bool = False
    fp4_format: Fp4Format | None = None  # scheme "fp4": which FP4 encoding (group_size is 16 / 32)
    # An FP4 checkpoint calibrated for FP4 activations (W4A4); kernels without FP4 math run it W4A16.
    fp4_activations: bool = False
    # A layout value shared by every expert of a group, set by the converter from all of them before
    # any is prepared (`LinearKernel.group_statistic`): marlin_fp4's NVFP4 scale factor. 0: none.
    group_scale_factor: float = 0.0
    # The codes index a 16-entry value table stored with the layer (bitsandbytes NF4 / FP4): names it
    # ("nf4", "fp4"); w = table[q] * scale. "": uniform integer codes.
    codebook: str = ""

    def __post_init__(self) -> None:
        if self.k_full == 0:
            object.__setattr__(self, "k_full", self.k)

    @property
    def midpoint_zero(self) -> bool:
        """An integer layer whose zero is the implicit 2**(bits-1) (no zero points, no minimums)."""
        return self.symmetric and not self.float_zeros

    @property
    def num_groups(self) -> int:
        """Groups along this rank's K (replicated-scale cases are the kernel's business)."""
        return 1 if self.group_size in (-1, 0) else self.k // self.group_size

    @property
    def scale_groups(self) -> int:
        """Rows of group scales a rank stores: 1 channelwise; with act-order every group of the full
        K (g_idx may name any of them); else this rank's groups."""
        if self.group_size in (-1, 0):
            return 1
        return (self.k_full if self.act_order else self.k) // self.group_size

    @property
    def torch_act_dtype(self) -> torch.dtype:
        return getattr(torch, self.act_dtype)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["block_size"] = list(self.block_size) if self.block_size else None
        d["shards"] = [dataclasses.asdict(s) for s in self.shards]
        optional = (
            "int8_activations", "float_zeros", "fp4_format", "fp4_activations", "group_scale_factor",
            "codebook",
        )  # fmt: skip
        for flag in optional:
            if not d[flag]:
                del d[flag]  # absent = False / None: manifests written before the field stay valid
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LinearSpec:
        d = dict(d)
        d["block_size"] = tuple(d["block_size"]) if d.get("block_size") else None
        d["shards"] = tuple(ShardSpec(**s) for s in d.get("shards", ()))
        return cls(**d)


# --------------------------------------------------------------------------------------------
# Canonical (unpacked) weights: what every source format is decoded into before layout prep.
# --------------------------------------------------------------------------------------------


@dataclass
class IntWeight:
    """Integer weight-only quantization, unpacked. w = (codes - zeros[g]) * scales[g], or with a
    float minimum per group w = codes * scales[g] + mins[g], or with a value table (bitsandbytes
    NF4 / FP4) w = codebook[codes] * scales[g].

    codes  (N, K) uint8, unsigned codes in [0, 2**bits)
    scales (G, N) float (checkpoint dtype), G = K // group_size (1 for channelwise)
    zeros  (G, N) uint8 unsigned zero points, or None when symmetric (zero = 2**(bits-1))
    g_idx  (K,) int32 group of each input channel, or None when g_idx[k] == k // group_size
    mins   (G, N) float minimums (GGUF Q4_1 `m`, Q4_K `-dmin * m`), or None; never with zeros
    codebook (2**bits,) float32 value of every code, or None; never with zeros or mins
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    codebook: torch.Tensor | None = None

    @property
    def symmetric(self) -> bool:
        return self.zeros is None and self.mins is None

    def group_index(self) -> torch.Tensor:
        """(K,) int64 group id of every input channel."""
        k = self.codes.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        if self.group_size in (-1, 0):
            return torch.zeros(k, dtype=torch.long)
        return torch.arange(k) // self.group_size

    def rows(self, rows: slice | torch.Tensor) -> IntWeight:
        """Output channels `rows` (a slice: views of their codes, scales, zero points and minimums; an
        index tensor: copies in its order); no bias."""

        def cols(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, rows]

        return IntWeight(
            self.codes[rows], self.scales[:, rows], self.bits, self.group_size,
            cols(self.zeros), self.g_idx, None, cols(self.mins), self.codebook,
        )  # fmt: skip

    def dequantize_to(self, dtype: torch.dtype) -> torch.Tensor:
        """(N, K) in `dtype`: `dequantize()` rounded once to `dtype`, computed in row blocks (no
        full-size float32 temporary)."""
        out = torch.empty(self.codes.shape, dtype=dtype)
        for rows, block in self.dequantized_rows():
            out[rows] = block
        return out

    def dequantized_rows(self) -> RowBlocks:
        """`dequantize()` in the row blocks of `row_block_slices(N, K)`."""
        n, k = self.codes.shape
        for rows in row_block_slices(n, k):
            yield rows, self.rows(rows).dequantize()

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        gi = self.group_index()
        s = self.scales.float()[gi].T  # (N, K)
        if self.codebook is not None:
            return self.codebook.float()[self.codes.long()] * s
        if self.mins is not None:
            return self.codes.float() * s + self.mins.float()[gi].T
        z = (
            torch.full_like(s, float(1 << (self.bits - 1)))
            if self.zeros is None
            else self.zeros.float()[gi].T
        )
        return (self.codes.float() - z) * s


@dataclass
class Fp8Weight:
    """FP8 e4m3fn weight with multiplier scales: w = weight.float() * scale.

    weight (N, K) float8_e4m3fn
    scale  tensor:  (S,) float32, one per shard (shard_sizes give each shard's rows; S == 1 unfused)
           channel: (N,) float32
           block:   (ceil(N/bn), ceil(K/bk)) float32
    """

    weight: torch.Tensor
    scale: torch.Tensor
    strategy: Fp8Strategy
    block_size: tuple[int, int] | None = None
    shard_sizes: tuple[int, ...] = ()
    bias: torch.Tensor | None = None

    def expanded_scale(self) -> torch.Tensor:
        """(N, K) float32 scale of every element."""
        n, k = self.weight.shape
        s = self.scale.float()
        if self.strategy == "tensor":
            sizes = self.shard_sizes or (n,)
            if len(sizes) != s.numel():
                raise LayoutError(f"{s.numel()} per-tensor scales for {len(sizes)} shards")
            return torch.repeat_interleave(s.reshape(-1), torch.tensor(sizes))[:, None].expand(n, k)
        if self.strategy == "channel":
            return s.reshape(n, 1).expand(n, k)
        assert self.block_size is not None
        bn, bk = self.block_size
        return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        return self.weight.float() * self.expanded_scale()


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of every E2M1 code (uint8 0..15), same shape."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()]


def e8m0_values(exponents: torch.Tensor) -> torch.Tensor:
    """float32 2 ** (byte - 127) of every E8M0 byte, built bit for bit (2^-127 is an fp32 subnormal);
    byte 255 is NaN."""
    e = exponents.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return torch.where(e == E8M0_NAN, torch.full_like(e, 0x7FC00000), bits).view(torch.float32)


@dataclass
class Fp4Weight:
    """FP4 (E2M1) weight with block scales: w = E2M1(code) * scale[n, k // group] * global[shard of n].

    codes        (N, K) uint8 E2M1 codes 0..15 (unpacked)
    scales       (N, K // group) float8_e4m3fn (nvfp4, group 16) | uint8 E8M0 exponent bytes (mxfp4, 32)
    global_scale (S,) float32 multipliers, one per shard (`shard_sizes` give their rows; S == 1
                 unfused); nvfp4 only, None for mxfp4
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: Fp4Format
    global_scale: torch.Tensor | None = None
    shard_sizes: tuple[int, ...] = ()
    bias: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        return FP4_GROUP_SIZE[self.fmt]

    def scale_values(self) -> torch.Tensor:
        """(N, K // group) float32 block scales (without the global one)."""
        return self.scales.float() if self.fmt == "nvfp4" else e8m0_values(self.scales)

    def row_global(self) -> torch.Tensor | None:
        """(N,) float32 global multiplier of every output row, or None (mxfp4)."""
        if self.global_scale is None:
            return None
        g = self.global_scale.float().reshape(-1)
        sizes = self.shard_sizes or (self.codes.shape[0],)
        if len(sizes) != g.numel():
            raise LayoutError(f"{g.numel()} FP4 global scales for {len(sizes)} shards")
        return torch.repeat_interleave(g, torch.tensor(sizes))

    def dequantized_rows(self) -> RowBlocks:
        """`dequantize()` in the row blocks of `row_block_slices(N, K)`."""
        n, k = self.codes.shape
        g = self.row_global()
        for rows in row_block_slices(n, k):
            scale = self.scale_values()[rows].repeat_interleave(self.group_size, 1)
            w = e2m1_values(self.codes[rows]) * scale
            yield rows, w if g is None else w * g[rows, None]

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        out = torch.empty(self.codes.shape, dtype=torch.float32)
        for rows, block in self.dequantized_rows():
            out[rows] = block
        return out


@dataclass
class DenseWeight:
    """Unquantized weight (N, K) in its checkpoint dtype."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


SourceWeight = IntWeight | Fp8Weight | Fp4Weight | DenseWeight


def weight_shape(w: SourceWeight) -> tuple[int, int]:
    """(N, K) of a canonical weight."""
    t = w.codes if isinstance(w, IntWeight | Fp4Weight) else w.weight
    return int(t.shape[0]), int(t.shape[1])


@dataclass(frozen=True)
class StoredTensor:
    """Shape and dtype of one tensor a kernel stores for a layer on one rank. `optional` tensors
    are present or not depending on the weights (e.g. an act-order perm that turned out trivial)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    optional: bool = False


def with_bias(
    tensors: dict[str, StoredTensor], spec: LinearSpec, dtype: torch.dtype
) -> dict[str, StoredTensor]:
    """`tensors` plus the (N,) bias when the layer has one."""
    if spec.has_bias:
        tensors["bias"] = StoredTensor((spec.n,), dtype)
    return tensors


def check_stored(
    kernel_name: str, spec: LinearSpec, declared: dict[str, StoredTensor], tensors: dict[str, torch.Tensor]
) -> None:
    """Raise LayoutError unless `tensors` are exactly what the kernel declares for `spec`."""
    problems = [f"unexpected tensor {name!r}" for name in tensors if name not in declared]
    for name, want in declared.items():
        t = tensors.get(name)
        if t is None:
            if not want.optional:
                problems.append(f"tensor {name!r} is missing")
        elif tuple(t.shape) != want.shape or t.dtype != want.dtype:
            problems.append(
                f"{name} is {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}, expected "
                f"{want.shape} {str(want.dtype).removeprefix('torch.')}"
            )
    if problems:
        raise LayoutError(
            f"layer {spec.name} ({kernel_name}, N={spec.n}, K={spec.k}): " + "; ".join(problems)
        )


QuantizedWeight = TypeVar("QuantizedWeight", IntWeight, Fp8Weight, Fp4Weight)
SCHEME_WORDS = {"int": "integer", "fp8": "fp8", "fp4": "fp4", "dense": "unquantized"}

# Every float activation dtype a host may run: the CPU paths cast to what their ops take and return
# the input's dtype, so a CPU layer serves any of them.
CPU_ACT_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})


def stored_act_dtypes(act_dtype: torch.dtype, target: Target) -> frozenset[torch.dtype]:
    """Activation dtypes a layer stored for `target` runs: any on the CPU; on a GPU the artifact's
    act dtype only (scales and bias are stored in it, and the GEMMs take activations of that dtype)."""
    return CPU_ACT_DTYPES if target is Target.CPU else frozenset({act_dtype})


class LinearKernel(ABC):
    """One kernel family: it owns a weight layout (prepare / dequantize) and runs it (apply).

    A subclass declares what it is (`name`, `layout_version`, the `schemes` it takes, the `targets` it
    runs on, the activation dtype it prefers on CPU) and implements the layout and the GEMM. Where a
    kernel may run is stated once, in `targets`: the registry derives every target's priority list
    from it, and `can_implement` refuses other targets with `elsewhere` as a hint. Shape and dtype
    limits go in `supports`. Nothing here may touch a GPU at import; Triton is imported inside `apply`.
    """

    name: ClassVar[str]
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]]
    targets: ClassVar[frozenset[Target]]
    elsewhere: ClassVar[str] = ""  # where the layers it refuses run instead, for refusal messages
    takes_float_zeros: ClassVar[bool] = False  # integer layers with a float minimum (IntWeight.mins)
    takes_codebook: ClassVar[bool] = False  # integer layers whose codes index a value table (NF4 / FP4)
    # Activation dtype its fast CPU path takes (torch's int4 / int8 ops are vectorized for bf16 only);
    # the loader runs a CPU model in bf16 when every layer's kernel prefers it.
    cpu_act_dtype: ClassVar[torch.dtype] = torch.float32
    # (H, I) multiples vLLM pads gpt-oss's experts to for this layout (its
    # mxfp4_round_up_hidden_size_and_intermediate_size); None: not padded
    gpt_oss_expert_padding: ClassVar[tuple[int, int] | None] = None
    # The vLLM kernel that runs this layout's stored bytes as they are (vLLM's plugin calls it on a
    # GPU instead of Kiln's); "" when vLLM has none.
    vllm_kernel: ClassVar[str] = ""
    # True when the stored "weight" is the weight itself (dequantize is `tensors["weight"].float()`):
    # the converter then verifies the stored tensor directly.
    stores_plain_weight: ClassVar[bool] = False
    # A layout only Kiln's kernels read (vLLM has no kernel for its bytes): chosen only for a conversion
    # that asks for Kiln's GPU layouts (`kiln convert --gpu-layout kiln`), ahead of the vLLM-identical ones.
    kiln_layout: ClassVar[bool] = False
    description: ClassVar[str] = ""

    def bf16_op_rows(self) -> int:
        """On CPU, a call with fewer rows than this runs a torch op that takes and returns bf16: the
        activations it multiplies and the product it hands back (before the bias) are rounded to
        bf16 whatever the model's activation dtype. 0: none (the native decode step rounds at the
        same points, runtime/native_decode.py)."""
        return 0

    def act_dtypes(self, spec: LinearSpec, target: Target) -> frozenset[torch.dtype]:
        """Activation dtypes a layer of `spec` stored for `target` takes (its output is in the
        input's dtype); a host running another dtype must refuse the layer at load."""
        return stored_act_dtypes(spec.torch_act_dtype, target)

    def can_implement(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        """(True, "") or (False, a reason the user can act on)."""
        if target not in self.targets:
            names = "/".join(sorted(t.value for t in self.targets))
            plural = "s" if len(self.targets) > 1 else ""
            hint = f"; {self.elsewhere}" if self.elsewhere else ""
            return False, f"{self.name} runs on the {names} target{plural} only (got {target.value}){hint}"
        if spec.scheme not in self.schemes:
            kinds = " / ".join(SCHEME_WORDS.get(s, s) for s in sorted(self.schemes))
            return False, f"{self.name} takes {kinds} weights only, not scheme {spec.scheme!r}"
        if spec.codebook and not self.takes_codebook:
            return False, (
                f"{self.name} takes uniform integer codes only; this layer's codes index a "
                f"{spec.codebook} value table (bitsandbytes 4-bit)"
            )
        if spec.float_zeros and not self.takes_float_zeros:
            return False, (
                f"{self.name} takes integer zero points only; this layer's zero is a float minimum per "
                "group (w = q·s + m, GGUF Q4_1 / Q4_K)"
            )
        return self.supports(spec, target)

    def prepare_input(
        self, weight: SourceWeight, kind: type[QuantizedWeight], spec: LinearSpec, *, group_map: bool = False
    ) -> QuantizedWeight:
        """The input checks of `prepare`: `weight` is the `kind` this kernel prepares, of the (N, K)
        and bits the spec says, FP8 in e4m3fn; with `group_map` (the GPU int layouts) also as symmetric
        as the spec and without a g_idx unless act-order (or the trivial map); else a LayoutError."""
        if not isinstance(weight, kind):
            raise LayoutError(
                f"{spec.name}: {self.name} prepares {kind.__name__}, got {type(weight).__name__}"
            )
        shape = weight_shape(weight)
        if shape != (spec.n, spec.k):
            raise LayoutError(f"{spec.name}: weight is {shape}, spec says (N, K) = {(spec.n, spec.k)}")
        if isinstance(weight, Fp4Weight):
            if weight.fmt != spec.fp4_format:
                raise LayoutError(f"{spec.name}: weight is {weight.fmt}, spec says {spec.fp4_format}")
            return weight
        if isinstance(weight, Fp8Weight):
            if weight.weight.dtype != torch.float8_e4m3fn:
                raise LayoutError(
                    f"{spec.name}: {self.name} takes float8_e4m3fn weights, got {weight.weight.dtype}"
                )
            return weight
        if weight.bits != spec.bits:
            raise LayoutError(f"{spec.name}: weight has {weight.bits} bits, spec says {spec.bits}")
        if group_map and weight.symmetric != spec.symmetric:
            raise LayoutError(f"{spec.name}: weight symmetric={weight.symmetric}, spec says {spec.symmetric}")
        if group_map and weight.g_idx is not None and not spec.act_order:
            groups = torch.arange(spec.k) // (spec.k if spec.group_size in (-1, 0) else spec.group_size)
            if not torch.equal(weight.group_index(), groups):
                raise LayoutError(f"{spec.name}: weight has an act-order g_idx but spec.act_order is False")
        return weight

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        """Shape / dtype limits of a layer of one of `schemes` on one of `targets`."""
        return True, ""

    @abstractmethod
    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        """Offline layout prep on CPU: canonical weight -> the tensors the artifact stores for `target`.

        Keys are tensor suffixes ("qweight", "scales", ...); the converter prefixes the layer name.
        A bias, when present, is stored under "bias".
        """

    @abstractmethod
    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        """The tensors `prepare` writes for `spec` on `target`: suffix -> shape and dtype (per rank).

        The loader checks an artifact against this before serving; the converter checks `prepare`'s
        output against it, so the declaration and the layout cannot drift apart."""

    @abstractmethod
    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Invert the layout: (N, K) float32 weight (for verification and the reference twin)."""

    def dequantized_rows(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> RowBlocks:
        """`dequantize` in the row blocks of `row_block_slices(N, K)`: verification's input, its
        temporaries bounded by a block. This default dequantizes the whole weight once and slices
        it; a layout that can be cut by rows overrides it."""
        w = self.dequantize(tensors, spec)
        for rows in row_block_slices(spec.n, spec.k):
            yield rows, w[rows]

    def needs_group_statistic(self, spec: LinearSpec) -> bool:
        """Whether, as one expert of a group, the layout needs a value reduced over every expert of
        the group before any is prepared (`group_statistic`, `with_group_statistic`)."""
        return False

    def group_statistic(self, weight: SourceWeight, spec: LinearSpec) -> float:
        """One expert's share of the group value (the converter takes the max over the group)."""
        raise NotImplementedError(f"{self.name} needs no group statistic")

    def with_group_statistic(self, spec: LinearSpec, value: float) -> LinearSpec:
        """`spec` for every expert of a group whose statistic (the max over its experts) is `value`."""
        return spec

    def stored_int_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight | None:
        """The integer weight the stored tensors hold — codes, zero points and group map as stored,
        in the source's row order, scales in their stored dtype — for layouts that keep them
        losslessly. Verification then compares it with the source value for value instead of
        dequantizing both. None: this layout is verified through `dequantize` only."""
        return None

    def stored_fp8_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Fp8Weight | None:
        """The FP8 codes and scales as stored, for layouts that keep an FP8 weight's bytes unchanged:
        verification of an online-FP8 layer then compares them with the quantizer's output and
        takes the quantizer's measured error. None: verified through `dequantize`."""
        return None

    @abstractmethod
    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Runtime: y = x @ W.T (+ bias), x of shape (..., K), y of shape (..., N) in x's dtype."""

    def neutral_tensor(self, suffix: str, spec: LinearSpec) -> torch.Tensor:
        """The value of an `optional` stored tensor that leaves the layer unchanged (stacked expert
        layouts store it for the experts that did not need it)."""
        raise LayoutError(f"{self.name}: tensor {suffix!r} of layer {spec.name} has no neutral value")

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """`apply` for one bound layer, as the runtime's hot path calls it. Kernels override it to
        resolve tensors, shapes and options once instead of on every call."""
        apply = self.apply
        return lambda x: apply(x, tensors, spec)

    def reference(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Pure-torch twin of `apply`: dequantize, fp32 matmul."""
        w = self.dequantize(tensors, spec)
        y = x.float() @ w.T
        if "bias" in tensors:
            y = y + tensors["bias"].float()
        return y.to(x.dtype)


class DecodedLayoutKernel(LinearKernel):
    """A kernel whose stored tensors decode losslessly back into a canonical weight (`stored_weight`:
    the Marlin and GPTQ-standard integer layouts, Marlin FP4): it dequantizes through that weight."""

    def stored_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight | Fp4Weight:
        """The canonical weight the stored tensors hold (this default: `stored_int_weight`)."""
        stored = self.stored_int_weight(tensors, spec)
        if stored is None:
            raise LayoutError(f"{self.name} decodes no stored weight for {spec.name}")
        return stored

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.stored_weight(tensors, spec).dequantize().to(tensors["qweight"].device)  # (N, K)

    def dequantized_rows(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> RowBlocks:
        return self.stored_weight(tensors, spec).dequantized_rows()


class CpuKernel(LinearKernel):
    """A kernel of the cpu target alone (cpu_int4, cpu_int8, cpu_w8a8, cpu_fp8): torch's CPU ops,
    whose fast paths take bf16 activations."""

    targets: ClassVar[frozenset[Target]] = frozenset({Target.CPU})
    cpu_act_dtype: ClassVar[torch.dtype] = torch.bfloat16


TokenQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def token_quantized_reference(
    kernel: LinearKernel,
    quantize: TokenQuantizer,
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    spec: LinearSpec,
) -> torch.Tensor:
    """The twin of a kernel that quantizes activations per token (W8A8): `quantize` (M, K) ->
    (q, scale (M,)) exactly as the kernel does, then the dequantized weight in an fp32 matmul."""
    q, s = quantize(x.reshape(-1, spec.k))
    y = (q.float() * s[:, None]) @ kernel.dequantize(tensors, spec).to(x.device).T
    if "bias" in tensors:
        y = y + tensors["bias"].float()
    return y.to(x.dtype).reshape(*x.shape[:-1], spec.n)


ChosenKernel = TypeVar("ChosenKernel")  # a LinearKernel or an MoEKernel


@dataclass(frozen=True)
class KernelChoice(Generic[ChosenKernel]):
    """The registry's answer for one layer or expert group: the kernel, why each kernel ahead of it
    was skipped, and whether one of those would have taken the scheme at a kernel-friendly shape
    (the unit fell back because of its shape, not its scheme)."""

    kernel: ChosenKernel
    rejected: list[tuple[str, str]]
    shape_fallback: bool
