"""A running stream's inter-token gaps while another request's long prompt is prefilled beside it, at one
--prefill-chunk value: serve --parallel 2 (policy parent) on the 1.5B family; stream A counts to 200; after its 15th
token B sends a ~1200-token prompt sharing nothing with A. Prints B's TTFT and A's gaps during B's prefill.

    for c in 512 128 64; do python scripts/bench_prefill_itl.py $c; done
"""

import sys
import threading
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402

from specquant_cli.bench.load import system_prompt  # noqa: E402

FAMILY = "models/qwen2.5-coder-1.5b"


def stream_a(c: openai.OpenAI, gaps: list, marks: dict) -> None:
    last = None
    s = c.chat.completions.create(model="x", max_tokens=160, temperature=0, stream=True, messages=[
        {"role": "user", "content": "Count from 1 to 200, one number per line."}])
    for ch in s:
        if ch.choices and ch.choices[0].delta.content:
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            last = now
            if len(gaps) == 15:
                marks["go"] = now


def stream_b(c: openai.OpenAI, marks: dict) -> None:
    while "go" not in marks:
        time.sleep(0.01)
    t0 = time.perf_counter()
    s = c.chat.completions.create(model="x", max_tokens=4, temperature=0, stream=True, messages=[
        {"role": "system", "content": "Unrelated preface. " + system_prompt(1200)},
        {"role": "user", "content": "Summarize rule 3."}])
    for ch in s:
        if ch.choices and ch.choices[0].delta.content and "b_first" not in marks:
            marks["b_first"] = time.perf_counter()
            marks["b_ttft"] = marks["b_first"] - t0


def main() -> None:
    chunk = sys.argv[1] if len(sys.argv) > 1 else "128"
    proc, url = bench_serve.launch([sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family", FAMILY,
                                    "--parallel", "2", "--policy", "parent", "--policies", "parent",
                                    "--prefill-chunk", chunk])
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x")
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        gaps, marks = [], {}
        threads = [threading.Thread(target=stream_a, args=(c, gaps, marks)),
                   threading.Thread(target=stream_b, args=(c, marks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        during = [g for t, g in gaps if marks["go"] < t <= marks["b_first"] + 0.5]
        before = [g for t, g in gaps if t <= marks["go"]]
        print(f"--prefill-chunk {chunk}: B's TTFT {marks['b_ttft']:.2f} s; A's gaps during B's prefill: "
              f"{len(during)}, max {max(during):.2f} s, mean {sum(during) / len(during):.3f} s; "
              f"before it: mean {sum(before) / len(before):.3f} s")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
