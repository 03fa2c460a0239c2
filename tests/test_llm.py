"""The offline API (engine/llm.py): tiny model for the mechanics, the default model for text."""
import pytest

from ringserve.engine.llm import LLM
from ringserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=32)


def test_generate_texts_and_token_ids_in_order(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = tiny_llm.generate(["hello world", "the cache"], greedy)
    assert [o.prompt for o in outs] == ["hello world", "the cache"]
    assert outs[0].prompt_token_ids == tiny_llm.tokenizer.encode("hello world")
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == tiny_llm.tokenizer.decode(c.token_ids)
    again = tiny_llm.generate([outs[1].prompt_token_ids], greedy)   # token ids in, same result
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids and again[0].prompt is None


def test_n_samples_logprobs_and_per_prompt_params(tiny_llm):
    outs = tiny_llm.generate(["abc", "xyz"], [
        SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    first = outs[0].outputs
    assert [c.index for c in first] == [0, 1]
    for c in first:
        assert len(c.logprobs) == 5 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob < 0
    assert outs[1].outputs[0].logprobs is None and len(outs[1].outputs[0].token_ids) == 3


def test_chat_uses_the_template_and_refusals_raise(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt.startswith("<|im_start|>user") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids[0] == tiny_llm.tokenizer.bos_token_id
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_llm.generate(["a b c"], SamplingParams(max_tokens=500))
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_default_model_explains_the_kv_cache_and_seeds_reproduce(default_model_dir):
    llm = LLM(model=str(default_model_dir), max_model_len=512)
    question = [{"role": "user", "content": "Explain the KV cache in one sentence."}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    print("\nKV cache, greedy:", out.text)
    words = out.text.lower()
    assert any(w in words for w in ("cache", "memory", "key", "value", "store")), out.text
    assert len(out.text.split()) >= 5

    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=30)
    alone = llm.chat(question, seeded)[0].outputs[0]
    others = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name a colour.", "Write a haiku.")]
    crowd = llm.chat(others[:2] + [question] + others[2:],
                     [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [seeded]
                     + [SamplingParams(temperature=0.7, seed=5, max_tokens=40)])
    print("KV cache, seeded:", alone.text)
    assert crowd[2].outputs[0].token_ids == alone.token_ids
