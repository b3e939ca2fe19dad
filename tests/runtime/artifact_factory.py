"""Writes small, real Kiln artifacts for runtime tests without the converter.

A tiny random Hugging Face model (transformers' own classes, so it doubles as the reference) is
split per TP rank by the runtime's own layout rules (runtime/model_layout.py: q/k/v and gate/up rows
column-parallel, o/down columns row-parallel), prepared by the `dense` kernel, and written as
rank{r}.safetensors + config/tokenizer files + manifest.json (last), following
runtime/artifact/manifest.py.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from kernels.base import DenseWeight, LinearSpec, ShardSpec, Target
from kernels.registry import get_kernel
from runtime.artifact.manifest import (
    MANIFEST_NAME,
    FileEntry,
    LayerEntry,
    Manifest,
    SourceInfo,
    Verification,
    artifact_id,
    sha256_file,
    source_digest,
)
from runtime.model_layout import LinearLayout, ModelConfig, linear_layouts, rank_shape, shard_rows

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte-level: every byte is a token (multi-byte chars span tokens)
BOS_ID, EOS_ID = 256, 258


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small random config: hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 259."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.15,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        common["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model_type = "llama"
    elif arch == "qwen2":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        model_type = "qwen2"
    elif arch == "mistral":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        common["sliding_window"] = 256
        model_type = "mistral"
    elif arch == "smollm2":  # Llama with tied embeddings
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
        common["tie_word_embeddings"] = True
        model_type = "llama"
    else:
        raise ValueError(arch)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def _rank_weight(
    sd: dict[str, torch.Tensor], layout: LinearLayout, cfg: ModelConfig, rank: int, tp: int, suffix: str
) -> torch.Tensor | None:
    """This rank's slice of a (fused) layer's weight or bias, following runtime.model_layout."""
    parts = []
    for shard in layout.shards:
        t = sd.get(f"{shard.module}.{suffix}")
        if t is None:
            return None
        if layout.row_parallel and tp > 1:
            per = layout.k // tp
            parts.append(t[:, rank * per : (rank + 1) * per] if suffix == "weight" else t)
        else:
            r = shard_rows(shard, layout, cfg, rank, tp)
            parts.append(t[r.start : r.start + r.size])
    return torch.cat(parts)


def write_artifact(
    model: PreTrainedModel,
    out_root: Path,
    *,
    tp: int = 1,
    target: str = "cpu",
    lm_head_layer: bool = False,
) -> Path:
    """Write `model` as an artifact under out_root/<artifact_id>/ and return that directory."""
    cfg = model.config
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if lm_head_layer and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    layout_cfg = ModelConfig.from_hf({**cfg.to_dict(), "architectures": [type(model).__name__]})
    dense = get_kernel("dense")
    layers: dict[str, LayerEntry] = {}
    rank_tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for layout in linear_layouts(layout_cfg, lm_head_layer):
        shape = rank_shape(layout, layout_cfg, 0, tp)
        has_bias = all(f"{s.module}.bias" in sd for s in layout.shards)
        spec = LinearSpec(
            name=layout.name,
            scheme="dense",
            n=shape.n,
            k=shape.k,
            k_full=layout.k,
            bits=32,
            row_parallel=layout.row_parallel and tp > 1,
            has_bias=has_bias,
            act_dtype="float32",
            shards=tuple(
                ShardSpec(s.module, size) for s, size in zip(layout.shards, shape.shard_sizes, strict=True)
            )
            if layout.fused
            else (),
        )
        for r in range(tp):
            w = _rank_weight(sd, layout, layout_cfg, r, tp, "weight")
            assert w is not None, layout.name
            bias = _rank_weight(sd, layout, layout_cfg, r, tp, "bias") if has_bias else None
            prepared = dense.prepare(DenseWeight(weight=w.contiguous(), bias=bias), spec, Target(target))
            for suffix, t in prepared.items():
                rank_tensors[r][f"{layout.name}.{suffix}"] = t.contiguous().clone()
        layers[layout.name] = LayerEntry(
            kernel=dense.name,
            layout_version=dense.layout_version,
            spec=spec.to_json(),
            tensors=sorted(dense.stored_tensors(spec, Target(target))),
        )

    other = ["model.embed_tokens.weight", "model.norm.weight"]
    other += [
        f"model.layers.{i}.{n}.weight"
        for i in range(cfg.num_hidden_layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    if not lm_head_layer and not cfg.tie_word_embeddings:
        other.append("lm_head.weight")
    for r in range(tp):
        for name in other:
            rank_tensors[r][name] = sd[name]

    hf_config = cfg.to_dict()
    hf_config["architectures"] = [type(model).__name__]
    weights_digest = hashlib.sha256(sd["model.embed_tokens.weight"].numpy().tobytes()).hexdigest()
    src_files = {
        "config.json": hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest(),
        "model.safetensors": weights_digest,
    }
    options = {"lm_head_layer": lm_head_layer}
    aid = artifact_id(source_digest(src_files), target, tp, "auto", {"dense": dense.layout_version}, options)
    out = out_root / aid
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    write_tokenizer(out)
    files: list[FileEntry] = []
    for r in range(tp):
        name = f"rank{r}.safetensors"
        save_file(rank_tensors[r], str(out / name))
        files.append(
            FileEntry(name=name, size=(out / name).stat().st_size, sha256=sha256_file(out / name), rank=r)
        )
    for path in sorted(out.iterdir()):
        if path.suffix != ".safetensors":
            files.append(FileEntry(name=path.name, size=path.stat().st_size, sha256=sha256_file(path)))
    manifest = Manifest(
        artifact_id=aid,
        kiln_version="test",
        created_at=dt.datetime.now(dt.UTC).isoformat(),
        source=SourceInfo(
            uri="memory://tiny", format="dense", digest=source_digest(src_files), files=src_files
        ),
        target=target,
        tp=tp,
        method="auto",
        options=options,
        architecture=type(model).__name__,
        act_dtype="float32",
        hf_config=hf_config,
        layers=layers,
        other_tensors=other,
        files=files,
        verification=Verification(ok=True, layers_checked=0, layers_exact=0, max_rel_err=0.0, seconds=0.0),
    )
    (out / MANIFEST_NAME).write_bytes(manifest.to_json_bytes())
    return out


# ---- edited copies (tampering tests) ----------------------------------------------------------


def copy_artifact(artifact: Path, dest_root: Path) -> Path:
    """A copy of `artifact` under dest_root/<its name>/ (an edit never touches the shared original)."""
    out = dest_root / artifact.name
    shutil.copytree(artifact, out)
    return out


def edit_manifest(artifact: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the parsed manifest.json and write it back as JSON (NaN / Infinity as Python's
    json writes them: what an edited manifest can hold)."""
    doc = json.loads((artifact / MANIFEST_NAME).read_text())
    edit(doc)
    (artifact / MANIFEST_NAME).write_text(json.dumps(doc))


def list_file(artifact: Path, name: str, payload: bytes) -> None:
    """Write `payload` as `name` and list it in the manifest with its true size and sha256."""
    (artifact / name).write_bytes(payload)
    entry = {"name": name, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "rank": None}

    def relist(doc: dict[str, Any]) -> None:
        doc["files"] = [f for f in doc["files"] if f["name"] != name] + [entry]

    edit_manifest(artifact, relist)


def unlist_file(artifact: Path, name: str) -> None:
    """Leave `name` in the directory but take it off the manifest's file list."""
    edit_manifest(artifact, lambda doc: doc.update(files=[f for f in doc["files"] if f["name"] != name]))
