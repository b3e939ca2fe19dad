"""The `kiln` model loader: `vllm serve ARTIFACT --load-format kiln`.

Order: refuse what cannot be served (vLLM version, target vs this machine, TP size, unmapped layers)
→ map this rank's files → let vLLM build its model with `KilnQuantConfig` (placeholders in the
artifact's layout) → bind the mapped tensors → vLLM's `process_weights_after_loading`, which finds
nothing to do → a load report: every parameter checked to still be a view of the artifact's mapping
(CPU), logged, and written as JSON to $KILN_VLLM_LOAD_REPORT when set.

Options (`--model-loader-extra-config '{"verify": true}'`): `verify` hashes this rank's files
against the manifest before mapping them (sizes are always checked).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig as VllmModelConfig
from vllm.config import VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from runtime.vllm_plugin.artifact import PluginError, VllmArtifact, open_artifact
from runtime.vllm_plugin.binding import Binding, bind_model
from runtime.vllm_plugin.compat import check_vllm_version
from runtime.vllm_plugin.quant_config import KilnQuantConfig

log = init_logger("vllm.kiln")  # under vLLM's logger, so its handlers and levels apply

REPORT_ENV = "KILN_VLLM_LOAD_REPORT"
EXTRA_CONFIG_KEYS = frozenset({"verify"})


class KilnModelLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra: dict[str, Any] = dict(load_config.model_loader_extra_config or {})
        unknown = sorted(set(extra) - EXTRA_CONFIG_KEYS)
        if unknown:
            raise PluginError(
                f"--model-loader-extra-config: unknown key(s) {unknown} for the kiln loader "
                f"(it takes {sorted(EXTRA_CONFIG_KEYS)})"
            )
        self.verify = bool(extra.get("verify", False))
        self.artifact: VllmArtifact | None = None
        self.quant_config: KilnQuantConfig | None = None
        self.binding: Binding | None = None
        self.bound_pointers: dict[str, int] = {}  # parameter -> data_ptr right after binding

    def download_model(self, model_config: VllmModelConfig) -> None:
        """A Kiln artifact is local here (`kiln pull` fetches one from S3): check it is one."""
        path = Path(model_config.model)
        if not (path / "manifest.json").is_file():
            raise PluginError(
                f"{model_config.model} is not a local Kiln artifact directory (no manifest.json); "
                'pull one first: vllm serve "$(kiln pull s3://bucket/prefix/ka-…)" --load-format kiln'
            )

    def load_model(
        self, vllm_config: VllmConfig, model_config: VllmModelConfig, prefix: str = ""
    ) -> nn.Module:
        started = time.perf_counter()
        check_vllm_version()
        self.download_model(model_config)
        quant_config = vllm_config.quant_config
        if not isinstance(quant_config, KilnQuantConfig):
            raise PluginError(
                f"{model_config.model}: vLLM resolved quantization {model_config.quantization!r}, not kiln: "
                "the artifact's config.json has no Kiln quantization config (converted by an older Kiln); "
                "add --quantization kiln"
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise PluginError(
                "pipeline parallelism is not supported by Kiln's plugin; use tensor parallelism"
            )
        device = "cpu" if vllm_config.device_config.device_type == "cpu" else "cuda"
        self.artifact = open_artifact(
            model_config.model,
            device=device,
            rank=get_tensor_model_parallel_rank(),
            world_size=get_tensor_model_parallel_world_size(),
            verify=self.verify,
        )
        self.artifact.check_model_dtype(model_config.dtype)
        quant_config.bind_artifact(self.artifact)
        self.quant_config = quant_config
        model = self._build_and_bind(vllm_config, model_config, prefix)
        report = load_report(
            model,
            self.artifact,
            self.binding,
            self.bound_pointers,
            quant_config,
            time.perf_counter() - started,
        )
        log.info(
            "kiln: %s bound %d parameters (%.1f MB) of %s; %d views of the artifact's mapping, %d copied, "
            "%d changed by vLLM after binding; %.2f s",
            report["artifact_id"],
            report["parameters"],
            report["bytes"] / 1e6,
            report["path"],
            report["views"],
            len(report["copied"]),
            len(report["changed_after_binding"]),
            report["seconds"],
        )
        if path := os.environ.get(REPORT_ENV):
            Path(path).write_text(json.dumps(report, indent=2))
        return model

    def _build_and_bind(
        self, vllm_config: VllmConfig, model_config: VllmModelConfig, prefix: str
    ) -> nn.Module:
        """`BaseModelLoader.load_model` without its two `gc.collect()` calls (0.7 s of a 0.9 s
        SmolLM2 load here): they free the transient tensors of reading and processing a checkpoint,
        and binding allocates none. vLLM's `process_weights_after_loading` still runs."""
        device = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)
        with set_default_torch_dtype(model_config.dtype), device:
            model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        self.load_weights(model, model_config)
        process_weights_after_loading(model, model_config, device)
        return model.eval()

    def load_weights(self, model: nn.Module, model_config: VllmModelConfig) -> None:
        if self.artifact is None:
            raise PluginError(
                "the kiln loader binds weights only from load_model (the artifact is opened there)"
            )
        assert isinstance(self.quant_config, KilnQuantConfig)
        self.binding = bind_model(model, self.artifact, self.quant_config)
        self.bound_pointers = {name: p.data_ptr() for name, p in model.named_parameters()}


def load_report(
    model: nn.Module,
    artifact: VllmArtifact,
    binding: Binding | None,
    bound_pointers: dict[str, int],
    quant_config: KilnQuantConfig,
    seconds: float,
) -> dict[str, Any]:
    """Every parameter after vLLM finished loading: a view of the mapping (CPU) or not, and whether
    vLLM's post-processing replaced it after the binding."""
    ranges = artifact.address_ranges()
    views, total, outside, changed, created = 0, 0, [], [], []
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        start = p.data_ptr()
        if any(lo <= start and start + nbytes <= hi for lo, hi in ranges):
            views += 1
        else:
            outside.append(name)
        if name not in bound_pointers:
            created.append(name)
        elif bound_pointers[name] != start:
            changed.append(name)
    return {
        "artifact_id": artifact.manifest.artifact_id,
        "path": str(artifact.path),
        "target": artifact.manifest.target.value,
        "device": artifact.device,
        "rank": artifact.rank,
        "world_size": artifact.world_size,
        "kernels": sorted({layer.kernel.name for layer in artifact.linears.values()}),
        "parameters": sum(1 for _ in model.parameters()),
        "bytes": total,
        "views": views,
        "not_views": outside,
        "copied": binding.copied if binding else [],
        "layers_run_on": dict(binding.runs_on) if binding else {},
        "changed_after_binding": changed,
        "created_after_binding": created,  # vLLM's own derivations (its non-AMX CPU MLA's W_UK_T / W_UV)
        "process_weights_after_loading_calls": quant_config.processed_layers,
        "torch_threads": torch.get_num_threads(),
        "seconds": round(seconds, 3),
    }
