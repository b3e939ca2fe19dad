"""The golden artifact set: sha256 of every file of a fixed set of conversions, to show that a change
to the converter leaves the artifacts byte-identical.

Sources are synthetic checkpoints (seeded, written by devtools/builders/synthetic.py: GPTQ with and
without act-order, AWQ, compressed-tensors int4 / FP8 / W8A8, FP8, dense; Llama, Qwen3-MoE,
Mixtral) converted for every target family, online FP8 in each scheme, TP 2 and EP 2. The manifest
is hashed without the fields that name the run (`created_at`, `kiln_version`, the source's path,
the verification's duration).

    python bench/golden_artifacts.py --write before.json       # on the old code
    python bench/golden_artifacts.py --compare before.json     # on the new code: exit 1 on a difference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devtools.builders.synthetic import (  # noqa: E402
    MIXTRAL_TINY,
    QWEN3_MOE_TINY,
    TINY,
    Dims,
    write_checkpoint,
)
from services.convert.library import ConversionRequest, convert  # noqa: E402

RUN_FIELDS = ("created_at", "kiln_version")


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str
    targets: tuple[str, ...]
    dims: Dims = TINY
    checkpoint: dict[str, Any] = field(default_factory=dict)
    method: str = "auto"
    fp8_scheme: str = "tensor"
    tp: int = 1
    ep: bool = False


GPUS = ("sm75", "sm80", "sm89", "sm90")
CASES = (
    Case("gptq", "gptq", (*GPUS, "cpu")),
    Case("gptq-actorder-g32", "gptq", ("sm80", "cpu"), checkpoint={"act_order": True, "group_size": 32}),
    Case("gptq-8bit-asym", "gptq", ("sm80", "cpu"), checkpoint={"bits": 8, "sym": False}),
    Case("gptq-tp2", "gptq", ("sm80", "cpu"), tp=2),
    Case("awq", "awq", ("sm80", "cpu")),
    Case("ct-pack", "ct-pack", ("sm80", "cpu")),
    Case("ct-fp8-channel", "ct-fp8", ("sm80", "sm90", "cpu"), checkpoint={"fp8_strategy": "channel"}),
    Case("ct-fp8-block", "ct-fp8", ("sm80", "sm90", "cpu"), checkpoint={"fp8_strategy": "block"}),
    Case("ct-int8", "ct-int8", ("sm80", "sm90", "cpu")),
    Case("fp8", "fp8", ("sm80", "sm89", "cpu")),
    Case("dense", "dense", (*GPUS, "cpu")),
    *(
        Case(f"dense-fp8-{s}", "dense", ("sm80", "sm90", "cpu"), method="fp8", fp8_scheme=s)
        for s in ("tensor", "channel", "block")
    ),
    Case("dense-fp8-tp2", "dense", ("sm90",), method="fp8", fp8_scheme="channel", tp=2),
    Case("qwen3-moe-gptq", "gptq", ("sm80", "sm90", "cpu"), dims=QWEN3_MOE_TINY),
    Case(
        "qwen3-moe-gptq-tp2",
        "gptq",
        ("sm80", "cpu"),
        dims=QWEN3_MOE_TINY,
        checkpoint={"group_size": 32},
        tp=2,
    ),
    Case("qwen3-moe-gptq-ep2", "gptq", ("sm80", "cpu"), dims=QWEN3_MOE_TINY, tp=2, ep=True),
    Case("mixtral-fp8", "ct-fp8", ("sm80", "sm90", "cpu"), dims=MIXTRAL_TINY),
    Case("mixtral-int8", "ct-int8", ("sm90", "cpu"), dims=MIXTRAL_TINY),
    Case("mixtral-dense", "dense", ("sm80", "cpu"), dims=MIXTRAL_TINY),
    Case("mixtral-online-fp8", "dense", ("sm80", "sm90", "cpu"), dims=MIXTRAL_TINY, method="fp8"),
    Case("qwen3-moe-awq", "awq", ("sm80", "cpu"), dims=QWEN3_MOE_TINY),
)


def file_digest(path: Path) -> str:
    if path.name != "manifest.json":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = json.loads(path.read_text())
    for key in RUN_FIELDS:
        manifest.pop(key, None)
    manifest["source"].pop("uri", None)  # a temporary directory
    manifest["verification"].pop("seconds", None)
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def run_case(case: Case, work: Path) -> dict[str, dict[str, str]]:
    source = write_checkpoint(work / "src" / case.name, case.fmt, dims=case.dims, **case.checkpoint)
    out = work / "out" / case.name
    request = ConversionRequest(
        str(source),
        list(case.targets),
        method=case.method,  # type: ignore[arg-type]
        tp=case.tp,
        fp8_scheme=case.fp8_scheme,
        out=str(out),
        expert_parallel=case.ep,  # type: ignore[arg-type]
    )
    digests: dict[str, dict[str, str]] = {}
    for result in convert(request):
        root = out / result.artifact_id
        digests[f"{case.name}/{result.target.value}"] = {
            p.relative_to(root).as_posix(): file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()
        }
    return digests


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="save the digests to this JSON file")
    group.add_argument("--compare", type=Path, help="compare against digests saved by --write")
    args = parser.parse_args()
    digests: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-golden-") as tmp:
        for case in CASES:
            digests.update(run_case(case, Path(tmp)))
    files = sum(len(v) for v in digests.values())
    if args.write:
        args.write.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        print(f"{len(digests)} artifacts, {files} files: digests written to {args.write}")
        return 0
    want = json.loads(args.compare.read_text())
    differ = [
        f"{artifact}/{name}"
        for artifact in sorted(set(want) | set(digests))
        for name in sorted(set(want.get(artifact, {})) | set(digests.get(artifact, {})))
        if want.get(artifact, {}).get(name) != digests.get(artifact, {}).get(name)
    ]
    for line in differ:
        print(f"DIFFERS {line}")
    print(f"{len(digests)} artifacts, {files} files: {len(differ)} differ from {args.compare}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
