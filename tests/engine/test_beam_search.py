"""Beam search (aiolm/engine/beam_search.py) through ``LLM.beam_search`` on a tiny random
Llama whose vocabulary is small enough that the reference can be exact: a plain beam
search written here, with transformers' own model giving every beam's full next-token
log-softmax (float32), the same candidates (the top 2 * beam_width), the same scoring
and length penalty."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

from aiolm import LLM, BeamSearchParams, ParamError, SamplingParams
from aiolm.engine.beam_search import beam_search

pytestmark = pytest.mark.slow

WORDS = [f"w{i}" for i in range(21)]
VOCAB = ["<unk>", "<eos>", *WORDS]  # 23 tokens
EOS = 1
ENGINE = dict(
    dtype="float32",
    max_model_len=128,
    kv_cache_memory=8 << 20,
    max_num_seqs=32,
    max_num_batched_tokens=256,
    num_threads=1,
    executor="local",
)


def tiny_llama(folder: Path) -> Path:
    """A random 2-layer Llama over VOCAB whose EOS is a likely but rarely the top token."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", model_max_length=128
    )
    fast.save_pretrained(str(folder))
    cfg = transformers.LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        model.lm_head.weight[EOS] *= 0.5  # flatter: EOS is among the top few, rarely first
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("beam-llama"))


@pytest.fixture(scope="module")
def hf(folder: Path):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(folder: Path):
    with LLM(str(folder), **ENGINE) as model:
        yield model


def reference(hf, prompt: list[int], width: int, max_tokens: int, penalty: float, ignore_eos: bool, stop=()):
    """(generated ids, cumulative logprob, score) of the best ``width`` beams, best first."""
    ends = set(stop) | ({EOS} if not ignore_eos else set())
    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        cands = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens))).logits[0, -1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(logp, 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                if t in ends:
                    done.append((tokens + [t], cum + lp, True))
                else:
                    cands.append((tokens + [t], cum + lp))
        cands.sort(key=lambda c: c[1], reverse=True)
        live = cands[:width]
    pool = done + [(t, c, False) for t, c in live]
    scored = [(t, c, c / (len(t) - ended) ** penalty, ended) for t, c, ended in pool]
    scored.sort(key=lambda s: s[2], reverse=True)
    return [(t[len(prompt) : len(t) - ended], c, s) for t, c, s, ended in scored[:width]]


def ids(text: str) -> list[int]:
    return [VOCAB.index(w) for w in text.split()]


@pytest.mark.parametrize(
    "width,penalty,ignore_eos",
    [(1, 1.0, False), (2, 1.0, False), (3, 0.5, False), (4, 2.0, False), (3, 1.0, True), (5, 0.0, False)],
)
def test_matches_a_brute_force_reference(llm, hf, width, penalty, ignore_eos):
    prompts = ["w3 w7 w1", "w12", "w5 w5 w9 w20 w0 w2"]
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=penalty, ignore_eos=ignore_eos)
    outs = llm.beam_search(prompts, params)
    assert len(outs) == len(prompts)
    stopped = 0
    for prompt, out in zip(prompts, outs):
        want = reference(hf, ids(prompt), width, 6, penalty, ignore_eos)
        assert out.prompt_token_ids == ids(prompt) and out.prompt == prompt
        got = out.sequences
        assert [s.token_ids for s in got] == [w[0] for w in want]
        for s, (_, cum, score) in zip(got, want):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert s.score == pytest.approx(score, abs=1e-4)
            assert s.tokens == ids(prompt) + s.token_ids + ([EOS] if s.finish_reason == "stop" else [])
            assert s.text == " ".join(VOCAB[t] for t in s.token_ids)
            assert len(s.logprobs) == len(s.tokens) - len(ids(prompt))
            stopped += s.finish_reason == "stop"
            assert s.stop_reason == (EOS if s.finish_reason == "stop" else None)
        assert [s.score for s in got] == sorted((s.score for s in got), reverse=True)
        assert len({tuple(s.tokens) for s in got}) == width
    if not ignore_eos and width > 1 and penalty <= 1.0:  # a strong penalty favours long beams
        assert stopped, "the model should end some beams with EOS"
    assert llm.engine.num_requests() == (0, 0) and not llm.engine.output.requests


def test_prompt_forms_and_the_end_token(llm, hf):
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    text = "w3 w7 w1"
    forms = [text, ids(text), {"prompt": text}, {"prompt_token_ids": ids(text)}]
    outs = llm.beam_search(forms, params)
    assert len({tuple(tuple(s.token_ids) for s in o.sequences) for o in outs}) == 1
    (single,) = llm.beam_search(text, params)
    assert [s.token_ids for s in single.sequences] == [s.token_ids for s in outs[0].sequences]
    # include_stop_str_in_output keeps the EOS in token_ids (never in the text), same ranking
    (kept,) = llm.beam_search(text, BeamSearchParams(beam_width=3, max_tokens=5, include_stop_str_in_output=True))
    for a, b in zip(single.sequences, kept.sequences):
        assert b.token_ids == a.token_ids + ([EOS] if a.finish_reason == "stop" else [])
        assert b.text == a.text and b.score == a.score


def test_stop_token_ids_end_beams_too(llm, hf):
    stop = [VOCAB.index("w4"), VOCAB.index("w11")]
    params = BeamSearchParams(beam_width=3, max_tokens=6, stop_token_ids=stop)
    outs = llm.beam_search(["w3 w7 w1", "w12"], params)
    ended = set()
    for out in outs:
        want = reference(hf, out.prompt_token_ids, 3, 6, 1.0, False, stop)
        assert [s.token_ids for s in out.sequences] == [w[0] for w in want]
        assert [s.score for s in out.sequences] == pytest.approx([w[2] for w in want], abs=1e-4)
        ended |= {s.stop_reason for s in out.sequences if s.finish_reason == "stop"}
    assert ended & set(stop), "a stop token should end some beam"


def test_width_one_is_greedy(llm):
    prompts = ["w3 w7 w1", "w12 w4"]
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    for b, g in zip(beams, greedy):
        (seq,) = b.sequences
        assert seq.token_ids == g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-4)
        assert seq.score == pytest.approx(seq.cum_logprob / len(seq.tokens), abs=1e-6)


def test_width_beyond_max_logprobs_is_refused(llm):
    with pytest.raises(ParamError) as e:
        llm.beam_search("w1", BeamSearchParams(beam_width=11, max_tokens=2))  # 22 > --max-logprobs 20
    assert e.value.param == "beam_width" and "20" in e.value.message
    with pytest.raises(ParamError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(ParamError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=math.inf)
    assert llm.engine.num_requests() == (0, 0) and not llm.engine.output.requests


def test_cancel_and_timeout_leave_nothing_running(llm):
    engine = llm.engine
    params = BeamSearchParams(beam_width=4, max_tokens=100, ignore_eos=True)

    async def cancelled() -> None:
        task = asyncio.ensure_future(beam_search(engine, "w1 w2", params))
        await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def timed_out() -> str:
        try:
            await beam_search(engine, "w1 w2", params, timeout=0.05)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__
        return "finished"

    async def settle() -> tuple[tuple[int, int], int, float]:
        for _ in range(100):
            if engine.num_requests() == (0, 0) and engine.kv_cache_usage() == 0:
                break
            await asyncio.sleep(0.02)
        return engine.num_requests(), len(engine.output.requests), engine.kv_cache_usage()

    llm._run(cancelled())
    assert llm._run(settle()) == ((0, 0), 0, 0.0)
    assert llm._run(timed_out()) == "RequestTimeoutError"
    assert llm._run(settle()) == ((0, 0), 0, 0.0)
