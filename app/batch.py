"""A batch of requests through a running deployment, as a Ray job:

    ray job submit --working-dir . -- python -m app.batch --input prompts.jsonl --output /tmp/results.jsonl

Input: one request per line in OpenAI's batch format, `{"custom_id": ..., "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`, optionally with `"kv_transfer_mode"` (else `--mode`, else the app's default).
Requests run in service class `--class` (`batch` by default: behind interactive traffic) unless their body names
one (`pd_class`). Each request goes through the app's handle API (`create_stream`), at most `--concurrency` at a time. Output: one
line per request, in the order they finish: custom_id, mode, status, text, finish reason, token counts (prompt,
completion, and prompt tokens that arrived by KV transfer), time to first token and total time; or the error. A
summary follows on stdout, and the exit status is 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.ingress.openai_protocol import REQUEST_MODELS, APIError, validated
# A request turned away by the ingress's full queue (429) is retried after the app's Retry-After, for up to
# this long: batch work waits for interactive traffic rather than failing.
DEFER_FOR_S = 600


def parse_line(number: int, line: str) -> tuple[str, dict[str, Any], str | None]:
    """(custom_id, request body, mode) of one input line; APIError 400 if it is not a valid request."""
    try:
        item = json.loads(line)
    except ValueError as e:
        raise APIError(400, f"line {number} is not valid JSON: {e}") from e
    if not isinstance(item, dict) or not isinstance(item.get("body"), dict):
        raise APIError(400, f"line {number} needs a JSON object with a `body` object")
    url = item.get("url", "/v1/chat/completions" if "messages" in item["body"] else "/v1/completions")
    if url not in REQUEST_MODELS:
        raise APIError(400, f"line {number}: url must be one of {sorted(REQUEST_MODELS)}", param="url")
    body = {**item["body"], "stream": True, "stream_options": {"include_usage": True}}  # sent with create_stream
    validated(body, chat=url == "/v1/chat/completions")  # a bad line fails the job before anything is sent
    return str(item.get("custom_id", number)), body, item.get("kv_transfer_mode")


async def run_request(handle, custom_id: str, request, mode: str, pd_class: str) -> dict[str, Any]:
    result: dict[str, Any] = {"custom_id": custom_id, "mode": mode, "class": pd_class}
    started = time.perf_counter()
    text, finish_reason, usage, first_token_s = "", None, {}, None
    try:
        async for chunk in _deferred_while_shed(handle, request, mode, pd_class, started + DEFER_FOR_S):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first_token_s is None:
                    first_token_s = time.perf_counter() - started
                text += piece
                finish_reason = choice.get("finish_reason") or finish_reason
    except APIError as e:
        return {**result, "status": e.status, "error": e.body()["error"]}
    return {**result, "status": 200, "text": text, "finish_reason": finish_reason,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "transferred_prompt_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "first_token_s": first_token_s, "total_s": time.perf_counter() - started}


async def _deferred_while_shed(handle, request, mode: str, pd_class: str, until: float):
    """The request's chunks; while the app sheds its class (429 before the first chunk), it is sent again after
    the Retry-After the app answered, until `until` (perf_counter seconds)."""
    while True:
        try:
            async for chunk in handle.options(stream=True).create_stream.remote(request, mode=mode,
                                                                                pd_class=pd_class):
                yield chunk
            return
        except APIError as e:
            wait_s = float((e.headers or {}).get("Retry-After", 1))
            if e.status != 429 or time.perf_counter() + wait_s > until:
                raise
            await asyncio.sleep(wait_s)


async def run_batch(handle, lines: list[str], default_mode: str, concurrency: int, output: Path,
                    default_class: str = "batch") -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(number: int, line: str) -> dict:
        try:
            custom_id, request, mode = parse_line(number, line)
        except APIError as e:
            return {"custom_id": str(number), "status": e.status, "error": e.body()["error"]}
        async with gate:
            return await run_request(handle, custom_id, request, mode or default_mode,
                                     request.get("pd_class") or default_class)

    results = []
    with output.open("w") as out, tqdm(total=len(lines), desc="requests", file=sys.stderr) as progress:
        for finished in asyncio.as_completed([one(n, line) for n, line in enumerate(lines, 1)]):
            result = await finished
            out.write(json.dumps(result) + "\n")
            results.append(result)
            progress.update()
    return results


def summary(results: list[dict], seconds: float) -> str:
    ok = [r for r in results if r["status"] == 200]
    lines = [f"{len(ok)} of {len(results)} requests succeeded in {seconds:.1f} s"]
    if ok:
        def quantiles(key: str) -> str:
            values = sorted(r[key] for r in ok if r[key] is not None)
            if not values:
                return "-"
            p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
            return f"p50 {statistics.median(values) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
        tokens = sum(r["completion_tokens"] or 0 for r in ok)
        lines += [f"time to first token: {quantiles('first_token_s')}", f"total time: {quantiles('total_s')}",
                  f"completion tokens: {tokens} ({tokens / seconds:.1f}/s)"]
    lines += [f"failed {r['custom_id']}: {r['status']} {r['error']['message']}" for r in results if r["status"] != 200]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True, help="JSONL of requests (OpenAI batch format)")
    parser.add_argument("--output", type=Path, required=True, help="JSONL of results, one per request")
    parser.add_argument("--app", default="pd", help="name of the Serve application to call")
    parser.add_argument("--mode", choices=("local", "pull", "push"), help="transfer mode for lines that name none")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--class", dest="pd_class", default="batch",
                        help="service class of requests whose body names none (the app's `ingress.classes`)")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    ray.init(address="auto", logging_level="WARNING")  # the cluster the job was submitted to
    handle = serve.get_app_handle(args.app)
    default_mode = args.mode or handle.transfer_modes.remote().result()["default"]
    lines = [line for line in args.input.read_text().splitlines() if line.strip()]
    started = time.perf_counter()
    results = asyncio.run(run_batch(handle, lines, default_mode, args.concurrency, args.output, args.pd_class))
    print(summary(results, time.perf_counter() - started))
    return 0 if all(r["status"] == 200 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
