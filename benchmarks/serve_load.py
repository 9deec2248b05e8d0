"""Load test of OpenAI-compatible servers on 127.0.0.1: streaming chat users at concurrency 1, 4 and 16.

Three servers, one after the other, each started here on a free 127.0.0.1 port and stopped before the next:
``eagle-hf`` (`eagle-hf serve`: the shipped drafter), ``plain`` (`eagle-hf serve --drafter none`, the same server
decoding plainly) and ``transformers-cb`` (`transformers serve --continuous-batching`, no drafter), all on the
embedded SmolLM2 in bf16 (transformers' server reads eagle_hf's bf16 copy of it, or its GGUF). Each level sends
``--requests`` greedy requests (MT-bench first turns, cycled) from as many concurrent users as its concurrency,
all streamed, and stops by itself: at the last request, or at ``--time-limit`` (the requests not sent yet are left
out and the level says so).

The table's run (about an hour on a quiet 2-core CPU; nothing else should run meanwhile)::

    .venv/bin/python benchmarks/serve_load.py --out runs/serve_load

A smoke run (a few minutes)::

    .venv/bin/python benchmarks/serve_load.py --servers eagle-hf,plain --concurrency 1,2 --requests 2 \\
      --max-tokens 8 --out /tmp/serve_load_smoke

Columns, per server and concurrency: requests that returned and errors; per-user tokens a second (median over the
requests of (tokens - 1) / (last token - first token): the decoding speed one user sees); time to first token
p50/p95; inter-token latency p50/p95 (the gaps between streamed tokens: a round of speculation streams its tokens
together, so its gaps are near 0 and the gap before a round is long); aggregate tokens a second (all the level's
tokens over its wall time); mean acceptance length and plain-step share (eagle-hf's `speculation` fields, pooled);
answers that differ from the ``plain`` server's for the same prompt (bf16: a multi-token forward rounds otherwise
than one-token decoding, so near-ties can flip; docs/design.md); and the server's resident memory after the level.
Written to ``--out``: results.json (every request's numbers too) and results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HOST = "127.0.0.1"  # the servers listen here only, and the clients talk to nothing else
SERVERS = ("eagle-hf", "plain", "transformers-cb")


@dataclass
class Reply:
    """One streamed request: when it was sent, when each token came, and what came."""

    prompt: int
    sent: float
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    speculation: dict | None = None
    error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def transformers_model(dtype: str) -> str:
    """What `transformers serve` loads: eagle_hf's converted copy of the embedded target in `dtype` (written by
    `eagle-hf serve`'s first start), else the GGUF itself (``folder:file.gguf``)."""
    import torch

    from eagle_hf.drafter.default import cache_root, converted_copy_dir, default_target_gguf

    folder, name = default_target_gguf()
    root = cache_root()
    if root is not None and dtype != "float32":
        copy = converted_copy_dir(Path(folder, name), getattr(torch, dtype), root)
        if (copy / "config.json").is_file():
            return str(copy)
    return f"{folder}:{name}"


def server_command(name: str, port: int, args) -> tuple[list[str], str]:
    """The command that starts server `name` on `port`, and the model name its requests give."""
    eagle = [sys.executable, "-m", "eagle_hf.cli", "serve", "--host", HOST, "--port", str(port), "--dtype", args.dtype]
    if name == "eagle-hf":
        return eagle + ["--drafter", args.drafter], "default"
    if name == "plain":
        return eagle + ["--drafter", "none"], "default"
    model = transformers_model(args.dtype)
    binary = Path(sys.executable).parent / "transformers"
    return [str(binary), "serve", model, "--continuous-batching", "--host", HOST, "--port", str(port),
            "--device", "cpu", "--dtype", args.dtype], model


def start(command: list[str], port: int, log: Path, timeout: float) -> subprocess.Popen:
    """Start a server in its own process group; return once it answers ``GET /v1/models``."""
    import httpx

    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                               env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode} before serving; see {log}")
        try:
            if httpx.get(f"http://{HOST}:{port}/v1/models", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(1)
    stop(process)
    raise RuntimeError(f"{command[0]} did not serve within {timeout:.0f} s; see {log}")


def stop(process: subprocess.Popen) -> None:
    """Stop the server this script started (its process group), politely first."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def resident_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def one(client, model: str, index: int, prompt: str, max_tokens: int) -> Reply:
    reply = Reply(prompt=index, sent=time.perf_counter())
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True)
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                if choice.delta.content:
                    reply.times.append(now)
                    reply.text += choice.delta.content
            if chunk.usage is not None:
                reply.tokens = chunk.usage.completion_tokens
                reply.speculation = (chunk.model_extra or {}).get("speculation")
    except Exception as err:  # noqa: BLE001 - every failure is counted and named in the table
        reply.error = f"{type(err).__name__}: {err}"[:300]
    return reply


async def level(url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
                deadline: float, timeout: float) -> tuple[list[Reply], float, int]:
    """`requests` requests from `concurrency` users; (replies, wall seconds, requests left out at the deadline)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    todo = asyncio.Queue()
    for i in range(requests):
        todo.put_nowait(i % len(prompts))
    replies: list[Reply] = []

    async def user():
        while not todo.empty() and time.monotonic() < deadline:
            index = todo.get_nowait()
            replies.append(await one(client, model, index, prompts[index], max_tokens))

    start_time = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    wall = time.perf_counter() - start_time
    await client.close()
    return replies, wall, todo.qsize()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summary(replies: list[Reply], wall: float, left_out: int) -> dict:
    ok = [r for r in replies if r.error is None]
    speeds = [(r.tokens - 1) / (r.times[-1] - r.times[0]) for r in ok if len(r.times) > 1 and r.times[-1] > r.times[0]]
    ttft = [r.times[0] - r.sent for r in ok if r.times]
    gaps = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
    specs = [r.speculation for r in ok if r.speculation]
    drafts = sum(s["num_drafts"] for s in specs)
    accepted = sum(s["num_accepted_tokens"] for s in specs)
    plain_steps = sum(s["num_plain_steps"] for s in specs)
    return {
        "ok": len(ok), "errors": len(replies) - len(ok), "left_out": left_out,
        "error_examples": sorted({r.error for r in replies if r.error})[:3],
        "per_user_tok_s": statistics.median(speeds) if speeds else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_ms": _ms(percentile(gaps, 50)), "itl_p95_ms": _ms(percentile(gaps, 95)),
        "aggregate_tok_s": sum(r.tokens for r in ok) / wall if wall else None, "wall_s": wall,
        "mean_acceptance_length": (accepted + drafts) / drafts if drafts else None,
        "plain_step_share": plain_steps / (drafts + plain_steps) if specs and drafts + plain_steps else None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def markdown(results: dict) -> str:
    def f(value, spec):
        return "-" if value is None else format(value, spec)

    head = ("| server | users | ok / errors | per-user tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | aggregate "
            "tok/s | τ | plain steps | differ from plain | server MB |")
    rows = [head, "|" + "---|" * 11]
    for name, levels in results["servers"].items():
        if "error" in levels:
            rows.append(f"| {name} | - | did not start: {levels['error']} |" + " |" * 8)
            continue
        for users, s in levels.items():
            cut = f" ({s['left_out']} left out)" if s["left_out"] else ""
            rows.append(
                f"| {name} | {users} | {s['ok']} / {s['errors']}{cut} | {f(s['per_user_tok_s'], '.1f')} | "
                f"{f(s['ttft_p50_s'], '.2f')} / {f(s['ttft_p95_s'], '.2f')} | {f(s['itl_p50_ms'], '.0f')} / "
                f"{f(s['itl_p95_ms'], '.0f')} | {f(s['aggregate_tok_s'], '.1f')} | "
                f"{f(s['mean_acceptance_length'], '.2f')} | {f(s['plain_step_share'], '.0%')} | "
                f"{s.get('differ_from_plain', '-')} | {f(s['server_mb'], '.0f')} |")
    return "\n".join(rows)


def compare_with_plain(results: dict, texts: dict) -> None:
    """Each level's answers that differ from the `plain` server's answer to the same prompt."""
    plain = {}
    for replies in texts.get("plain", {}).values():
        plain.update({r.prompt: r.text for r in replies if r.error is None})
    for name, levels in texts.items():
        for users, replies in levels.items():
            if name != "plain" and plain:
                results["servers"][name][users]["differ_from_plain"] = sum(
                    r.error is None and r.prompt in plain and r.text != plain[r.prompt] for r in replies)


def machine() -> dict:
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, from: {', '.join(SERVERS)}")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent users")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 per user, at least 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--prompts", default="mt_bench", help="a shipped prompt set or a JSONL file (first turns)")
    p.add_argument("--drafter", default="default", help="eagle-hf serve's --drafter")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="every server's dtype")
    p.add_argument("--time-limit", type=float, default=3 * 3600, help="seconds for the whole run; then it stops")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to start")
    p.add_argument("--request-timeout", type=float, default=900, help="seconds one request may take")
    p.add_argument("--out", default="serve_load", help="folder for results.json and results.md")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SERVERS))
    levels = [int(c) for c in args.concurrency.split(",")]
    if unknown or not names or min(levels) < 1 or (args.requests is not None and args.requests < 1):
        p.error(f"--servers from {SERVERS} (unknown: {unknown}); --concurrency and --requests at least 1")

    from eagle_hf.tools.evaluation import load_prompt_set

    prompts = [text for _, text in load_prompt_set(args.prompts) if isinstance(text, str)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_limit
    results = {"machine": machine(), "max_tokens": args.max_tokens, "dtype": args.dtype, "servers": {}}
    texts: dict[str, dict] = {}
    for name in names:
        port = free_port()
        command, model = server_command(name, port, args)
        print(f"[{name}] starting: {' '.join(command)}", flush=True)
        try:
            process = start(command, port, out / f"{name}.log", args.start_timeout)
        except RuntimeError as err:
            results["servers"][name] = {"error": str(err)}
            continue
        url, per_level, memory = f"http://{HOST}:{port}", {}, []
        texts[name] = {}
        try:
            asyncio.run(level(url, model, prompts, 1, 1, 8, deadline, args.request_timeout))  # warm-up
            for users in levels:
                n = args.requests or max(8, 4 * users)
                replies, wall, left_out = asyncio.run(level(url, model, prompts, users, n, args.max_tokens, deadline,
                                                            args.request_timeout))
                per_level[users] = {**summary(replies, wall, left_out), "server_mb": resident_mb(process.pid),
                                    "requests": [asdict(r) for r in replies]}
                texts[name][users] = replies
                s = per_level[users]
                memory.append(s["server_mb"])  # (after each level, a repeated one too: is the memory flat?)
                print(f"[{name}] {users} users: {s['ok']} ok, {s['errors']} errors, "
                      f"aggregate {s['aggregate_tok_s'] or 0:.1f} tok/s, server {s['server_mb']:.0f} MB", flush=True)
        finally:
            stop(process)
        results["servers"][name] = per_level
        results.setdefault("server_mb_after_each_level", {})[name] = memory
    compare_with_plain(results, texts)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "results.md").write_text(f"{table}\n\n{json.dumps(results['machine'])}\n")
    print(table)
    print(f"written to {out}/results.json and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
