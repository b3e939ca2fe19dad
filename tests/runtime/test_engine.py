"""Continuous batching: requests join between decode steps, leave when done, respect the limits,
and can be aborted; AsyncEngine streams concurrent requests through one batch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from runtime.engine import AsyncEngine, ContextLengthError, Engine, RequestFailedError, RequestOutput
from runtime.loader import load_model
from runtime.sampling import InvalidRequestError, SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(llama_artifact: tuple[PreTrainedModel, Path]) -> Engine:
    return Engine(load_model(llama_artifact[1]), max_num_seqs=2, max_model_len=96)


def _drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _drain_each(engine: Engine) -> dict[str, list[RequestOutput]]:
    out = {}
    for rid, prompt, n in (("b", [8, 9], 3), ("c", [10, 11, 12, 13], 4)):
        engine.add_request(rid, prompt, greedy(n))
        out.update(_drain(engine))
    engine.stats.decode_batch_sizes.clear()
    return out


def test_requests_join_between_steps_and_respect_max_num_seqs(engine: Engine) -> None:
    solo = {rid: _tokens(v) for rid, v in _drain_each(engine).items()}
    engine.add_request("a", [5, 6, 7], greedy(6))
    engine.step()  # a prefilled
    engine.step()  # a decodes alone
    engine.add_request("b", [8, 9], greedy(3))
    engine.add_request("c", [10, 11, 12, 13], greedy(4))
    first = engine.step()  # b joins (prefill) while a decodes; c waits: max_num_seqs=2
    assert engine.num_running == 2 and engine.num_waiting == 1
    outs = _drain(engine)
    outs["b"] = [o for o in first if o.request_id == "b"] + outs["b"]
    sizes = list(engine.stats.decode_batch_sizes)
    assert max(sizes) == 2  # a and b decoded in one forward
    assert engine.num_running == engine.num_waiting == 0
    # batching changes nothing: every request generates what it generates alone
    assert _tokens(outs["b"]) == solo["b"] and _tokens(outs["c"]) == solo["c"]
    assert len(set(solo["c"])) > 1
    assert outs["c"][-1].finish_reason == "length" and outs["c"][-1].num_generated == 4


def test_context_limits_are_clear_errors(engine: Engine) -> None:
    with pytest.raises(ContextLengthError, match=r"maximum context length is 96 tokens.*100 in the prompt"):
        engine.add_request("long", list(range(100)), greedy(1))
    with pytest.raises(ContextLengthError, match="90 in the prompt, 10 in the completion"):
        engine.add_request("long", list(range(90)), greedy(10))
    with pytest.raises(ContextLengthError, match="empty"):
        engine.add_request("empty", [], greedy(1))
    engine.add_request("dup", [1], greedy(1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1], greedy(1))


def test_abort_frees_the_slot_for_a_waiting_request(engine: Engine) -> None:
    for rid in "abc":
        engine.add_request(rid, [1, 2, 3], greedy(50))
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert engine.num_running == 2 and engine.num_waiting == 0  # c took a's slot
    engine.abort("b")
    engine.abort("c")
    engine.step()
    assert not engine.has_unfinished()


def test_async_engine_batches_concurrent_streams(engine: Engine) -> None:
    expected = {rid: _tokens(v) for rid, v in _drain_each(engine).items()}
    async_engine = AsyncEngine(engine)

    async def consume(rid: str, prompt: list[int], n: int) -> tuple[list[int], str]:
        tokens, text = [], ""
        async for out in async_engine.generate(rid, prompt, greedy(n)):
            tokens += out.new_token_ids
            text += out.text_delta
        return tokens, text

    async def leave_early() -> None:
        agen = async_engine.generate("quitter", [4, 4, 4], greedy(80))
        async for _ in agen:
            break
        await agen.aclose()  # what a disconnecting client does: the request is aborted

    async def main() -> list[tuple[list[int], str]]:
        results = await asyncio.gather(consume("b", [8, 9], 3), consume("c", [10, 11, 12, 13], 4))
        await leave_early()
        for _ in range(100):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        return results

    try:
        (b_tokens, _), (c_tokens, _) = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert b_tokens == expected["b"] and c_tokens == expected["c"]
    assert max(engine.stats.decode_batch_sizes) == 2
    assert engine.num_running == 0 and not engine.has_unfinished()


def test_chat_template_formats_with_the_tokenizer_template(engine: Engine) -> None:
    from runtime.chat import apply_chat_template

    tok = engine.tokenizer
    assert tok is not None
    ids = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_kiln_generate_prints_completion_and_speed(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    import typer
    from typer.testing import CliRunner

    from runtime.cli import generate_command

    app = typer.Typer()
    app.command()(generate_command)
    result = CliRunner().invoke(
        app,
        [
            str(llama_artifact[1]),
            "--prompt",
            "hello",
            "--chat",
            "--max-tokens",
            "5",
            "--kv-cache-dtype",
            "fp8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output and "load" in result.output


def test_a_request_whose_logits_break_fails_alone(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    """A prompt reaching a poisoned (NaN) embedding row: that request alone ends with an error (a
    RequestFailedError from AsyncEngine); the request batched with it decodes as if alone."""
    clean = llama_artifact[1]
    innocent_prompt, n = [8, 9, 10, 11], 12
    engine = Engine(load_model(clean), max_num_seqs=2, max_model_len=96)
    engine.add_request("alone", innocent_prompt, greedy(n))
    expected = _tokens(_drain(engine)["alone"])
    poison = next(t for t in range(100, 250) if t not in expected + innocent_prompt)
    broken = tiny_hf_model("llama")
    with torch.no_grad():
        broken.model.embed_tokens.weight[poison] = float("nan")
    engine = Engine(load_model(write_artifact(broken, tmp_path)), max_num_seqs=2, max_model_len=96)

    async def both() -> tuple[list[int], BaseException | None]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:

            async def run(rid: str, prompt: list[int]) -> list[int]:
                return [
                    t async for o in async_engine.generate(rid, prompt, greedy(n)) for t in o.new_token_ids
                ]

            innocent, hostile = await asyncio.gather(
                run("innocent", innocent_prompt), run("hostile", [poison, 8]), return_exceptions=True
            )
        finally:
            async_engine.shutdown()
        assert isinstance(innocent, list), innocent
        return innocent, hostile if isinstance(hostile, BaseException) else None

    innocent, error = asyncio.run(both())
    assert innocent == expected
    assert isinstance(error, RequestFailedError) and "non-finite logits" in str(error)
    assert engine.num_running == 0 and sorted(engine._free_slots) == [0, 1]
