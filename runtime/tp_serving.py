"""`kiln serve --tp N`: one process per tensor-parallel rank, started by `kiln serve` itself.

Rank 0 is the `kiln serve` process: it loads its shard, serves HTTP and drives the engine. Ranks
1..N-1 are child processes (spawned, `follower_main`) that load their shards and run the same
engine in lockstep: before every step rank 0 broadcasts what changed since the last one (the
requests that arrived, the aborts), every rank applies it and steps, the model all-reduces after
its row-parallel layers and rank 0's sampled tokens are broadcast (runtime/engine.py), so every
rank schedules, samples and finishes requests identically. gloo on CPU, NCCL on CUDA.

Trust: the ranks meet through a FileStore in a private (0700) directory, and gloo / NCCL are told to
use the loopback interface, so nothing listens beyond this machine's loopback; what they exchange
is JSON (step plans, load errors), never pickled objects.

Failure handling: a rank that cannot load its shard says why and every rank exits (no rank waits
for a peer that is gone); a follower that dies while serving makes rank 0 fail its requests,
answer 503 on /health and exit 1; followers exit when rank 0 is gone (they watch their parent).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.errors import KilnError
from runtime.distributed import init_tensor_parallel, remove_rendezvous, shutdown_tensor_parallel
from runtime.engine import Engine
from runtime.loader import LoadedModel, load_model
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

# An idle rank 0 tells the others it is alive this often (their wait for the next step must end
# within the process group's timeout, which also bounds how long a hung peer goes unnoticed).
HEARTBEAT_S = 60.0
GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load its shard and build the same engine."""

    artifact: str
    world_size: int
    rendezvous: str  # the private directory of the ranks' FileStore
    device: str | None
    kv_cache_dtype: str
    max_num_seqs: int
    max_model_len: int | None
    num_threads: int


@dataclass(frozen=True)
class StepPlan:
    """What rank 0 broadcasts before a step: requests that arrived (id, prompt, sampling) and
    aborts, in the order rank 0 applies them. `step` False: a heartbeat while idle."""

    new: list[tuple[str, list[int], SamplingParams]]
    aborts: list[str]
    step: bool = True


class LeaderEngine(Engine):
    """Rank 0's engine: each step starts by broadcasting its StepPlan to the other ranks."""

    def __init__(self, loaded: LoadedModel, max_num_seqs: int = 8, max_model_len: int | None = None) -> None:
        super().__init__(loaded, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self._last_sent = time.monotonic()

    def step(self) -> list:  # type: ignore[type-arg]
        new, aborts = self._drain()
        self._send(StepPlan([(s.request_id, s.prompt_ids, s.params) for s in new], aborts))
        return self._step(new, aborts)

    def idle(self) -> None:
        if time.monotonic() - self._last_sent >= HEARTBEAT_S:
            self._send(StepPlan([], [], step=False))

    def stop_followers(self) -> None:
        self._send(None)

    def _send(self, plan: StepPlan | None) -> None:
        broadcast_json(None if plan is None else plan_to_json(plan))
        self._last_sent = time.monotonic()


def plan_to_json(plan: StepPlan) -> dict[str, Any]:
    new = [[rid, ids, dataclasses.asdict(params)] for rid, ids, params in plan.new]
    return {"new": new, "aborts": plan.aborts, "step": plan.step}


def plan_from_json(data: dict[str, Any]) -> StepPlan:
    new = [(str(rid), [int(t) for t in ids], SamplingParams(**params)) for rid, ids, params in data["new"]]
    return StepPlan(new, [str(a) for a in data["aborts"]], bool(data["step"]))


def broadcast_json(value: Any) -> Any:
    """Rank 0's JSON value on every rank (its length, then its UTF-8 bytes, as tensors)."""
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size), dtype=torch.uint8)
    if data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return json.loads(buf.numpy().tobytes())


def all_gather_text(text: str | None) -> list[str | None]:
    """Every rank's `text` (None: nothing to say), in rank order."""
    data = json.dumps(text).encode()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long))
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, mine)
    return [json.loads(b[: int(n)].numpy().tobytes()) for b, n in zip(bufs, sizes, strict=True)]


def follow(engine: Engine) -> None:
    """A follower's loop: apply rank 0's plans and step, until rank 0 says stop."""
    while True:
        data = broadcast_json(None)
        if data is None:
            return
        plan = plan_from_json(data)
        for request_id, prompt_ids, params in plan.new:
            engine.add_request(request_id, prompt_ids, params)
        for request_id in plan.aborts:
            engine.abort(request_id)
        if plan.step:
            engine.step()


def load_rank(
    spec: RankSpec, rank: int, engine_cls: type[Engine] = Engine
) -> tuple[Engine | None, list[str]]:
    """Join the group, load this rank's shard and build its engine; then every rank learns whether
    all ranks did. Returns (engine, []) or (None, every rank's error)."""
    init_tensor_parallel(rank, spec.world_size, rendezvous=Path(spec.rendezvous),
                         device=spec.device or "cpu", timeout=GROUP_TIMEOUT)  # fmt: skip
    engine: Engine | None = None
    error = None
    try:
        loaded = load_model(
            Path(spec.artifact),
            device=spec.device,
            rank=rank,
            world_size=spec.world_size,
            kv_cache_dtype=spec.kv_cache_dtype,  # type: ignore[arg-type]
        )
        engine = engine_cls(loaded, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len)
    except KilnError as e:
        error = f"rank {rank}: {e}"
    except Exception as e:  # any failure must reach the other ranks, or they wait for this one
        error = f"rank {rank}: {type(e).__name__}: {e}"
    errors = all_gather_text(error)
    failed = [e for e in errors if e is not None]
    return (None, failed) if failed else (engine, [])


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()


def follower_main(rank: int, spec: RankSpec) -> None:
    """Entry point of rank `rank` (≥ 1), a child process of `kiln serve`."""
    _exit_with_parent()
    if spec.num_threads > 0:
        torch.set_num_threads(spec.num_threads)
    try:
        engine, _ = load_rank(spec, rank)
        if engine is None:
            raise SystemExit(1)  # rank 0 reports every rank's error
        follow(engine)
    finally:
        shutdown_tensor_parallel()


def start_followers(spec: RankSpec) -> list[SpawnProcess]:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=follower_main, args=(rank, spec), name=f"kiln-rank{rank}", daemon=True)
        for rank in range(1, spec.world_size)
    ]
    for p in procs:
        p.start()
    return procs


def watch_followers(procs: list[SpawnProcess], on_death: Callable[[str], None]) -> Callable[[], None]:
    """Call `on_death(reason)` once if a follower exits while rank 0 still serves. Returns the call
    that ends the watch; make it before stopping the followers on purpose (a follower that exits when
    told to is not a death: seen as exit code 1 for a clean shutdown in one CI run). Once it returns,
    `on_death` has either finished or will never run."""
    ended = threading.Event()
    lock = threading.Lock()

    def watch() -> None:
        while not ended.wait(0.5):
            dead = next((p for p in procs if not p.is_alive()), None)
            if dead is None:
                continue
            with lock:
                if not ended.is_set():
                    on_death(f"tensor-parallel {dead.name} exited with code {dead.exitcode}")
            return

    def end() -> None:
        with lock:
            ended.set()

    threading.Thread(target=watch, name="kiln-rank-watch", daemon=True).start()
    return end


def stop_followers(
    engine: LeaderEngine | None, procs: list[SpawnProcess], rendezvous: Path, timeout_s: float = 30
) -> None:
    """Tell the followers to stop (when the group still works), wait for them, then end the group
    and remove its rendezvous directory."""
    if engine is not None and all(p.is_alive() for p in procs):
        try:
            engine.stop_followers()
        except RuntimeError:  # gloo / NCCL: a peer is gone
            log.warning("could not tell the other ranks to stop; terminating them", exc_info=True)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(timeout=10)
    shutdown_tensor_parallel()
    remove_rendezvous(rendezvous)
