"""`kiln plan` and `kiln convert`: the conversion library on the command line.

Failures print one line (`error: ...`) and exit non-zero; no traceback for KilnError.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from kernels.errors import KilnError
from kernels.targets import TARGET_NAMES
from runtime.cli_output import err, print_error
from services.convert.choices import FP8_SCHEMES, GPU_LAYOUTS, HEAD_QUANTS, METHODS

if TYPE_CHECKING:
    from rich.table import Table

    from services.convert.pipeline import ConversionResult
    from services.convert.spec import ConversionSpec

# Plan tables are wide; when piped (no terminal width) don't squeeze them into 80 columns.
out = Console(width=None if sys.stdout.isatty() else 200)

TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help=f"one or more of {TARGET_NAMES} (comma-separated)")
]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="tensor-parallel size")]
EpOpt = Annotated[
    int | None,
    typer.Option(
        "--ep", min=1, help="expert-parallel size: N ranks, each holding 1/N of the experts (MoE models)"
    ),
]
METHOD_HELP = f"auto (keep the checkpoint's quantization) | {' | '.join(METHODS[1:])}"
MethodOpt = Annotated[str, typer.Option("--method", help=METHOD_HELP)]
SchemeOpt = Annotated[str, typer.Option("--fp8-scheme", help=f"online FP8 scales: {' | '.join(FP8_SCHEMES)}")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
HeadOpt = Annotated[
    str | None,
    typer.Option(
        "--quantize-head",
        help=f"quantize lm_head online for the cpu target: {' | '.join(HEAD_QUANTS)} (default: int8 for a "
        "checkpoint with 4-bit layers converted for cpu, else as stored; none keeps it)",
    ),
]


GpuLayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-layout",
        help=f"GPU targets: {' | '.join(GPU_LAYOUTS)}. marlin (default) stores the layouts vLLM's kernels "
        "read as they are (kiln serve and vLLM's plugin serve them); kiln stores Kiln's own layouts where "
        "one takes the layer (kiln serve's decode kernels)",
    ),
]


ActsOpt = Annotated[
    bool | None,
    typer.Option(
        "--int8-activations/--no-int8-activations",
        help="cpu target: 4-bit (and channelwise 8-bit) layers multiply int8-quantized activations with "
        "integer dot products (cpu_w4a8 / cpu_w8a8; faster decode, slightly different numerics). "
        "Default: the 4-bit layers of a cpu conversion do; --no-int8-activations keeps 16-bit ones",
        show_default=False,
    ),
]


def _ranks(tp: int, ep: int | None) -> tuple[int, bool]:
    """(ranks, expert_parallel) from --tp / --ep: --ep N is N ranks with whole experts on each."""
    if ep is None:
        return tp, False
    if tp not in (1, ep):
        raise typer.BadParameter(f"--tp {tp} and --ep {ep} name different rank counts; give one of them")
    return ep, True


def _fail(e: BaseException) -> None:
    print_error(e)
    raise typer.Exit(1)


def _plan_table(p: object) -> Table:
    from services.convert.plan import Plan

    assert isinstance(p, Plan)
    title = (
        f"{p.source} → {p.target.value}, tp={p.tp}, method={p.method}"
        f"{' (' + p.fp8_scheme + ')' if p.method == 'fp8' else ''}, format={p.format}, act={p.act_dtype}"
    )
    from rich.table import Table

    table = Table(title=title, show_lines=False, caption="rejections by kernels of other schemes: see --json")
    table.add_column("layer", no_wrap=True)
    table.add_column("scheme", no_wrap=True)
    table.add_column("N×K/rank", no_wrap=True)
    table.add_column("kernel", no_wrap=True)
    table.add_column("fallback / rejected")
    for r in p.rows:
        scheme = r.scheme.split()[0].rstrip("0123456789")
        relevant = [(k, why) for k, why in r.rejections if scheme in getattr(_kernel(k), "schemes", {scheme})]
        rejected = "; ".join(f"{k}: {why}" for k, why in relevant)
        note = ("[yellow]fallback[/] " if r.fallback else "") + rejected
        table.add_row(r.layer, r.scheme, f"{r.n}×{r.k}", r.kernel, note)
    return table


def _kernel(name: str) -> object:
    from kernels.registry import get_kernel

    try:
        return get_kernel(name)
    except KilnError:
        return None


def _spec(
    source: str,
    target: str,
    method: str,
    fp8_scheme: str,
    tp: int,
    ep: int | None,
    head: str | None,
    int8_activations: bool | None = None,
    gpu_layout: str | None = None,
) -> ConversionSpec:
    """The command line's conversion, in the request's one shape (a KilnError naming a bad value)."""
    from services.convert.library import parse_targets
    from services.convert.spec import conversion_spec

    ranks, expert_parallel = _ranks(tp, ep)
    options = {
        "fp8_scheme": fp8_scheme,
        "expert_parallel": expert_parallel,
        "quantize_head": head,
        "int8_activations": int8_activations,
        "gpu_layout": gpu_layout,
    }
    targets = parse_targets(target)
    return conversion_spec(source=source, targets=targets, method=method, tp=ranks, options=options)


def plan_cmd(
    source: Annotated[str, typer.Argument(help="checkpoint directory or s3://bucket/prefix")],
    target: TargetOpt = "sm80",
    tp: TpOpt = 1,
    method: MethodOpt = "auto",
    fp8_scheme: SchemeOpt = "tensor",
    as_json: JsonOpt = False,
    ep: EpOpt = None,
    quantize_head: HeadOpt = None,
    int8_activations: ActsOpt = None,
    gpu_layout: GpuLayoutOpt = None,
) -> None:
    """Show which kernel every layer gets for a target (and why others were rejected), without converting."""
    from services.convert.library import plan_targets

    try:
        spec = _spec(source, target, method, fp8_scheme, tp, ep, quantize_head, int8_activations, gpu_layout)
        plans = plan_targets(spec)
    except KilnError as e:
        _fail(e)
        return
    if as_json:
        payload = [p.to_json() for p in plans]
        sys.stdout.write(json.dumps(payload[0] if len(payload) == 1 else payload, indent=2) + "\n")
        return
    for p in plans:
        out.print(_plan_table(p))
        per_rank = p.rank_bytes()
        ranks = f" ({', '.join(f'{b / 1e6:.1f}' for b in per_rank)} MB per rank)" if len(per_rank) > 1 else ""
        out.print(f"expected artifact size: {sum(per_rank) / 1e6:.1f} MB{ranks}")
        for note in p.notes:
            out.print(f"[cyan]note:[/] {note}")
        fallbacks = sum(r.fallback for r in p.rows)
        if fallbacks:
            out.print(f"[yellow]{fallbacks} layer(s) fall back to a slower kernel because of their shape[/]")


def convert_cmd(
    source: Annotated[str, typer.Argument(help="checkpoint directory or s3://bucket/prefix")],
    target: TargetOpt = "sm80",
    method: MethodOpt = "auto",
    fp8_scheme: SchemeOpt = "tensor",
    tp: TpOpt = 1,
    out_url: Annotated[
        str, typer.Option("--out", help="artifact store: directory or s3://bucket/prefix")
    ] = "",
    as_json: JsonOpt = False,
    ep: EpOpt = None,
    quantize_head: HeadOpt = None,
    int8_activations: ActsOpt = None,
    gpu_layout: GpuLayoutOpt = None,
) -> None:
    """Convert a checkpoint into one verified, kernel-ready artifact per target."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from services.convert.library import ConversionRequest, convert
    from services.convert.library import Progress as Step
    from services.settings import get_settings

    settings = get_settings()
    try:
        spec = _spec(source, target, method, fp8_scheme, tp, ep, quantize_head, int8_activations, gpu_layout)
        req = ConversionRequest.from_spec(spec, out=out_url or settings.resolved_store_url)
    except KilnError as e:
        _fail(e)
        return
    bar = Progress(
        TextColumn("[bold]{task.fields[stage]}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[msg]}"),
        console=err,
        disable=as_json,
        transient=True,
    )
    task = bar.add_task("convert", total=None, stage="open", msg="")

    def on_progress(p: Step) -> None:
        stage = f"{p.stage} {p.done}/{p.total}"
        bar.update(
            task, total=p.bytes_total or None, completed=p.bytes_done, stage=stage, msg=p.message[-60:]
        )

    try:
        with bar:
            results = convert(req, progress=on_progress, settings=settings)
    except KilnError as e:
        _fail(e)
        return
    if as_json:
        sys.stdout.write(json.dumps([_result_json(r) for r in results], indent=2) + "\n")
    else:
        out.print(_results_table(results))


def _result_json(r: ConversionResult) -> dict[str, Any]:
    return {
        "artifact_id": r.artifact_id,
        "target": r.target,
        "tp": r.tp,
        "uri": r.uri,
        "reused": r.reused,
        "verification": r.manifest.verification.model_dump(),
        "layers": {n: e.kernel for n, e in r.manifest.layers.items()},
        "files": [f.model_dump() for f in r.manifest.files],
    }


def _results_table(results: list[ConversionResult]) -> Table:
    from rich.table import Table

    table = Table(title="Kiln artifacts")
    for col in ("target", "tp", "artifact id", "kernels", "verified", "size", "where"):
        table.add_column(col, no_wrap=col in ("artifact id", "size"), overflow="fold")
    for r in results:
        m = r.manifest
        kernels: dict[str, int] = {}
        for e in m.layers.values():
            kernels[e.kernel] = kernels.get(e.kernel, 0) + 1
        v = m.verification
        size = sum(f.size for f in m.files)
        table.add_row(
            r.target,
            str(r.tp),
            r.artifact_id + (" (reused)" if r.reused else ""),
            ", ".join(f"{k}×{n}" for k, n in sorted(kernels.items())),
            f"{'ok' if v.ok else 'FAILED'} {v.layers_exact}/{v.layers_checked} exact, "
            f"max rel {v.max_rel_err:.2g}",
            f"{size / 1e6:.1f} MB",
            r.uri,
        )
    return table


def register(app: typer.Typer) -> None:
    """Add `kiln plan` and `kiln convert`."""
    app.command("plan")(plan_cmd)
    app.command("convert")(convert_cmd)
