"""The soak client: many streamed requests against a live server, mixing the native and OpenAI
routes, random lengths, clients that walk away mid-stream and aborts by request id; then checks
that every request that was let run got the right length, finish reason and (greedy) text, that
the server holds nothing afterwards, and how much each process's memory grew between the two
halves of the run. Used by tests/test_reliability.py (short form) and tests/test_soak.py (long)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import psutil

TOPICS = ["the sea", "a lighthouse", "winter", "a red fox", "trains", "the moon", "bread", "a violin", "rain",
          "mountains", "a library", "coffee", "bees", "a bridge", "clocks", "the desert"]


@dataclass
class Job:
    index: int
    route: str  # "native" | "completions" | "chat"
    prompt: str
    max_tokens: int
    greedy: bool
    seed: int
    leave_after: int | None  # events after which the client disconnects
    abort_after_s: float | None  # native only: abort by rid after this delay
    rid: str = ""


@dataclass
class Outcome:
    job: Job
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    left: bool = False  # the client walked away
    error: str | None = None


@dataclass
class SoakReport:
    requests: int
    completed: int = 0
    left: int = 0  # clients that disconnected
    aborted: int = 0  # finished with finish_reason abort after an abort by rid
    lost: list[str] = field(default_factory=list)  # requests let run that did not end as they should
    greedy_checked: int = 0
    greedy_mismatches: list[str] = field(default_factory=list)
    retractions: int = 0
    seconds: float = 0.0
    rss_mb: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # name -> (start, half, end)

    def summary(self) -> str:
        rss = ", ".join(f"{name} {a:.0f}/{b:.0f}/{c:.0f}" for name, (a, b, c) in self.rss_mb.items())
        return (f"{self.requests} requests in {self.seconds:.0f} s: {self.completed} completed, {self.left} clients "
                f"left mid-stream, {self.aborted} aborted by rid, lost {len(self.lost)}, greedy checked "
                f"{self.greedy_checked} (mismatches {len(self.greedy_mismatches)}), retractions {self.retractions}; "
                f"RSS MB start/half/end: {rss}")


def make_jobs(n: int, seed: int, max_tokens: int, greedy_prompts: int, leave_rate: float = 0.3,
              abort_rate: float = 0.1) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        route = rng.choice(["native", "completions", "chat"])
        greedy = rng.random() < 0.4
        if greedy:  # a small pool of prompts, each with a fixed length, so each has one reference
            k = rng.randrange(greedy_prompts)
            prompt = f"Write two sentences about {TOPICS[k % len(TOPICS)]}." + " Please." * (k // len(TOPICS))
            length = 1 + (k * 7) % max_tokens
        else:
            prompt = f"Tell a short story about {rng.choice(TOPICS)}" + ", and then" * rng.randrange(12) + "."
            length = rng.randint(1, max_tokens)
        leave = rng.randint(1, length + 1) if rng.random() < leave_rate else None
        abort = rng.uniform(0.0, 2.0) if route == "native" and leave is None and rng.random() < abort_rate else None
        jobs.append(Job(i, route, prompt, length, greedy, rng.randrange(1 << 30), leave, abort))
    return jobs


def _request(job: Job, model: str) -> tuple[str, dict]:
    sampling = {"temperature": 0.0 if job.greedy else 1.0, "ignore_eos": True}
    if not job.greedy:
        sampling["seed"] = job.seed
    if job.route == "native":
        return "/generate", {"text": job.prompt, "stream": True, "rid": job.rid,
                             "sampling_params": {**sampling, "max_new_tokens": job.max_tokens}}
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": job.max_tokens,
            **sampling}
    if job.route == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": job.prompt}]}
    return "/v1/completions", {**body, "prompt": job.prompt}


async def run_one(client: httpx.AsyncClient, job: Job, model: str) -> Outcome:
    out = Outcome(job)
    job.rid = f"soak-{job.index}-{job.seed}"
    path, body = _request(job, model)
    abort_task = None
    if job.abort_after_s is not None:
        async def abort_later():
            await asyncio.sleep(job.abort_after_s)
            await client.post("/abort_request", json={"rid": job.rid})
        abort_task = asyncio.create_task(abort_later())
    events = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = str(data["error"])
                elif job.route == "native":
                    out.text, out.tokens = data["text"], data["meta_info"]["completion_tokens"]
                    reason = data["meta_info"]["finish_reason"]
                    out.finish = reason and reason["type"]
                else:
                    for choice in data["choices"]:
                        piece = choice["delta"].get("content") if job.route == "chat" else choice["text"]
                        out.text += piece or ""
                        out.finish = choice["finish_reason"] or out.finish
                    if data.get("usage"):
                        out.tokens = data["usage"]["completion_tokens"]
                if job.leave_after is not None and events >= job.leave_after:
                    out.left = True
                    return out  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if abort_task is not None:
            abort_task.cancel()
    return out


def process_rss_mb(pid: int) -> dict[str, float]:
    """RSS of the server's main process and of each child, by the child's name."""
    main = psutil.Process(pid)
    out = {"main": main.memory_info().rss / 2**20}
    for child in main.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            name = json.loads(cmd[cmd.index("{"):])["name"] if "{" in cmd else str(child.pid)
            out[name] = child.memory_info().rss / 2**20
        except (psutil.Error, ValueError, KeyError):
            continue
    return out


async def soak(url: str, pid: int, n: int, concurrency: int, seed: int = 0, max_tokens: int = 24,
               greedy_prompts: int = 12, api_key: str | None = None) -> tuple[SoakReport, list[Outcome]]:
    """Runs n jobs at the given concurrency; measures RSS at the start, half way and the end."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    jobs = make_jobs(n, seed, max_tokens, greedy_prompts)
    report = SoakReport(n)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rss = [process_rss_mb(pid)]
        gate = asyncio.Semaphore(concurrency)
        done = 0

        async def guarded(job: Job) -> Outcome:
            nonlocal done
            async with gate:
                outcome = await run_one(client, job, model)
            done += 1
            if done == n // 2:
                rss.append(process_rss_mb(pid))
            return outcome

        start = time.monotonic()
        outcomes = await asyncio.gather(*(guarded(j) for j in jobs))
        report.seconds = time.monotonic() - start
        await wait_idle(client)
        rss.append(process_rss_mb(pid))
        report.rss_mb = {name: (rss[0].get(name, 0.0), rss[1].get(name, 0.0), rss[-1].get(name, 0.0))
                         for name in rss[-1]}
        references = await greedy_references(client, [o.job for o in outcomes if o.job.greedy], model)
    for o in outcomes:
        job = o.job
        if o.left:
            report.left += 1
            continue
        if o.error is not None:
            report.lost.append(f"#{job.index} {job.route}: {o.error}")
            continue
        if job.abort_after_s is not None and o.finish == "abort":
            report.aborted += 1
            continue
        if o.finish != "length" or o.tokens != job.max_tokens:
            report.lost.append(f"#{job.index} {job.route}: finish {o.finish}, {o.tokens} of {job.max_tokens} tokens")
            continue
        report.completed += 1
        if job.greedy:
            report.greedy_checked += 1
            want = references[(job.prompt, job.max_tokens, job.route)]
            if o.text != want:
                report.greedy_mismatches.append(f"#{job.index} {job.route}: {o.text!r} != alone {want!r}")
    return report, outcomes


async def greedy_references(client: httpx.AsyncClient, jobs: list[Job], model: str) -> dict:
    """Each distinct greedy request run alone, one at a time, non-streamed."""
    refs = {}
    for job in jobs:
        key = (job.prompt, job.max_tokens, job.route)
        if key in refs:
            continue
        alone = Job(-1, job.route, job.prompt, job.max_tokens, True, 0, None, None, rid="")
        path, body = _request(alone, model)
        body = {**body, "stream": False}
        body.pop("rid", None)
        r = (await client.post(path, json=body)).json()
        refs[key] = (r["text"] if job.route == "native" else
                     r["choices"][0]["message"]["content"] if job.route == "chat" else r["choices"][0]["text"])
    return refs


async def wait_idle(client: httpx.AsyncClient, timeout: float = 30.0) -> dict:
    """The server's stats once nothing runs, waits or streams any more (or after the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.get("/get_server_info")).json()["stats"]
        busy = (stats["num_running"], stats["num_waiting"], stats["num_tokenizer_requests"],
                stats["num_detokenizer_streams"])
        if not any(busy) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def leaks(stats: dict) -> list[str]:
    """What an idle server still holds that it should not."""
    problems = []
    for key in ("num_running", "num_waiting", "num_tokenizer_requests", "num_detokenizer_streams", "kv_slots_locked",
                "idle_check_failures"):
        if stats[key]:
            problems.append(f"{key}={stats[key]}")
    if stats["req_slots_free"] != stats["req_slots_total"]:
        problems.append(f"request slots free {stats['req_slots_free']} of {stats['req_slots_total']}")
    held = stats["kv_slots_total"] - stats["kv_slots_free"]
    if held != stats["kv_slots_evictable"]:  # whatever is held must be the prefix cache's, evictable
        problems.append(f"{held} KV slots held, {stats['kv_slots_evictable']} of them evictable")
    return problems
