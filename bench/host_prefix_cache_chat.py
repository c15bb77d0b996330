#!/usr/bin/env python3
"""The host prefix cache on a multi-turn chat workload, measured through kvflow-server.

Eight conversations of four turns each, served round robin by one client through
/v1/chat/completions (streaming, greedy): each turn resends the conversation so far (a system
prompt of about a thousand tokens from WikiText-2, earlier questions and answers, a new Alpaca
instruction), so every turn but the first shares all of its conversation's previous prompt. The
device KV pool holds about two conversations: between two turns of one conversation the other
seven evict it from the device prefix cache. Three servers, each run `--repeats` times
(interleaved, so drift hits all three alike):

  device only    --enable-prefix-caching, the small pool: every later turn recomputes its history
  host tier      the same pool plus --host-prefix-cache: the evicted blocks come back from host memory
  all resident   a pool that holds every conversation: the device cache never evicts (the bound
                 the host tier can approach, its loads aside)

Measured: time to first token (TTFT) per request (turns 2..4 are the ones the cache can serve),
wall time and generated tokens per second for the whole workload, prompt tokens the server
computed, and the tier's counters from /metrics. Every reply must be identical across the three
servers (the tier is lossless), else the run fails.

  .venv/bin/python bench/host_prefix_cache_chat.py            # SmolLM2-135M on the CPU, ~6 min on 2 cores
  .venv/bin/python bench/host_prefix_cache_chat.py --quick    # a smaller workload, to try it

Writes bench/results/host_prefix_cache_chat.{json,md,png}.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "server"))
sys.path.insert(0, str(REPO / "bench"))
from conftest import ServerProcess, iter_sse  # noqa: E402
from provenance import provenance  # noqa: E402

RESULTS = REPO / "bench" / "results"
SHARED = REPO.parent / "shared" / "datasets"


def workload(num_conversations, num_turns, system_chars):
    """Each conversation's system prompt (a WikiText-2 passage) and its user turns (Alpaca)."""
    wiki = (SHARED / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in wiki.split("\n") if len(p.strip()) > 400 and not p.strip().startswith("=")]
    alpaca = json.loads((SHARED / "alpaca" / "alpaca_5000.json").read_text(encoding="utf-8"))
    questions = [a["instruction"] for a in alpaca if not a.get("input")][: num_conversations * num_turns]
    convs = []
    k = 0
    for c in range(num_conversations):
        text = ""
        while len(text) < system_chars:
            text += paragraphs[k % len(paragraphs)] + "\n"
            k += 1
        convs.append({"system": "Answer questions about this text.\n" + text[:system_chars],
                      "questions": questions[c * num_turns:(c + 1) * num_turns]})
    return convs


def chat_turn(srv, messages, max_tokens):
    """Streams one greedy chat completion; returns (reply text, TTFT seconds, total seconds, tokens)."""
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    host, port = srv.host, srv.port
    import http.client
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:400]!r}")
    ttft = None
    text = ""
    usage = None
    for event in iter_sse(resp):
        if event == "[DONE]":
            break
        chunk = json.loads(event)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            piece = choice.get("delta", {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text += piece
    conn.close()
    total = time.perf_counter() - start
    return text, ttft if ttft is not None else total, total, (usage or {}).get("completion_tokens", 0)


def run_condition(server_bin, name, flags, convs, num_turns, max_tokens):
    srv = ServerProcess(server_bin, ["--model", "smollm2-135m", *flags], name=name)
    srv.start(timeout=300)
    try:
        histories = [[{"role": "system", "content": c["system"]}] for c in convs]
        rows = []
        t0 = time.perf_counter()
        for turn in range(num_turns):
            for i, c in enumerate(convs):
                histories[i].append({"role": "user", "content": c["questions"][turn]})
                reply, ttft, total, tokens = chat_turn(srv, histories[i], max_tokens)
                histories[i].append({"role": "assistant", "content": reply})
                rows.append({"conversation": i, "turn": turn + 1, "ttft_s": ttft, "latency_s": total,
                             "completion_tokens": tokens, "reply": reply})
                print(f"  {name}: conversation {i} turn {turn + 1}: TTFT {ttft * 1000:.0f} ms", flush=True)
        wall = time.perf_counter() - t0
        m = srv.wait_idle(timeout=30)
        counters = {k: m.get(k, 0) for k in [
            "kvflow:prompt_tokens_total", "kvflow:generation_tokens_total", "kvflow:prefix_cache_hit_blocks_total",
            "kvflow:prefix_cache_queried_blocks_total", "kvflow:host_prefix_cache_hit_blocks_total",
            "kvflow:host_prefix_cache_queried_blocks_total", "kvflow:host_prefix_cache_saved_blocks_total",
            "kvflow:host_prefix_cache_bytes_loaded_total", "kvflow:host_prefix_cache_bytes_saved_total",
            "kvflow:host_prefix_cache_blocks_used", "kvflow:num_preemptions_total"]}
    finally:
        srv.stop()
    return {"rows": rows, "wall_s": wall, "metrics": counters}


def summarize(runs):
    later = [r["ttft_s"] for run in runs for r in run["rows"] if r["turn"] > 1]
    first = [r["ttft_s"] for run in runs for r in run["rows"] if r["turn"] == 1]
    walls = [run["wall_s"] for run in runs]
    gen = [sum(r["completion_tokens"] for r in run["rows"]) / run["wall_s"] for run in runs]
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    return {"ttft_later_turns_median_s": statistics.median(later), "ttft_later_turns_p90_s": q(later, 0.9),
            "ttft_first_turn_median_s": statistics.median(first), "wall_s_median": statistics.median(walls),
            "wall_s_runs": walls, "generated_tok_per_s_median": statistics.median(gen),
            "requests_per_s_median": statistics.median(len(run["rows"]) / run["wall_s"] for run in runs),
            "prompt_tokens_computed": runs[0]["metrics"]["kvflow:prompt_tokens_total"],
            "metrics_first_run": runs[0]["metrics"]}


def render(doc):
    """The Markdown table of a result document."""
    w, summary, ratios = doc["workload"], doc["summary"], doc["ratios"]
    lines = ["# Host prefix cache: multi-turn chat through kvflow-server", "",
             f"SmolLM2-135M-Instruct (Q4_1) on the CPU, {w['threads']} threads; {w['conversations']} conversations x "
             f"{w['turns']} turns served round robin, one request at a time; system prompts of ~{w['system_chars']} "
             f"characters, {w['max_tokens']} new tokens a turn, greedy. Device pool {w['device_blocks']} blocks of 16 "
             f"tokens (about two conversations); host tier {w['host_gib']} GiB; the bound: {w['resident_blocks']} "
             f"blocks, every conversation resident. Medians over {w['repeats']} runs of each server, interleaved. "
             "Replies identical across all servers and runs.", "",
             "| server | TTFT turns 2+ median (p90) | TTFT turn 1 | wall s (runs) | generated tok/s | prompt tokens computed | host blocks loaded | host MiB loaded |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        m = s["metrics_first_run"]
        lines.append(f"| {name} | {s['ttft_later_turns_median_s'] * 1000:.0f} ms ({s['ttft_later_turns_p90_s'] * 1000:.0f}) | "
                     f"{s['ttft_first_turn_median_s'] * 1000:.0f} ms | {s['wall_s_median']:.1f} "
                     f"({', '.join(f'{x:.1f}' for x in s['wall_s_runs'])}) | {s['generated_tok_per_s_median']:.1f} | "
                     f"{int(s['prompt_tokens_computed'])} | {int(m['kvflow:host_prefix_cache_hit_blocks_total'])} | "
                     f"{m['kvflow:host_prefix_cache_bytes_loaded_total'] / 2**20:.0f} |")
    first = [s["ttft_first_turn_median_s"] * 1000 for s in summary.values()]
    lines += ["", f"- TTFT of later turns, device only / host tier: **{ratios['ttft_later_turns_device_only_over_host_tier']:.2f}x**",
              f"- TTFT of later turns, host tier / all resident (the bound): {ratios['ttft_later_turns_host_tier_over_all_resident']:.2f}x",
              f"- Generated tokens per second, host tier / device only: **{ratios['throughput_host_tier_over_device_only']:.2f}x**; "
              f"host tier / all resident: {ratios['throughput_host_tier_over_all_resident']:.2f}x",
              f"- Run-to-run noise: turn 1 is the same work on every server (nothing cached yet) and its median TTFT "
              f"spans {min(first):.0f}-{max(first):.0f} ms ({max(first) / min(first):.2f}x) across them; differences "
              "of that size between the host tier and the bound are noise.",
              "", "All figures measured in this run; the JSON keeps every request's TTFT."]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=str(REPO / "build" / "kvflow-server"))
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-chars", type=int, default=4500, help="system prompt length (about 4.5 chars a token)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device-blocks", type=int, default=256, help="the small device pool, 16-token blocks")
    ap.add_argument("--resident-blocks", type=int, default=1536, help="a pool that holds every conversation")
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 conversations of 3 turns, 1 repeat")
    ap.add_argument("--out", default=str(RESULTS / "host_prefix_cache_chat"))
    ap.add_argument("--render", metavar="JSON", help="only re-render the table of a result file")
    a = ap.parse_args()
    if a.render:
        doc = json.loads(Path(a.render).read_text())
        Path(a.render).with_suffix(".md").write_text("\n".join(render(doc)) + "\n")
        return
    if a.quick:
        a.conversations, a.turns, a.repeats, a.device_blocks = 4, 3, 1, 128
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    common = ["--threads", str(a.threads), "--enable-prefix-caching", "--block-size", "16", "--max-model-len", "1920"]
    conditions = {
        "device only": common + ["--num-kv-blocks", str(a.device_blocks)],
        "host tier": common + ["--num-kv-blocks", str(a.device_blocks), "--host-prefix-cache", str(a.host_gib)],
        "all resident": common + ["--num-kv-blocks", str(a.resident_blocks)],
    }
    # The tree as the servers were started (edits made while it runs do not change the binaries).
    made_from = provenance(per_run_figures="runs.*[].rows")
    convs = workload(a.conversations, a.turns, a.system_chars)
    runs = {name: [] for name in conditions}
    for rep in range(a.repeats):
        for name, flags in conditions.items():
            print(f"== {name}, run {rep + 1}/{a.repeats}", flush=True)
            runs[name].append(run_condition(a.server, name, flags, convs, a.turns, a.max_tokens))
    # Lossless: every reply identical across servers and runs.
    reference = [r["reply"] for r in runs["device only"][0]["rows"]]
    for name, rs in runs.items():
        for k, run in enumerate(rs):
            got = [r["reply"] for r in run["rows"]]
            if got != reference:
                bad = next(i for i, (x, y) in enumerate(zip(got, reference)) if x != y)
                sys.exit(f"{name} run {k + 1}: reply {bad} differs from the device-only server's")
    summary = {name: summarize(rs) for name, rs in runs.items()}
    base, tier, bound = summary["device only"], summary["host tier"], summary["all resident"]
    ratios = {
        "ttft_later_turns_device_only_over_host_tier": base["ttft_later_turns_median_s"] / tier["ttft_later_turns_median_s"],
        "ttft_later_turns_host_tier_over_all_resident": tier["ttft_later_turns_median_s"] / bound["ttft_later_turns_median_s"],
        "throughput_host_tier_over_device_only": tier["generated_tok_per_s_median"] / base["generated_tok_per_s_median"],
        "throughput_host_tier_over_all_resident": tier["generated_tok_per_s_median"] / bound["generated_tok_per_s_median"],
    }
    doc = {"what": "host prefix cache on a multi-turn chat workload (kvflow-server, SmolLM2-135M-Instruct Q4_1, CPU)",
           "workload": {"conversations": a.conversations, "turns": a.turns, "system_chars": a.system_chars,
                        "max_tokens": a.max_tokens, "block_size": 16, "device_blocks": a.device_blocks,
                        "resident_blocks": a.resident_blocks, "host_gib": a.host_gib, "threads": a.threads,
                        "repeats": a.repeats},
           "conditions": {k: " ".join(v) for k, v in conditions.items()},
           "summary": summary, "ratios": ratios, "replies_identical": True,
           "runs": {name: [{"wall_s": r["wall_s"], "metrics": r["metrics"],
                            "rows": [{k: v for k, v in row.items() if k != "reply"} for row in r["rows"]]}
                           for r in rs] for name, rs in runs.items()},
           "provenance": made_from}
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = render(doc)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, rs in runs.items():
            per_turn = [statistics.median(r["ttft_s"] for run in rs for r in run["rows"] if r["turn"] == t) * 1000
                        for t in range(1, a.turns + 1)]
            ax.plot(range(1, a.turns + 1), per_turn, marker="o", label=name)
        ax.set_xlabel("turn")
        ax.set_ylabel("median TTFT, ms")
        ax.set_title("Multi-turn chat, SmolLM2-135M on the CPU")
        ax.set_xticks(range(1, a.turns + 1))
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
