"""The engine's text API (issue 28): text prompts through the checkpoint's tokenizer, decoded
outputs, stop strings (vLLM's truncation), chat templates, and clear errors without a tokenizer.

The model is ``kvstack.engine.testing.make_text_checkpoint``: a tiny random Llama whose
vocabulary is 64 words, with a word-level ``tokenizer.json`` built by the ``tokenizers`` package
(BOS prepended to text, a chat template in ``tokenizer_config.json``). Both ways the engine reads a
tokenizer are run: transformers' ``AutoTokenizer`` (the default when transformers is installed)
and a bare ``tokenizers.Tokenizer`` (the template then rendered with jinja2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from kvstack.engine.engine import LLMEngine  # noqa: E402
from kvstack.engine.sampling import SamplingParams  # noqa: E402
from kvstack.engine.scheduler import FinishReason  # noqa: E402
from kvstack.engine.testing import TEXT_WORDS, make_text_checkpoint  # noqa: E402
from kvstack.engine.tokenizer import TextTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BOS = TEXT_WORDS.index("<s>")
GREEDY = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text_checkpoint(tmp_path_factory.mktemp("text"))


def engine_of(model_dir: Path, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(
        block_size=4, num_blocks=80, max_model_len=64, max_num_batched_tokens=32
    )
    args.update(kw)
    return LLMEngine(model_dir, **args)


def bare_tokenizer(text_dir: Path) -> Any:
    return tokenizers.Tokenizer.from_file(str(text_dir / "tokenizer.json"))


@pytest.fixture(params=["auto", "tokenizers"])
def engine(request: pytest.FixtureRequest, text_dir: Path) -> LLMEngine:
    if request.param == "auto":
        pytest.importorskip("transformers")
        return engine_of(text_dir)  # the directory's tokenizer, read by AutoTokenizer
    return engine_of(text_dir, tokenizer=bare_tokenizer(text_dir))


def words(ids: tuple[int, ...] | list[int]) -> str:
    return " ".join(TEXT_WORDS[t] for t in ids if t not in (0, 1, 2))


def test_text_prompts_are_encoded_and_outputs_decoded(engine: LLMEngine) -> None:
    out = engine.generate(["hello world", "the cat sat on the mat"], GREEDY)
    assert out[0].prompt_token_ids == (BOS, TEXT_WORDS.index("hello"), TEXT_WORDS.index("world"))
    assert out[1].prompt_text == "the cat sat on the mat"
    same = engine.generate([list(out[1].prompt_token_ids)], GREEDY)[0]
    assert same.token_ids == out[1].token_ids and same.prompt_text is None
    for c in out:
        assert c.text == words(c.token_ids)  # special tokens skipped, words joined by spaces
        assert len(c.token_ids) == 12
    assert engine.generate("hello world", GREEDY)[0].token_ids == out[0].token_ids  # one string


def _stop_case(engine: LLMEngine) -> tuple[str, tuple[int, ...], str, str]:
    """(prompt, its greedy tokens, its text, a word of that text to stop at)."""
    prompt = "the cat sat on the mat"
    free = engine.generate([prompt], GREEDY)[0]
    assert free.text is not None
    word = free.text.split()[4]  # a word a few tokens in
    return prompt, free.token_ids, free.text, word


def test_a_stop_string_cuts_the_text_before_it_and_finishes(engine: LLMEngine) -> None:
    prompt, ids, text, word = _stop_case(engine)
    at = text.find(word)
    # The first token whose decoded output holds the stop string is the last one generated.
    n = next(k for k in range(1, len(ids) + 1) if word in words(ids[:k]))
    got = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop=[word, "zzz"]))[0]
    assert got.finish_reason is FinishReason.STOP
    assert got.token_ids == ids[:n]
    assert got.text == text[:at]
    kept = engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, stop=word, include_stop_str_in_output=True)
    )[0]
    assert kept.text == text[: at + len(word)] and kept.token_ids == ids[:n]
    # Streaming: the request's last event is the stopping token, marked finished.
    events = list(engine.stream([prompt], SamplingParams(max_new_tokens=12, stop=[word])))
    assert [e.token_id for e in events] == list(ids[:n])
    assert events[-1].finished and events[-1].finish_reason is FinishReason.STOP
    assert engine.kv.num_free_blocks == engine.runner.kv_cache_config.num_blocks - 1


def test_a_stop_string_in_the_last_allowed_token_still_cuts(engine: LLMEngine) -> None:
    prompt, ids, text, word = _stop_case(engine)
    n = next(k for k in range(1, len(ids) + 1) if word in words(ids[:k]))
    # max_new_tokens ends the request on the very token that completes the stop string.
    got = engine.generate([prompt], SamplingParams(max_new_tokens=n, stop=[word]))[0]
    assert got.finish_reason is FinishReason.STOP  # not LENGTH, as in vLLM
    assert got.token_ids == ids[:n] and got.text == text[: text.find(word)]


def test_chat_renders_the_template_once_with_one_bos(engine: LLMEngine) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    c = engine.chat(msgs, GREEDY)[0]
    assert c.prompt_text == "<s>user : hello . assistant :"
    assert c.prompt_token_ids == (
        BOS, *(TEXT_WORDS.index(w) for w in ["user", ":", "hello", ".", "assistant", ":"])
    )  # fmt: skip
    convs = [msgs, [{"role": "system", "content": "the sun"}, *msgs]]
    two = engine.chat(convs, GREEDY)
    assert two[0].token_ids == c.token_ids
    assert two[1].prompt_text == "<s>system : the sun . user : hello . assistant :"
    with pytest.raises(TypeError, match=r'message 0 is .*"role" and "content"'):
        engine.chat([{"content": "hi"}])


def test_without_a_tokenizer_text_needs_one(llama_dir: Path, text_dir: Path) -> None:
    engine = engine_of(llama_dir)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match=r"text prompt 'hello' needs a tokenizer: .*holds no"):
        engine.generate(["hello"])
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\['x'\] needs a tokenizer"):
        engine.add_request("a", [1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"chat needs a tokenizer"):
        engine.chat([{"role": "user", "content": "hi"}])
    assert engine.generate([[1, 2]], GREEDY)[0].text is None
    with pytest.raises(ValueError, match=r"tokenizer=.*holds no tokenizer"):
        engine_of(text_dir, tokenizer=llama_dir).tokenizer  # noqa: B018
    with pytest.raises(TypeError, match=r"tokenizer=5 is a int; give None"):
        engine_of(text_dir, tokenizer=5)


def test_a_tokenizer_without_a_chat_template(text_dir: Path) -> None:
    tok = TextTokenizer(bare_tokenizer(text_dir))  # no directory: no tokenizer_config.json
    engine = engine_of(text_dir, tokenizer=tok)
    with pytest.raises(ValueError, match=r"has no chat template"):
        engine.chat([{"role": "user", "content": "hi"}])
    assert engine.generate(["hello"], GREEDY)[0].text is not None


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=st.lists(st.sampled_from(TEXT_WORDS[3:]), min_size=1, max_size=6),
    stop=st.lists(
        st.one_of(
            st.sampled_from(TEXT_WORDS[3:]), st.text("abcdehilnorst ", min_size=1, max_size=3)
        ),
        max_size=3,
    ),
    include=st.booleans(),
)
def test_stop_strings_property(
    engine: LLMEngine, prompt: list[str], stop: list[str], include: bool
) -> None:
    """For any prompt and stop strings: the token ids are the free run's up to the first token
    whose text holds a stop string, and the text is the free run's text cut at the earliest
    stop string (after it with ``include_stop_str_in_output``)."""
    text_prompt = " ".join(prompt)
    free = engine.generate([text_prompt], SamplingParams(max_new_tokens=6))[0]
    params = SamplingParams(max_new_tokens=6, stop=stop, include_stop_str_in_output=include)
    got = engine.generate([text_prompt], params)[0]
    assert free.text is not None and got.text is not None
    hit = next((k for k in range(1, 7) if any(s in words(free.token_ids[:k]) for s in stop)), None)
    if hit is None:
        assert got.token_ids == free.token_ids and got.text == free.text
        assert got.finish_reason is FinishReason.LENGTH
        return
    assert got.token_ids == free.token_ids[:hit] and got.finish_reason is FinishReason.STOP
    full = words(free.token_ids[:hit])
    at, n = min((full.find(s), len(s)) for s in stop if s in full)
    assert got.text == full[: at + n if include else at]
    assert engine.kv.num_free_blocks == engine.runner.kv_cache_config.num_blocks - 1
