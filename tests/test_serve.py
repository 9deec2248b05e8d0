"""`eagle-hf serve` driven by the `openai` client over HTTP on 127.0.0.1: greedy text equal to plain generate()
(streamed and not, on both loops: eagle_hf's and transformers' assisted one), stop strings and max_tokens as plain
generate() has them, a seeded sampled request repeatable, the acceptance of each response and the totals of
/metrics, a cancelled stream that stops its call, bad requests refused with a 4xx while the server keeps serving,
and the parts of transformers' server it builds on pinned."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch
from conftest import tiny_drafter, tiny_target, word_tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from eagle_hf.errors import EagleCompatibilityError

try:
    from eagle_hf.hf import serving
except EagleCompatibilityError as err:  # a transformers whose server it does not build on (pyproject pins one)
    pytest.skip(str(err), allow_module_level=True)

CONTEXT = 2048  # the tiny target's context: room for a long stream (the cancelled one)
PROMPTS = ["wa wb wc wd", "we wf Ã© wg wh wi wj wk"]
#: draft settings of the servers: eagle_hf's loop (the adaptive schedule) and transformers' assisted loop (a chain)
SETTINGS = {"adaptive": {}, "chain": {"num_assistant_tokens": 3}}


@contextlib.contextmanager
def running(app):
    """`app` served by uvicorn on a free 127.0.0.1 port, in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)  # tiny models: thread-pool overhead dominates
    target = tiny_target("llama", max_position_embeddings=CONTEXT)
    return target, word_tokenizer(), tiny_drafter(target)


@pytest.fixture(scope="module", params=list(SETTINGS))
def server(request, models):
    target, tok, drafter = models
    app = serving.build_app(target, tok, drafter, name="tiny", draft_options=SETTINGS[request.param])
    with running(app) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def plain(models, prompt: str, **kwargs) -> tuple[str, int]:
    """Plain generate()'s text and token count for a chat prompt, greedy unless `kwargs` say otherwise."""
    target, tok, _ = models
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = target.generate(**enc, do_sample=False, **kwargs)[0, enc["input_ids"].shape[1]:]
    return tok.decode(out, skip_special_tokens=True), len(out)


def ask(client, prompt: str, stream: bool, **kwargs):
    """(text, usage, finish_reason, speculation) of one chat request."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, **kwargs)
        return r.choices[0].message.content, r.usage, r.choices[0].finish_reason, r.model_extra.get("speculation")
    parts, last = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True, **kwargs):
        parts += [c.delta.content for c in chunk.choices if c.delta.content]
        last = chunk
    return "".join(parts), last.usage, last.choices[0].finish_reason, last.model_extra.get("speculation")


def metrics(url: str) -> dict:
    """/metrics' values by name (the per-position counter summed)."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0) + value
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_text_equals_plain_generate_and_acceptance_adds_up(server, models, stream):
    url, client = server
    before = metrics(url)
    drafts = accepted = 0
    for prompt in PROMPTS:
        text, usage, finish, spec = ask(client, prompt, stream, max_tokens=24, temperature=0)
        assert (text, usage.completion_tokens) == plain(models, prompt, max_new_tokens=24)
        assert finish == "length"
        assert spec["num_drafts"] > 0 and 1.0 <= spec["mean_acceptance_length"]
        assert spec["num_accepted_tokens"] == sum(spec["num_accepted_tokens_per_pos"])
        drafts, accepted = drafts + spec["num_drafts"], accepted + spec["num_accepted_tokens"]
    after = metrics(url)
    assert after["eagle_hf:spec_decode_num_drafts_total"] - before["eagle_hf:spec_decode_num_drafts_total"] == drafts
    assert (after["eagle_hf:spec_decode_num_accepted_tokens_total"]
            - before["eagle_hf:spec_decode_num_accepted_tokens_total"]) == accepted
    assert after["eagle_hf:generation_tokens_total"] - before["eagle_hf:generation_tokens_total"] == 48
    assert after["eagle_hf:num_requests_running"] == after["eagle_hf:num_requests_waiting"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_strings_end_the_text_where_plain_generate_ends_it(server, models, stream):
    _, tok, _ = models
    _, client = server
    for prompt in PROMPTS:
        full, _ = plain(models, prompt, max_new_tokens=24)
        stop = full[len(full) // 3:][:3]  # a piece of the text, a third of the way in
        want, count = plain(models, prompt, max_new_tokens=24, stop_strings=stop, tokenizer=tok)
        assert len(want) < len(full)
        text, usage, finish, _ = ask(client, prompt, stream, max_tokens=24, stop=stop, temperature=0)
        assert (text, usage.completion_tokens, finish) == (want, count, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_rounds_that_accept_several_tokens_count_as_plain_decoding(models, stream):
    """transformers' assisted loop (a chain) puts a round's accepted tokens into the streamer as one [1, n] chunk,
    and a round can run past a stop string: with an oracle drafter (the true continuation, wrong at a few
    positions) the text, `usage` and `finish_reason` are still plain generate()'s."""
    from test_generate import oracle

    target, tok, drafter = models
    enc = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    start = enc["input_ids"].shape[1]
    reference = target.generate(**enc, max_new_tokens=40, do_sample=False)  # [1, start + 40]: what the oracle drafts
    full, count = plain(models, PROMPTS[0], max_new_tokens=24)
    stop = full[len(full) // 2:][:3]
    want = plain(models, PROMPTS[0], max_new_tokens=24, stop_strings=stop, tokenizer=tok)
    app = serving.build_app(target, tok, drafter, name="tiny", draft_options=SETTINGS["chain"])
    with running(app) as url, oracle(reference, wrong_positions={start + 5, start + 13}):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        text, usage, finish, spec = ask(client, PROMPTS[0], stream, max_tokens=24, temperature=0)
        assert (text, usage.completion_tokens, finish) == (full, count, "length")
        assert spec["num_accepted_tokens_per_pos"][1] > 0  # (rounds that accepted two drafts or more)
        text, usage, finish, _ = ask(client, PROMPTS[0], stream, max_tokens=24, stop=stop, temperature=0)
        assert (text, usage.completion_tokens, finish) == (*want, "stop")


def test_a_seeded_sampled_request_repeats(server):
    _, client = server
    runs = [ask(client, PROMPTS[1], stream, max_tokens=16, temperature=1.0, seed=7)[0] for stream in (False, True, False)]
    assert runs[0] == runs[1] == runs[2]
    greedy = ask(client, PROMPTS[1], False, max_tokens=16, temperature=0)[0]
    others = {ask(client, PROMPTS[1], False, max_tokens=16, temperature=1.0, seed=s)[0] for s in (1, 2, 3)}
    assert others != {greedy}  # (it does sample)


def test_a_cancelled_stream_stops_its_call_and_the_next_request_runs(server):
    url, client = server
    before = metrics(url)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=CONTEXT - 64, stream=True, temperature=0)
    for _, _ in zip(stream, range(4)):
        pass
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 60  # (a bound for a loaded machine, not a speed check)
    while metrics(url)["eagle_hf:request_cancelled_total"] == before["eagle_hf:request_cancelled_total"]:
        assert time.monotonic() < deadline, "the cancelled call did not stop"
        time.sleep(0.02)
    after = metrics(url)
    assert after["eagle_hf:num_requests_running"] == 0
    assert after["eagle_hf:request_success_total"] == before["eagle_hf:request_success_total"]
    assert ask(client, PROMPTS[0], False, max_tokens=4)[1].completion_tokens == 4


def test_sixteen_concurrent_users_each_get_their_plain_text(models):
    """32 requests from 16 users at once (streamed and not): none lost, each equal to plain generate()'s text."""
    import asyncio

    target, tok, drafter = models
    prompts = [*PROMPTS, "wk wl", "wm wn wo wp wq"]
    want = [plain(models, p, max_new_tokens=8)[0] for p in prompts]

    async def user(client, index: int) -> str:
        messages = [{"role": "user", "content": prompts[index % len(prompts)]}]
        if index % 2:
            r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            return r.choices[0].message.content
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                      stream=True)
        return "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])

    async def run(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        users = asyncio.Semaphore(16)

        async def one(i):
            async with users:
                return await user(client, i)

        return await asyncio.gather(*(one(i) for i in range(32)))

    with running(serving.build_app(target, tok, drafter, name="tiny")) as url:
        got = asyncio.run(run(url))
        assert got == [want[i % len(prompts)] for i in range(32)]
        after = metrics(url)
        assert after["eagle_hf:request_success_total"] == 32
        assert after["eagle_hf:num_requests_running"] == after["eagle_hf:num_requests_waiting"] == 0


BAD = [  # (what is wrong, the request's JSON body or raw bytes, the status, a piece of the message)
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("unknown model", {"model": "gpt-9"}, 404, "serves 'tiny'"),
    ("negative max_tokens", {"max_tokens": -1}, 400, "max_tokens=-1"),
    ("max_tokens not a number", {"max_tokens": "many"}, 400, "max_tokens='many'"),
    ("absurd max_tokens", {"max_tokens": 10**9}, 400, "context of 2048 tokens"),
    ("absurd max_tokens, streamed", {"max_tokens": 10**9, "stream": True}, 400, "context of 2048 tokens"),
    ("prompt past the context", {"messages": [{"role": "user", "content": "wa " * CONTEXT}]}, 400,
     "reads at most 2048"),
    ("unsupported field", {"presence_penalty": 0.5}, 400, "presence_penalty: not supported"),
    ("several choices", {"n": 2}, 400, "one choice per request"),
    ("unknown field", {"beam_width": 4}, 422, "beam_width"),
    ("bad temperature", {"temperature": -1}, 400, "temperature=-1"),
    ("bad stop", {"stop": ["wa", 3]}, 400, "stop="),
    ("no messages", {"messages": []}, 400, "messages"),
    ("token id outside the vocabulary", {"logit_bias": {"5000": 1}}, 400, "outside the vocabulary"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_request_gets_a_4xx_and_the_next_request_runs(server, case):
    url, client = server
    _, body, status, message = case
    if isinstance(body, dict):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "wa"}], "max_tokens": 4, **body}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    else:
        response = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert message in response.text
    assert ask(client, PROMPTS[0], False, max_tokens=3)[1].completion_tokens == 3


def test_the_openai_client_raises_the_servers_message(server):
    _, client = server
    with pytest.raises(openai.BadRequestError, match="presence_penalty: not supported"):
        ask(client, PROMPTS[0], False, max_tokens=3, presence_penalty=0.5)
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "wa"}])
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_legacy_completions_equal_plain_generate(server, models):
    target, tok, _ = models
    _, client = server
    enc = tok(PROMPTS[0], return_tensors="pt")
    want = tok.decode(target.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc["input_ids"].shape[1]:],
                      skip_special_tokens=True)
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens) == (want, 12)
    assert r.model_extra["speculation"]["num_drafts"] > 0


def test_without_a_drafter_the_server_decodes_plainly(models):
    target, tok, _ = models
    with running(serving.build_app(target, tok, None, name="tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        for stream in (False, True):
            text, usage, _, spec = ask(client, PROMPTS[1], stream, max_tokens=12, temperature=0)
            assert (text, usage.completion_tokens, spec) == (*plain(models, PROMPTS[1], max_new_tokens=12), None)
        assert metrics(url)["eagle_hf:spec_decode_num_drafts_total"] == 0


def test_the_parts_of_transformers_server_used_are_pinned(monkeypatch):
    serving.check_server_internals()
    changed = {**serving.PINNED, serving.GenerateManager: {"generate_streaming": ("model", "inputs")}}
    monkeypatch.setattr(serving, "PINNED", changed)
    with pytest.raises(EagleCompatibilityError, match=r"GenerateManager.generate_streaming takes \(model, processor"):
        serving.check_server_internals()


def test_a_server_without_the_parts_used_is_named_on_import(monkeypatch):
    """A transformers whose server lacks a class used (5.25 has no `DirectStreamer`): the import says which
    versions to install, not an ImportError from inside transformers."""
    import importlib
    import sys
    import types

    from transformers.cli.serving import utils

    bare = types.ModuleType(utils.__name__)
    bare.X_REQUEST_ID = utils.X_REQUEST_ID
    monkeypatch.setitem(sys.modules, utils.__name__, bare)
    monkeypatch.delitem(sys.modules, serving.__name__)
    with pytest.raises(EagleCompatibilityError, match=r"pip install 'transformers>=5.23,<5.25'"):
        importlib.import_module(serving.__name__)
    monkeypatch.undo()
    assert importlib.import_module(serving.__name__) is serving


@pytest.mark.parametrize("flags, message", [(["--num-draft-tokens", "0"], "--num-draft-tokens 0"),
                                            (["--port", "70000"], "--port 70000")])
def test_serve_flags_are_checked_before_any_model_loads(flags, message, capsys):
    from eagle_hf.cli import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


class Inner:
    """A stand-in for transformers' `DirectStreamer`: what it was handed."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("shape", ["[1, n]", "[n]"])
def test_the_streamer_gets_one_token_at_a_time_and_none_past_plain_generates_stop(shape):
    """transformers' assisted loop puts [1, n] chunks, eagle_hf's loop [n] ones; a round can run past max_tokens,
    an EOS token or a stop string."""
    from transformers import GenerationConfig

    tok = word_tokenizer()
    as_put = (lambda ids: torch.tensor([ids])) if shape == "[1, n]" else torch.tensor
    ids = tok.convert_tokens_to_ids
    cases = [  # (config, rounds after the prompt, the tokens handed on)
        (GenerationConfig(max_new_tokens=4), [[7, 8, 9], [10, 11]], [7, 8, 9, 10]),
        (GenerationConfig(max_new_tokens=9, eos_token_id=2), [[7, 2, 9], [10]], [7, 2]),
        (GenerationConfig(max_new_tokens=9, stop_strings=["wb"]), [ids(["wa", "Ġwb", "Ġwc"]), [10]],
         ids(["wa", "Ġwb"])),
    ]
    for config, rounds, handed in cases:
        inner = Inner()
        streamer = serving.PlainStreamer(inner, config, tok)
        streamer.put(as_put([1, 3, 5]))  # the prompt
        for chunk in rounds:
            streamer.put(as_put(chunk))
        streamer.end()
        assert inner.puts == [[[1, 3, 5]]] + [[t] for t in handed]
        assert not inner.ended  # (held until the call's stats are in)
        streamer.finish()
        assert inner.ended


def test_the_load_generator_summarises_its_requests():
    from benchmarks.serve_load import Reply, compare_with_plain, markdown, summary

    spec = {"num_drafts": 2, "num_accepted_tokens": 2, "num_plain_steps": 2}
    replies = [Reply(0, sent=0.0, times=[1.0, 1.5, 1.5, 2.0], text="a", tokens=4, speculation=spec),
               Reply(1, sent=0.0, times=[2.0, 3.5], text="b", tokens=2, speculation=spec),
               Reply(0, sent=0.0, error="APIConnectionError: gone")]
    s = summary(replies, wall=4.0, left_out=1)
    assert (s["ok"], s["errors"], s["left_out"]) == (2, 1, 1)
    assert s["per_user_tok_s"] == pytest.approx((3 / 1.0 + 1 / 1.5) / 2)  # (the median of two)
    assert s["ttft_p50_s"] == 1.0 and s["ttft_p95_s"] == 2.0
    assert s["itl_p50_ms"] == 500 and s["itl_p95_ms"] == 1500
    assert s["aggregate_tok_s"] == 1.5
    assert s["mean_acceptance_length"] == 2.0 and s["plain_step_share"] == 0.5
    results = {"servers": {"eagle-hf": {1: {**s, "server_mb": 700.0}}, "plain": {"error": "exited"}}}
    compare_with_plain(results, {"eagle-hf": {1: replies}, "plain": {1: [Reply(0, 0.0, text="a"), Reply(1, 0.0, text="c")]}})
    assert results["servers"]["eagle-hf"][1]["differ_from_plain"] == 1
    table = markdown(results)
    assert "| eagle-hf | 1 | 2 / 1 (1 left out) | 1.8 |" in table and "did not start: exited" in table
