"""The GPU device check's report as markdown (bench.device writes it beside the JSON after every step)."""

from __future__ import annotations


# -- the tables --------------------------------------------------------------------------------------------------
def summary_lines(rec: dict) -> str:
    """The steps table and the verdict (what the device call's output ends with)."""
    lines = ["| step | status | s | summary |", "|---|---|---|---|"]
    for name, s in rec["steps"].items():
        status = s["status"] if s["status"] != "ok" or s.get("passed", True) else "FAILED"
        what = s.get("summary") or s.get("error") or s.get("why") or ""
        lines.append(f"| {name} | {status} | {s.get('seconds', '')} | {what} |")
    lines.append(f"\nverdict: {rec['verdict']}")
    return "\n".join(lines)


def markdown(rec: dict) -> str:
    env, m, plan = rec.get("env") or {}, rec["machine"], rec["plan"]
    b = env.get("build") or {}
    carried = env.get("carried") or {}
    out = [f"# GPU device check ({rec['mode']}{', quick' if rec['quick'] else ''}): {rec['verdict']}", "",
           f"- machine: {m['cpu'] or '?'}, {m['cores']} cores; GPU: {env.get('nvidia_smi') or 'none'}",
           f"- started {rec['started_at']}, budget {rec['budget_s']:.0f} s; Python {m['python']}",
           f"- llama-cpp-python: {b.get('state', '?')}" + (f" in {b['seconds']:.0f} s" if b.get("seconds") else "")
           + (f"; CMAKE_ARGS `{b['cmake_args']}`" if b.get("cmake_args") else ""),
           f"- demo shape: {plan['shape']['n_params'] / 1e9:.2f}B params ({plan['shape']['arch']}, dim "
           f"{plan['shape']['dim']}, {plan['shape']['layers']} layers, {plan['shape']['heads']}/"
           f"{plan['shape']['kv_heads']} heads, ffn {plan['shape']['ff']}, vocab {plan['shape']['vocab']})"]
    if carried:
        slim = carried.get("llama_cpp_python", {}).get("slim_bytes", 0)
        out.append(f"- carried: slimmed source {slim / 2**20:.1f} MiB, models "
                   + ", ".join(f"{k} {v['bytes'] / 2**20:.1f} MiB" for k, v in carried.get("models", {}).items()))
    out += ["", "## Steps", "", summary_lines(rec)]
    st = rec["steps"]
    calls_ = st.get("calls", {})
    if calls_.get("rows"):
        sizes = plan["sizes"]
        out += ["", f"## Call costs (ms per call, median of {plan['reps']}, every row's logits, after "
                    f"{plan['position']} positions, {calls_.get('threads')} threads)", "",
                "| model@where | type | " + " | ".join(f"{n} tok" for n in sizes) + " | prefill ms/token | c |",
                "|---|---|" + "---|" * (len(sizes) + 2)]
        for name, r in calls_["rows"].items():
            if "call_s" not in r:
                out.append(f"| {name} | {r.get('type', '')} | " + " | ".join("–" for _ in sizes)
                           + f" | {r.get('error', '')} | |")
                continue
            out.append(f"| {name} | {r['type']} | " + " | ".join(f"{1000 * r['call_s'][str(n)]:.2f}" for n in sizes)
                       + f" | {1000 * r['prefill_token_s']:.2f} | {calls_['c'].get(name, '')} |")
        out.append("\nc: a draft's 1-token call over the parent's 1-token call (the parent where it runs: the GPU "
                   "with CUDA).")
    for key in ("identity-cut", "identity-demo"):
        s = st.get(key, {})
        if not s.get("runs"):
            continue
        out += ["", f"## Greedy identity: {key.split('-')[1]} model (parent on the {s['parent_placement'].upper()}, "
                    f"{s['prompts']} prompts, noise bound {s['noise']['bound']:.3g})", "",
                "| drafter | γ | drafts on | identical | near-tie | unexplained | acceptance | s |",
                "|---|---|---|---|---|---|---|---|"]
        for r in s["runs"]:
            acceptance = r["acceptance"] if r["drafted"] else "– (none drafted)"
            out.append(f"| {r['drafter']} | {r['gamma']} | {r['drafts_on']} | {r['identical']}/{r['answers']} | "
                       f"{r['near_tie']} | {r['unexplained']} | {acceptance} | {r['seconds']} |")
    return "\n".join(out) + "\n"
