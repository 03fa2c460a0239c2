"""The offline API (server/llm.py): tiny model for the mechanics, the default model for text."""
import json
import shutil

import pytest

from ringserve.gpu.errors import ModelError
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.llm import LLM


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
        assert len(c.logprobs) == 5 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))
        assert c.cumulative_logprob < 0
    assert outs[1].outputs[0].logprobs is None and len(outs[1].outputs[0].token_ids) == 3


def test_chat_uses_the_template_and_refusals_raise(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt.startswith("<|im_start|>user") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids[0] == tiny_llm.tokenizer.bos_token_id
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_llm.generate(["a b c"], SamplingParams(max_tokens=500))
    assert not tiny_llm.engine.has_unfinished_requests()


def test_prompt_logprobs_on_the_output(tiny_llm):
    """vLLM's shape: out.prompt_logprobs[0] is None, then {token id: Logprob} per prompt token,
    the prompt's own token among them; the same whatever else the prompt is batched with."""
    prompt = "the quick brown fox jumps"
    ids = tiny_llm.tokenizer.encode(prompt)
    asked = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    alone = tiny_llm.generate(prompt, asked)[0]
    assert alone.prompt_logprobs[0] is None and len(alone.prompt_logprobs) == len(ids) > 4
    for token, entry in zip(ids[1:], alone.prompt_logprobs[1:], strict=True):
        assert token in entry and entry[token].logprob <= 0 and len(entry) in (2, 3)
        assert {1, 2} <= {lp.rank for lp in entry.values()}        # the top 2, and the token's own
    crowd = tiny_llm.generate(["a long other prompt " * 4, prompt], [SamplingParams(max_tokens=5), asked])
    assert crowd[0].prompt_logprobs is None
    for a, b in zip(alone.prompt_logprobs[1:], crowd[1].prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_stop_strings_end_a_sample_like_the_server(tiny_llm):
    """SamplingParams(stop=[...]): the text is cut before the stop string (or keeps it with
    include_stop_str_in_output), finish_reason "stop", stop_reason the string, tokens after the
    one that completed it dropped, the engine sample aborted (its blocks freed)."""
    prompt = "hello world"
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = tiny_llm.generate(prompt, free)[0].outputs[0]
    stop = base.text[8:11]              # a piece from the middle of the greedy text
    cut = base.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "never seen"])
    out = tiny_llm.generate(prompt, params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (base.text[:cut], "stop", stop)
    assert out.token_ids == base.token_ids[:len(out.token_ids)] and len(out.token_ids) < 30
    assert stop in tiny_llm.tokenizer.decode(out.token_ids)     # the completing token is kept
    assert stop not in tiny_llm.tokenizer.decode(out.token_ids[:-1])
    kept = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                    stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == base.text[:cut + len(stop)]
    # n = 2: each sample stops on its own; a sample without the string runs to its length.
    two = tiny_llm.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30,
                                                   ignore_eos=True, stop=[stop]))[0].outputs
    for c in two:
        assert (c.finish_reason == "stop") == (stop in tiny_llm.tokenizer.decode(c.token_ids))
        assert stop not in c.text
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.kv.num_free_blocks == tiny_llm.engine.kv.num_blocks
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


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


def test_generation_config_sets_the_defaults_of_a_call_without_params(tiny_model_dir, tmp_path, tiny_llm):
    """vLLM's LLM: the model's generation_config.json sampling fields are what a call without
    SamplingParams samples with (here greedy); generation_config="vllm" turns them off, a folder
    takes its file's; a caller's SamplingParams is taken as it is."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "top_k": 5, "do_sample": True}))
    llm = LLM(model=str(model), max_model_len=128, max_num_batched_tokens=32)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=5)
    greedy = tiny_llm.generate("hello world", SamplingParams(temperature=0, ignore_eos=True))
    assert llm.generate("hello world")[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    drawn = llm.generate(["hello world"] * 4, SamplingParams(ignore_eos=True, seed=7))  # as given
    assert any(d.outputs[0].token_ids != greedy[0].outputs[0].token_ids for d in drawn)
    assert tiny_llm.get_default_sampling_params() == SamplingParams()  # its file has no sampling field
    off = LLM(model=str(model), generation_config="vllm", max_model_len=128, max_num_batched_tokens=32)
    assert off.get_default_sampling_params() == SamplingParams()
    folder = LLM(model=str(tiny_model_dir), generation_config=str(model), max_model_len=128,
                 max_num_batched_tokens=32)
    assert folder.get_default_sampling_params() == llm.get_default_sampling_params()
    with pytest.raises(ModelError, match="--generation-config nowhere: no such folder"):
        LLM(model=str(tiny_model_dir), generation_config="nowhere")
    for bad in (0, -3, 2.5, 1e30):  # max_new_tokens: a positive integer, named when it is not
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "generation_config.json").write_text(json.dumps({"max_new_tokens": bad}))
        with pytest.raises(ModelError, match="max_new_tokens must be a positive integer"):
            LLM(model=str(tiny_model_dir), generation_config=str(tmp_path / "bad"))
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4, "temperature": 0}))
    capped = LLM(model=str(model), max_model_len=128, max_num_batched_tokens=32)
    assert capped.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=4)
    assert 1 <= len(capped.generate("hello world")[0].outputs[0].token_ids) <= 4  # SamplingParams' 16 without
