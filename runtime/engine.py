"""Continuous batching over a preallocated KV cache, and its asyncio front (`AsyncEngine`).

One `Engine.step()`:
  1. takes new requests and aborts handed in by other threads (a short lock, never held while
     the model runs);
  2. admits waiting requests while slots are free: each is prefilled alone (positions 0..T-1 of
     its slot) and gets its first token;
  3. runs ONE batched decode forward over every other running sequence, each at its own position;
  4. finishes sequences (EOS, stop token, stop string, max_tokens, context full) and frees their slots.

Requests therefore join the running batch between decode steps and leave when done. Under tensor
parallelism every rank runs the same engine on the same requests; rank 0's sampled tokens are
broadcast so that all ranks stay in lockstep even when sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from runtime.cuda_graph_decode import captured_decoder
from runtime.kv_cache import CALIBRATION_TEXT, KVCache
from runtime.loader import LoadedModel
from runtime.model_layout import kv_cache_geometry
from runtime.native_decode import native_decoder
from runtime.sampling import (
    NO_TOKEN,
    InvalidRequestError,
    SamplerRow,
    SamplingParams,
    TokenLogprob,
    sample,
    token_logprobs,
)
from runtime.settings import get_settings
from runtime.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048  # when the model allows more; the KV cache is sized by it
BATCH_SIZE_HISTORY = 4096

ContextParam = Literal["prompt", "max_tokens"]


class EngineDeadError(RuntimeError):
    """The engine's step loop has died: no request can be served (a 503; /health says so)."""


class RequestFailedError(RuntimeError):
    """One request could not go on (its logits could not be sampled): a 500 for it alone."""


class ContextLengthError(InvalidRequestError):
    """The prompt is empty, or it and the tokens to generate do not fit the context: a 400 for the client.

    `param` is the request field at fault: "prompt" (empty, or filling the context by itself) or
    "max_tokens". The numbers let a front end word the error its own way.
    """

    def __init__(
        self, max_model_len: int, prompt_len: int, max_tokens: int | None, param: ContextParam
    ) -> None:
        self.max_model_len = max_model_len
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.param = param
        super().__init__(self._message(), param)

    def __reduce__(self) -> tuple[type[ContextLengthError], tuple[int, int, int | None, ContextParam]]:
        return type(self), (self.max_model_len, self.prompt_len, self.max_tokens, self.param)

    def _message(self) -> str:
        if self.prompt_len == 0:
            return "the prompt is empty; send at least one token"
        limit = f"This model's maximum context length is {self.max_model_len} tokens."
        if self.max_tokens is None:
            return f"{limit} However, your prompt has {self.prompt_len} tokens; shorten it."
        return (
            f"{limit} However, you requested {self.prompt_len + self.max_tokens} tokens ({self.prompt_len} "
            f"in the prompt, {self.max_tokens} in the completion). "
            "Please reduce the length of the prompt or of max_tokens."
        )


def resolve_max_tokens(
    prompt_len: int, requested: int | None, default: int | None, max_model_len: int
) -> int:
    """How many tokens a request may generate: `requested`, else `default`, else the rest of the context.

    Raises ContextLengthError when the prompt is empty, fills the context by itself (allowed only when
    0 tokens are wanted: a prompt echoed back), or leaves no room for the tokens wanted.
    """
    wanted = requested if requested is not None else default
    if prompt_len == 0 or (prompt_len >= max_model_len and (wanted is None or wanted > 0)):
        raise ContextLengthError(max_model_len, prompt_len, wanted, "prompt")
    if wanted is None:
        return max_model_len - prompt_len
    if prompt_len + wanted > max_model_len:
        raise ContextLengthError(max_model_len, prompt_len, wanted, "max_tokens")
    return wanted


@dataclass
class RequestMetrics:
    """time.monotonic() seconds. TTFT = first_token - arrival; e2e = finished - arrival."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    num_prompt_tokens: int
    num_generated: int
    metrics: RequestMetrics
    error: str | None = None  # set when this request alone failed (finish_reason "error")


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    steps_total: int = 0
    decode_batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=BATCH_SIZE_HISTORY))


@dataclass
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # generated text so far (stop strings trimmed)
    emitted: int = 0  # characters of `text` already handed out
    finished: bool = False
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def position(self) -> int:
        """Position of the last token (the next decode's input)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (C-speed
    comparisons, only at the tail's occurrences of each stop's first character)."""
    best = 0
    for stop in stops:
        if len(stop) < 2:
            continue
        tail = text[-(len(stop) - 1) :]
        i = tail.find(stop[0])
        while i >= 0 and len(tail) - i > best:
            if stop.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(stop[0], i + 1)
    return best


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block (a no-op when it already is)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Engine:
    def __init__(self, loaded: LoadedModel, max_num_seqs: int = 8, max_model_len: int | None = None) -> None:
        settings = get_settings()
        if settings.num_threads > 0:
            torch.set_num_threads(settings.num_threads)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.manifest.artifact_id
        cfg = loaded.config
        limit = cfg.max_position_embeddings
        if cfg.sliding_window and cfg.window_layers is None:  # every layer windowed: full attention is
            # the same up to the window (layers windowed one by one mask it themselves)
            limit = min(limit, cfg.sliding_window)
        self.max_model_len = min(max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN), limit)
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = loaded.eos_token_ids
        self.model.setup(loaded.dtype, self.max_model_len, loaded.device)
        geometry = kv_cache_geometry(cfg, loaded.world_size)
        # CUDA graphs pad a step to its batch bucket with rows that write one scratch slot
        fast_step = settings.decode_step == "native"
        device_type = torch.device(loaded.device).type
        graphs = fast_step and device_type == "cuda"
        self.cache = KVCache(
            num_layers=cfg.num_layers,
            num_slots=max_num_seqs + (graphs and loaded.world_size == 1),
            max_len=self.max_model_len,
            num_kv_heads=geometry.heads,
            head_dim=geometry.width,
            dtype=loaded.dtype,
            kv_cache_dtype=loaded.kv_cache_dtype,
            device=loaded.device,
            values=geometry.values,
        )
        self.decode = self.model.decode
        self._decode_torch_threads = torch.get_num_threads()
        if fast_step and device_type == "cpu":
            native = native_decoder(
                self.model, self.cache, threads=torch.get_num_threads(), spin_us=settings.decode_spin_us
            )
            if native is not None:
                self.decode = native.decode
                # the step's own threads compute; torch's ops around it (sampling) take one, so that
                # torch's OpenMP threads do not spin on the cores the step's threads run on
                self._decode_torch_threads = 1
        if graphs:
            if self.cache.fp8:  # scales first: the graphs capture them as constants
                self._calibrate_kv_scales()
            captured = captured_decoder(
                self.model, self.cache, max_batch=max_num_seqs, max_len=self.max_model_len,
                scratch_slot=max_num_seqs, world_size=loaded.world_size,
            )  # fmt: skip
            if captured is not None:
                self.decode = captured.decode
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._inbox: deque[_Sequence] = deque()
        self._abort_inbox: list[str] = []
        self._known: set[str] = set()
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[str, _Sequence] = {}
        self._free_slots = list(range(max_num_seqs))
        self._pending_outputs: list[RequestOutput] = []
        if self.cache.fp8 and not graphs:
            self._calibrate_kv_scales()

    # --- public API ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    def has_unfinished(self) -> bool:
        return bool(
            self._running or self._waiting or self._inbox or self._pending_outputs or self._abort_inbox
        )

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        resolve_max_tokens(len(prompt_ids), params.max_tokens, None, self.max_model_len)
        vocab = self.loaded.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        banned = {t for t in (*self.eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab}
        if params.min_tokens > 0 and len(banned) >= vocab:
            raise InvalidRequestError(
                "stop_token_ids and the EOS tokens cover the whole vocabulary: with min_tokens > 0 "
                "no token could be generated; drop min_tokens or some stop_token_ids",
                "stop_token_ids",
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        seq = _Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            detok=IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None,
            generator=generator,
        )
        with self._lock:
            if request_id in self._known:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._known.add(request_id)
            self._inbox.append(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request (waiting or running) and free its slot; a no-op for unknown ids."""
        with self._lock:
            self._abort_inbox.append(request_id)

    def step(self) -> list[RequestOutput]:
        return self._step(*self._drain())

    def idle(self) -> None:
        """Called by AsyncEngine at each poll while it has nothing to do (TP: keeps the
        other ranks' wait for the next step within the process group's timeout)."""

    def _drain(self) -> tuple[list[_Sequence], list[str]]:
        """The requests added and the aborts asked for since the last step."""
        with self._lock:
            new = list(self._inbox)
            self._inbox.clear()
            aborts, self._abort_inbox = self._abort_inbox, []
        return new, aborts

    @torch.inference_mode()
    def _step(self, new: list[_Sequence], aborts: list[str]) -> list[RequestOutput]:
        self._waiting.extend(new)
        outputs, self._pending_outputs = self._pending_outputs, []
        for rid in aborts:
            outputs.extend(self._abort(rid))
        self.stats.steps_total += 1

        prefilled: set[str] = set()
        while self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            seq.slot = self._free_slots.pop(0)
            self._running[seq.request_id] = seq
            outputs.append(self._prefill(seq))
            prefilled.add(seq.request_id)

        batch = sorted(
            (s for s in self._running.values() if s.request_id not in prefilled), key=lambda s: s.slot
        )
        if batch:
            self.stats.decode_batch_sizes.append(len(batch))
            tokens = torch.tensor(
                [s.output_ids[-1] for s in batch], dtype=torch.long, device=self.model.device
            )
            with torch_threads(self._decode_torch_threads):
                logits = self.decode(tokens, [s.slot for s in batch], [s.position for s in batch], self.cache)
                new_tokens, lps = sample(logits, [self._sampler_row(s) for s in batch])
            new_tokens = self._sync_tokens(new_tokens)
            for seq, tok, lp in zip(batch, new_tokens, lps, strict=True):
                outputs.append(self._append_token(seq, tok, lp) if tok != NO_TOKEN else self._fail_row(seq))

        for seq in [s for s in self._running.values() if s.finished]:
            self._release(seq)
        return outputs

    # --- internals ------------------------------------------------------------------------------

    def _sampler_row(self, seq: _Sequence) -> SamplerRow:
        return SamplerRow(seq.params, seq.generator, len(seq.output_ids), self.eos_token_ids)

    def _sync_tokens(self, tokens: list[int]) -> list[int]:
        if self.loaded.world_size == 1:
            return tokens
        t = torch.tensor(tokens, dtype=torch.long)
        torch.distributed.broadcast(t, src=0)
        return t.tolist()

    def _prefill(self, seq: _Sequence) -> RequestOutput:
        now = time.monotonic()
        seq.metrics.first_scheduled_time = now
        ids = torch.tensor(seq.prompt_ids, dtype=torch.long, device=self.model.device)
        want_prompt_lp = seq.params.prompt_logprobs is not None
        logits = self.model.prefill(ids, seq.slot, self.cache, all_logits=want_prompt_lp)
        self.stats.prompt_tokens_total += len(seq.prompt_ids)
        if want_prompt_lp:
            n = seq.params.prompt_logprobs or 0
            lp_rows = torch.log_softmax(logits[:-1].float(), dim=-1)
            seq.prompt_logprobs = [None] + [
                token_logprobs(lp_rows[i], seq.prompt_ids[i + 1], n) for i in range(len(seq.prompt_ids) - 1)
            ]
            logits = logits[-1]
        tokens, lps = sample(logits[None], [self._sampler_row(seq)])
        tokens = self._sync_tokens(tokens)
        return self._append_token(seq, tokens[0], lps[0]) if tokens[0] != NO_TOKEN else self._fail_row(seq)

    def _append_token(self, seq: _Sequence, token: int, lp: TokenLogprob | None) -> RequestOutput:
        now = time.monotonic()
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        seq.output_ids.append(token)
        self.stats.generation_tokens_total += 1
        p = seq.params
        n_gen = len(seq.output_ids)
        if n_gen >= p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            seq.finished, seq.finish_reason = True, "stop"
        else:
            if seq.detok is not None:
                seq.text += seq.detok.add(token)
            if p.stop and n_gen >= p.min_tokens:
                # only occurrences that reach past the text already handed out are new
                found = (seq.text.find(s, max(0, seq.emitted - len(s) + 1)) for s in p.stop)
                hits = [i for i in found if i >= 0]
                if hits:
                    seq.text = seq.text[: min(hits)]
                    seq.finished, seq.finish_reason = True, "stop"
        if not seq.finished and (n_gen >= p.max_tokens or seq.position + 1 >= self.max_model_len):
            seq.finished, seq.finish_reason = True, "length"
        if seq.finished:
            end = len(seq.text)
            m.finished_time = now
        else:
            end = len(seq.text) - (_held_back(seq.text, p.stop) if p.stop else 0)
        delta = seq.text[seq.emitted : end] if end > seq.emitted else ""
        seq.emitted = max(seq.emitted, end)
        prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            text_delta=delta,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            logprobs=[lp] if lp is not None else None,
            prompt_logprobs=prompt_lps,
            num_prompt_tokens=len(seq.prompt_ids),
            num_generated=n_gen,
            metrics=m,
        )

    def _fail_row(self, seq: _Sequence) -> RequestOutput:
        """End one request whose logits could not be sampled (NaN / +inf from the model, or no
        finite logit left); the rest of the batch carries on."""
        log.error("request %s: the model produced no samplable logits; ending it alone", seq.request_id)
        return self._ended(
            seq,
            "error",
            f"the model produced non-finite logits for this request after {len(seq.output_ids)} "
            "generated tokens; it was ended alone (other requests are unaffected)",
        )

    def _ended(self, seq: _Sequence, reason: str, error: str | None = None) -> RequestOutput:
        """Mark `seq` finished for `reason` ("error" / "abort") and its last output, with no token."""
        seq.finished, seq.finish_reason = True, reason
        seq.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=reason,
            logprobs=None,
            prompt_logprobs=None,
            num_prompt_tokens=len(seq.prompt_ids),
            num_generated=len(seq.output_ids),
            metrics=seq.metrics,
            error=error,
        )

    def _release(self, seq: _Sequence) -> None:
        self._running.pop(seq.request_id, None)
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
            seq.slot = -1
        with self._lock:
            self._known.discard(seq.request_id)
        self.stats.requests_finished_total += 1

    def _abort(self, request_id: str) -> list[RequestOutput]:
        seq = self._running.get(request_id)
        if seq is None:
            seq = next((s for s in self._waiting if s.request_id == request_id), None)
            if seq is None:
                return []
            self._waiting.remove(seq)
        output = self._ended(seq, "abort")
        self._release(seq)
        return [output]

    @torch.inference_mode()
    def _calibrate_kv_scales(self) -> None:
        """Choose the FP8 KV scales from one prefill over a fixed text (see runtime/kv_cache.py)."""
        if self.tokenizer is not None:
            ids = self.tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
        else:
            ids = [i % self.loaded.config.vocab_size for i in range(64)]
        ids = ids[: self.max_model_len]
        self.cache.begin_calibration()
        self.model.prefill(torch.tensor(ids, dtype=torch.long, device=self.model.device), 0, self.cache)
        self.cache.end_calibration()
        log.info("fp8 KV cache: per-layer scales calibrated on %d tokens", len(ids))


class AsyncEngine:
    """Runs `Engine.step()` while there is work and hands outputs to asyncio.

    Two ways to drive it: `start()` runs the step loop on a background thread (in-process servers,
    tests), `run_here()` runs it on the calling thread while the asyncio side lives elsewhere.
    `kiln serve` uses `run_here()` on the thread that loaded the model: torch's OpenMP pool belongs
    to the thread that first ran a parallel region, and a second computing thread gets a second
    pool, which on a small machine (more pool threads than cores) makes libgomp's workers sleep
    instead of spin between ops — batch-1 decode measured at half speed.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._driven_here = False
        self._died: BaseException | None = None  # what ended the step loop, if it did not stop cleanly

    @property
    def dead(self) -> str | None:
        """Why the engine can serve no more requests (its step loop died), or None while it can."""
        if isinstance(self._died, EngineDeadError):
            return str(self._died)
        if self._died is not None:
            return f"the engine's step loop died: {type(self._died).__name__}: {self._died}"
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            return "the engine's thread has exited"
        return None

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def start(self) -> None:
        """Drive the engine from a background thread (a no-op while `run_here` drives it)."""
        if self._thread is None and not self._driven_here:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def fail(self, reason: str) -> None:
        """Declare the engine unusable from outside its loop (a tensor-parallel peer died): the
        requests in flight and new ones get EngineDeadError, /health 503, the step loop stops."""
        self._died = EngineDeadError(reason)
        self._fail_streams(self._died)
        self._stop = True
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        if isinstance(item, RequestOutput) and item.error is not None:
            item = RequestFailedError(item.error)
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            self._streams.pop(request_id, None)

    def _fail_streams(self, error: BaseException) -> None:
        """End every request in flight with `error`."""
        for rid in list(self._streams):
            self._deliver(rid, error)

    def claim_for_caller(self) -> None:
        """Promise that the caller will `run_here()`: until then `start()` (the app's lifespan, a
        request) must not start a second stepping thread. Call it before the server starts."""
        self._driven_here = True

    def run_here(self, keep_running: Callable[[], bool] = lambda: True, poll_s: float = 0.2) -> None:
        """Drive the engine from the calling thread until `shutdown()` or until `keep_running()`
        (checked at least every `poll_s` seconds) turns false."""
        self._driven_here = True
        self._stop = False
        try:
            self._run(keep_running, poll_s)
        finally:
            self._driven_here = False

    def _run(self, keep_running: Callable[[], bool] = lambda: True, poll_s: float = 1.0) -> None:
        try:
            self._loop(keep_running, poll_s)
        except BaseException as e:  # the loop itself failed: fail the requests in flight, say so on /health
            self._died = e
            log.critical("the engine's step loop died; /health reports 503", exc_info=True)
            self._fail_streams(EngineDeadError(self.dead or "the engine died"))
            raise

    def _loop(self, keep_running: Callable[[], bool], poll_s: float) -> None:
        while not self._stop and keep_running():
            if not self.engine.has_unfinished():
                if not self._wake.wait(timeout=poll_s):
                    self.engine.idle()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a model failure must not leave clients waiting forever
                log.exception("engine step failed; failing the requests in flight")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._deliver(rid, e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; leaving early aborts the request."""
        if (reason := self.dead) is not None:
            raise EngineDeadError(reason)
        self.start()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                self.abort(request_id)
