"""Kernel registry: priority per target, first fit with recorded rejections, disabling, plugins."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import registry
from kernels.base import IntWeight, LinearSpec, Target
from kernels.dense import GPU_QUANTIZED_REASON
from kernels.errors import KilnError, NoKernelError
from services.settings import ServiceSettings as Settings

PLUGIN_SRC = Path(__file__).resolve().parent / "plugin_pkg"
PLUGIN_KERNEL = "demo_fp32_int"
# The plugin stores the dequantized weight and runs an fp32 GEMM: fp32 rounding only.
PLUGIN_GEMM_REL_ERR = 1e-5


def spec(
    scheme: str = "int", *, n: int = 576, k: int = 1536, bits: int = 4, group_size: int = 64, **kw: object
) -> LinearSpec:
    return LinearSpec(
        name="model.layers.0.mlp.down_proj", scheme=scheme, n=n, k=k, bits=bits, group_size=group_size, **kw
    )  # type: ignore[arg-type]


INT4 = spec()
INT8_GROUPED = spec(bits=8)
INT8_CHANNEL = spec(bits=8, group_size=-1)
INT8_W8A8 = spec(bits=8, group_size=-1, int8_activations=True)  # int8 activations declared
FP8 = spec("fp8", bits=8, group_size=-1, fp8_strategy="channel")
DENSE = spec("dense", bits=16, group_size=-1)
FP4 = spec("fp4", group_size=16, fp4_format="nvfp4")
ALL_CPU_QUANTIZED = ["cpu_w4a8", "cpu_int4", "cpu_w8a8", "cpu_int8", "cpu_fp4", "cpu_lut4", "cpu_fp8"]


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """The registry caches entry points; every test starts and ends uncached."""
    registry.external_kernels.cache_clear()
    yield
    registry.external_kernels.cache_clear()


def test_every_target_has_a_priority_list_of_known_kernels_ending_in_dense() -> None:
    assert set(registry.PRIORITY) == set(Target)
    for target, names in registry.PRIORITY.items():
        assert set(names) <= set(registry.BUILTIN_KERNELS), target
        assert names[-1] == "dense", target
        assert len(set(names)) == len(names), target
    assert registry.PRIORITY[Target.CPU] == EXPECTED_PRIORITY[Target.CPU]
    assert registry.PRIORITY[Target.SM90][0] == "fp8_w8a8"  # fp8 tensor cores first where they exist
    assert "fp8_w8a8" not in registry.PRIORITY[Target.SM80]
    assert "marlin_wna16" not in registry.PRIORITY[Target.SM75]
    for gpu in (Target.SM90, Target.SM89, Target.SM86, Target.SM80):  # plain FP8 W8A16 after Marlin's
        assert registry.PRIORITY[gpu][-3:] == ("fp8_marlin", "fp8_w8a16", "dense"), gpu


def test_candidates_follow_priority_and_kernels_carry_their_registered_names() -> None:
    assert registry.external_kernels() == ()  # no plugin installed in the test environment
    for target in Target:
        assert [k.name for k in registry.candidates(target)] == list(registry.PRIORITY[target])


@pytest.mark.parametrize(
    "layer,chosen,rejected",
    [
        (INT4, "cpu_int4", ["cpu_w4a8"]),  # int8 activations only where the conversion asked
        (spec(int8_activations=True), "cpu_w4a8", []),
        (INT8_CHANNEL, "cpu_int8", ["cpu_w4a8", "cpu_int4", "cpu_w8a8"]),
        (INT8_W8A8, "cpu_w8a8", ["cpu_w4a8", "cpu_int4"]),
        (FP8, "cpu_fp8", ["cpu_w4a8", "cpu_int4", "cpu_w8a8", "cpu_int8", "cpu_fp4", "cpu_lut4"]),
        (DENSE, "dense", ALL_CPU_QUANTIZED),
        (INT8_GROUPED, "dense", ALL_CPU_QUANTIZED),
        (spec(n=40), "dense", ALL_CPU_QUANTIZED),  # N % 16: the int4 pack refuses
        (spec(bits=3), "dense", ALL_CPU_QUANTIZED),
        (FP4, "cpu_fp4", ["cpu_w4a8", "cpu_int4", "cpu_w8a8", "cpu_int8"]),
        (spec(codebook="nf4"), "cpu_lut4", ["cpu_w4a8", "cpu_int4", "cpu_w8a8", "cpu_int8", "cpu_fp4"]),
    ],
)
def test_cpu_choose_first_fit_and_record_rejections(
    layer: LinearSpec, chosen: str, rejected: list[str]
) -> None:
    choice = registry.choose_kernel(layer, Target.CPU)
    assert choice.kernel.name == chosen
    assert [name for name, _ in choice.rejected] == rejected
    assert all(reason for _, reason in choice.rejected)


def test_int8_grouped_rejection_reasons_say_why() -> None:
    reasons = dict(registry.choose_kernel(INT8_GROUPED, Target.CPU).rejected)
    assert "4-bit" in reasons["cpu_int4"]
    assert "channelwise" in reasons["cpu_int8"]
    assert "fp8" in reasons["cpu_fp8"]


def vllm_layouts(target: Target) -> list[str]:
    """The target's priority list without the Kiln-only layouts (what a default conversion tries)."""
    return [n for n in registry.PRIORITY[target] if not registry.is_kiln_layout(registry.builtin_kernel(n))]


def test_gpu_dense_layer_falls_through_to_dense() -> None:
    choice = registry.choose_kernel(DENSE, Target.SM80)
    assert choice.kernel.name == "dense"
    assert [name for name, _ in choice.rejected] == vllm_layouts(Target.SM80)[:-1]
    with_kiln = registry.choose_kernel(DENSE, Target.SM80, kiln_layouts=True)
    assert [name for name, _ in with_kiln.rejected] == list(registry.PRIORITY[Target.SM80][:-1])


@pytest.mark.parametrize("target", [Target.SM75, Target.SM80, Target.SM86, Target.SM89, Target.SM90])
def test_kiln_layouts_are_chosen_only_when_asked_for(target: Target) -> None:
    """An int4 layer: Marlin bytes by default (sm75: gptq_wna16), tile_wna16 with --gpu-layout kiln and
        nothing recorded about it otherwise; act-order too, except on a rank holding a K slice (row-parallel
    TP), which stays on the vLLM-identical layouts. An
        NVFP4 layer likewise: marlin_fp4 by default, tile_fp4 when asked for."""
    half = dataclasses.replace(INT4, act_dtype="float16")
    default = registry.choose_kernel(half, target)
    assert default.kernel.name == ("gptq_wna16" if target is Target.SM75 else "marlin_wna16")
    assert "tile_wna16" not in dict(default.rejected)
    assert registry.choose_kernel(half, target, kiln_layouts=True).kernel.name == "tile_wna16"
    act_order = dataclasses.replace(half, act_order=True)
    assert registry.choose_kernel(act_order, target, kiln_layouts=True).kernel.name == "tile_wna16"
    sharded = dataclasses.replace(act_order, k_full=2 * half.k)  # a row-parallel rank's K slice
    chosen = registry.choose_kernel(sharded, target, kiln_layouts=True)
    assert chosen.kernel.name != "tile_wna16" and "act-order" in dict(chosen.rejected)["tile_wna16"]
    fp4 = dataclasses.replace(FP4, act_dtype="bfloat16")
    if target is not Target.SM75:  # FP4 runs from sm80
        assert registry.choose_kernel(fp4, target).kernel.name == "marlin_fp4"
        assert registry.choose_kernel(fp4, target, kiln_layouts=True).kernel.name == "tile_fp4"
    experts = registry.MOE_KERNELS["tile_wna16_experts"]
    assert registry.is_kiln_layout(experts) and not registry.is_kiln_layout(
        registry.MOE_KERNELS["marlin_moe_wna16"]
    )


def test_no_kernel_error_lists_every_reason() -> None:
    layer = spec(bits=3)  # no GPU kernel on sm75 takes 3-bit; dense refuses quantized layers on GPU
    with pytest.raises(NoKernelError) as info:
        registry.choose_kernel(layer, Target.SM75)
    err = info.value
    assert err.layer == layer.name and err.target == "sm75"
    assert [name for name, _ in err.rejections] == vllm_layouts(Target.SM75)
    assert dict(err.rejections)["dense"] == GPU_QUANTIZED_REASON
    for name, reason in err.rejections:
        assert f"{name}: {reason}" in str(err)


def test_disabled_kernels_from_settings_are_skipped_with_a_reason() -> None:
    settings = Settings(disabled_kernels=["cpu_int4"])
    choice = registry.choose_kernel(INT4, Target.CPU, settings.disabled_kernels)
    assert choice.kernel.name == "dense"
    reasons = dict(choice.rejected)
    assert reasons["cpu_int4"] == "disabled by KILN_DISABLED_KERNELS"
    assert list(reasons) == ALL_CPU_QUANTIZED


def test_disabled_kernels_env_var_is_csv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DISABLED_KERNELS", " cpu_int4 ,dense,")
    settings = Settings()
    assert settings.disabled_kernels == ["cpu_int4", "dense"]
    with pytest.raises(NoKernelError) as info:
        registry.choose_kernel(INT4, Target.CPU, settings.disabled_kernels)
    reasons = dict(info.value.rejections)
    assert reasons["cpu_int4"] == reasons["dense"] == "disabled by KILN_DISABLED_KERNELS"
    assert len(reasons) == len(registry.PRIORITY[Target.CPU])


def test_get_kernel_unknown_name_lists_known_kernels() -> None:
    assert registry.get_kernel("cpu_int4").name == "cpu_int4"
    with pytest.raises(KilnError, match=r"unknown kernel 'nope'.*cpu_int4.*dense"):
        registry.get_kernel("nope")


# ----------------------------------------------------------------------------------------------
# Third-party kernels through the kiln.kernels entry point
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/kernels/plugin_pkg installed with pip into a private directory (like a site-packages)."""
    root = tmp_path_factory.mktemp("plugin")
    src = root / "src"
    shutil.copytree(PLUGIN_SRC, src)  # pip builds in place; keep the repo tree clean
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    assert (site / "kiln_plugin_demo-0.1.0.dist-info" / "entry_points.txt").is_file()
    return site


@pytest.fixture
def plugin_on_path(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(plugin_site))
    importlib.invalidate_caches()
    registry.external_kernels.cache_clear()
    yield plugin_site
    for mod in [m for m in sys.modules if m.startswith("kiln_plugin_demo")]:
        del sys.modules[mod]


def test_plugin_kernel_is_tried_ahead_of_builtins_and_applied(plugin_on_path: Path) -> None:
    assert [k.name for k in registry.external_kernels()] == [PLUGIN_KERNEL]
    assert registry.candidates(Target.CPU)[0].name == PLUGIN_KERNEL
    choice = registry.choose_kernel(INT4, Target.CPU)
    assert choice.kernel.name == PLUGIN_KERNEL and choice.rejected == []
    # elsewhere its own can_implement decides: fp8 on cpu goes to the built-in, with its reason recorded
    fp8_choice = registry.choose_kernel(FP8, Target.CPU)
    assert fp8_choice.kernel.name == "cpu_fp8"
    assert fp8_choice.rejected[0] == (PLUGIN_KERNEL, "demo_fp32_int takes int layers on cpu only")
    # disabling it by name works like for built-ins
    assert registry.choose_kernel(INT4, Target.CPU, [PLUGIN_KERNEL]).kernel.name == "cpu_int4"

    kernel = registry.get_kernel(PLUGIN_KERNEL)
    assert kernel is choice.kernel
    gen = torch.Generator().manual_seed(0)
    w = IntWeight(
        codes=torch.randint(0, 16, (576, 1536), generator=gen).to(torch.uint8),
        scales=torch.rand(24, 576, generator=gen) * 0.01,
        bits=4,
        group_size=64,
    )
    tensors = kernel.prepare(w, INT4, Target.CPU)
    x = torch.randn(3, 1536)
    y = kernel.apply(x, tensors, INT4)
    ref = x @ w.dequantize().T
    assert float((y - ref).norm() / ref.norm()) < PLUGIN_GEMM_REL_ERR


def test_plugin_reusing_a_builtin_name_is_refused(
    plugin_on_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "kiln_plugin_clash-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-plugin-clash\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[kiln.kernels]\nclash = kiln_plugin_demo.kernel:ClashingNameKernel\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    registry.external_kernels.cache_clear()
    with pytest.raises(KilnError, match="reuses the built-in kernel name 'dense'"):
        registry.external_kernels()


# Today's priority rows, written out: the derived lists (KERNELS filtered by each kernel's targets)
# must equal them exactly.
_AMPERE = (
    "int8_w8a8",
    "tile_wna16",
    "marlin_wna16",
    "tile_fp4",
    "tile_lut4",
    "marlin_fp4",
    "gptq_wna16",
    "fp8_marlin",
    "fp8_w8a16",
    "dense",
)
EXPECTED_PRIORITY = {
    Target.SM90: ("fp8_w8a8", *_AMPERE),
    Target.SM89: ("fp8_w8a8", *_AMPERE),
    Target.SM86: _AMPERE,
    Target.SM80: _AMPERE,
    Target.SM75: ("tile_wna16", "tile_lut4", "gptq_wna16", "fp8_w8a16", "dense"),
    Target.CPU: ("cpu_w4a8", "cpu_int4", "cpu_w8a8", "cpu_int8", "cpu_fp4", "cpu_lut4", "cpu_fp8", "dense"),
}
THROWAWAY_KERNEL = """
import torch
from kernels.base import LinearKernel, StoredTensor
from kernels.targets import Target


class ThrowawayKernel(LinearKernel):
    name = "throwaway_int"
    schemes = frozenset({"int"})
    targets = frozenset({Target.SM86})

    def stored_tensors(self, spec, target):
        return {"w": StoredTensor((spec.n, spec.k), torch.float32)}

    def prepare(self, weight, spec, target):
        return {"w": weight.dequantize()}

    def dequantize(self, tensors, spec):
        return tensors["w"]

    def apply(self, x, tensors, spec):
        return x @ tensors["w"].T
"""


def test_priority_lists_are_derived_from_one_kernel_list_and_equal_todays_rows() -> None:
    assert registry.PRIORITY == EXPECTED_PRIORITY
    order = list(registry.BUILTIN_KERNELS)
    for names in registry.PRIORITY.values():  # every row keeps the one list's order
        assert [n for n in order if n in names] == list(names)


def test_a_new_builtin_kernel_is_one_file_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write a kernel file, add its one line to KERNELS, and it is chosen where it declares it runs:
    first on its target (ahead of the kernels it precedes), nowhere else."""
    (tmp_path / "throwaway_kernel.py").write_text(THROWAWAY_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = Path(registry.__file__).read_text()
    anchor = '    "kernels.fp8_w8a8:Fp8W8A8Kernel",\n'
    assert source.count(anchor) == 1
    edited = source.replace(anchor, '    "throwaway_kernel:ThrowawayKernel",\n' + anchor)  # the one line
    module_path = tmp_path / "registry_with_throwaway.py"
    module_path.write_text(edited)
    spec = importlib.util.spec_from_file_location("registry_with_throwaway", module_path)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.PRIORITY[Target.SM86][0] == "throwaway_int"
    assert all("throwaway_int" not in names for t, names in fresh.PRIORITY.items() if t is not Target.SM86)
    assert fresh.choose_kernel(INT4, Target.SM86).kernel.name == "throwaway_int"
    assert fresh.choose_kernel(INT4, Target.SM80).kernel.name == "marlin_wna16"
    ok, reason = fresh.get_kernel("throwaway_int").can_implement(INT4, Target.CPU)
    assert not ok and "sm86" in reason


def test_int8_activation_layers_run_w8a8_where_a_kernel_can_and_w8a16_elsewhere() -> None:
    assert registry.choose_kernel(INT8_W8A8, Target.CPU).kernel.name == "cpu_w8a8"
    assert registry.choose_kernel(INT8_W8A8, Target.CPU, ["cpu_w8a8"]).kernel.name == "cpu_int8"
    assert registry.choose_kernel(INT8_W8A8, Target.SM80).kernel.name == "int8_w8a8"
    fp16 = dataclasses.replace(INT8_W8A8, act_dtype="float16")  # sm75 has fp16 tensor cores only
    sm75 = registry.choose_kernel(fp16, Target.SM75)
    assert sm75.kernel.name == "gptq_wna16" and "int8_w8a8" not in dict(sm75.rejected)


def test_every_gpu_kernel_has_cases_on_the_real_device() -> None:
    """A kernel registered for a GPU target (a Triton kernel; `dense` is torch's own matmul) cannot
    land without its cases in tests/kernels/test_gpu_kernels_cuda.py (run by bench/gpu_check.sh)."""
    from kernels.registry import BUILTIN_KERNELS, FUSED_MOE_KERNELS, MOE_KERNELS
    from tests.kernels.test_gpu_kernels_cuda import CUDA_CASES
    from tests.kernels.test_moe_kernels import CASES as MOE_CUDA_CASES

    gpu_linear = {n for n, k in BUILTIN_KERNELS.items() if any(t.is_gpu for t in k.targets)} - {"dense"}
    assert gpu_linear <= set(CUDA_CASES), f"no CUDA cases for {sorted(gpu_linear - set(CUDA_CASES))}"
    fused = {
        k.name
        for k in MOE_KERNELS.values()
        if f"{type(k).__module__}:{type(k).__name__}" in FUSED_MOE_KERNELS
    }
    assert len(fused) == len(FUSED_MOE_KERNELS)
    assert fused <= set(MOE_CUDA_CASES), f"no CUDA cases for {sorted(fused - set(MOE_CUDA_CASES))}"
