"""Reading the runs' logs and reporting them (scripts/bench/benchmark.py): titanlike's and the peers' step lines,
the medians over the measured steps, float8 against bf16, the table."""
from __future__ import annotations

import re
import statistics

ANSI = re.compile(r"\x1b\[[0-9;]*m")
OURS = re.compile(r"step\s+(\d+)\s+loss\s+([-\d.naif]+).*?tok/s\s+([\d,]+)(?:.*?mfu\s+([\d.]+)%)?"
                  r"(?:.*?(?:mem|rss) ([\d.]+)GiB)?(?:.*?data ([\d.]+)%)?")
PEER = re.compile(r"step:\s*(\d+).*?loss:\s*([-\d.naif]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)"
                  r"(?:.*?tflops:\s*([\d.,]+))?.*?mfu:\s*([\d.]+)%")
PAIRS = re.compile(r"pairs/s\s+([\d,.]+)")  # titanlike's DPO step lines: preference pairs per second
PACK_FILL = re.compile(r"chat data \(train\): [\d,]+ conversations, ([\d,]+) tokens in ([\d,]+) rows of (\d+)")


def parse_ours(text: str) -> list[dict]:
    rows = []
    for m in OURS.finditer(ANSI.sub("", text)):
        rows.append({"step": int(m[1]), "loss": float(m[2]), "tps": float(m[3].replace(",", "")),
                     "mfu": float(m[4]) if m[4] else None, "mem": float(m[5]) if m[5] else None,
                     "data_pct": float(m[6]) if m[6] else None})  # the loop's wait for the loader, % of wall
        if (pairs := PAIRS.search(m[0])) is not None:  # (DPO: between the loss and tok/s)
            rows[-1]["pairs_s"] = float(pairs[1].replace(",", ""))
    return rows


def pack_fill(text: str) -> float | None:
    """The share of titanlike's packed SFT rows that holds conversation tokens (the rest is end-of-document padding,
    which its tok/s counts), from its start-up line; None when absent."""
    m = PACK_FILL.search(ANSI.sub("", text))
    if not m:
        return None
    tokens, rows, width = (int(g.replace(",", "")) for g in m.groups())
    return tokens / (rows * width) if rows else None


def parse_peer(text: str) -> list[dict]:
    return [{"step": int(m[1]), "loss": float(m[2]), "mem": float(m[3]), "tps": float(m[4].replace(",", "")),
             "tflops": float(m[5].replace(",", "")) if m[5] else None, "mfu": float(m[6])}
            for m in PEER.finditer(ANSI.sub("", text))]


def summarize(rows: list[dict], warmup: int, tokens_per_step: int, flops_per_token: float | None,
              pairs_per_step: int | None = None) -> dict:
    """Medians over the steps after `warmup`, the first step's time, and the step-time spread. pairs_per_step: a
    DPO peer's pairs in each step, for pairs per second from its step times (titanlike logs its own pairs/s)."""
    if not rows:
        return {}
    kept = [r for r in rows if r["step"] > warmup] or rows
    if pairs_per_step:
        kept = [{**r, "pairs_s": pairs_per_step * r["tps"] / tokens_per_step} for r in kept]
    out = {}
    for k in ("tps", "mfu", "mem", "tflops", "pairs_s", "data_pct"):
        vals = [r[k] for r in kept if r.get(k) is not None]
        if vals:
            out[k] = statistics.median(vals)
    if flops_per_token and "tps" in out:
        out["tflops"] = out["tps"] * flops_per_token / 1e12  # the same formula for both, over the same tokens
    step_s = [tokens_per_step / r["tps"] for r in kept if r["tps"] > 0]
    if step_s:
        med = statistics.median(step_s)
        out["step_ms"] = 1e3 * med
        out["step_ms_min"], out["step_ms_max"] = 1e3 * min(step_s), 1e3 * max(step_s)
        if len(step_s) >= 2:
            q = statistics.quantiles(step_s, n=10, method="inclusive")
            out["spread_pct"] = 100 * (q[-1] - q[0]) / med
    first = rows[0]
    if first["tps"] > 0:
        out["first_step_s"] = tokens_per_step / first["tps"]
    out.update(loss_first=first["loss"], loss_last=rows[-1]["loss"], steps_measured=len(kept),
               loss_curve=[[r["step"], r["loss"]] for r in rows])
    return out


def compare_to_bf16(results: list[dict]) -> list[str]:
    """For each float8 case with a bf16 twin (every other axis equal): how far its titanlike loss curve strays,
    relative to the bf16 loss at the same step (max over all steps; mean over the last 20 logged steps)."""
    lines = []
    for res in results:
        case = res["case"]
        if case["float8"] == "none":
            continue
        twin = next((r for r in results if r["case"] == {**case, "float8": "none"}), None)
        if twin is None:
            continue
        a = dict(map(tuple, twin.get("titanlike", {}).get("loss_curve", [])))
        b = dict(map(tuple, res.get("titanlike", {}).get("loss_curve", [])))
        rel = [abs(b[s] - a[s]) / abs(a[s]) for s in sorted(set(a) & set(b)) if a[s]]
        if rel:
            res["loss_vs_bf16"] = {"max_rel": max(rel), "last20_mean_rel": statistics.fmean(rel[-20:]),
                                   "steps": len(rel)}
            lines.append(f"{res['label']}: loss vs bf16 over {len(rel)} steps: max {100 * max(rel):.2f}%, "
                         f"last 20 mean {100 * statistics.fmean(rel[-20:]):.2f}%")
    return lines


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(results: list[dict]) -> str:
    head = (f"{'case':<44} {'who':<9} {'tok/s/dev':>10} {'pairs/s':>8} {'MFU%':>6} {'TFLOP/s':>8} {'mem GiB':>8} "
            f"{'1st s':>7} {'warm s':>7} {'step ms':>8} {'spread%':>8} {'data%':>6} {'loss first→last':>16} "
            f"{'ratio':>6}")
    lines = [head, "-" * len(head)]
    for res in results:
        for who in ("titanlike", "peer"):
            r = res.get(who)
            if r is None:
                continue
            ratio = res.get("ratio") if who == "titanlike" else None
            loss = f"{r['loss_first']:.3f}→{r['loss_last']:.3f}" if "loss_first" in r else "failed"
            case = res["label"] if who == "titanlike" or "titanlike" not in res else ""
            lines.append(f"{case:<44} {who:<9} {_fmt(r.get('tps'), ',.0f'):>10} "
                         f"{_fmt(r.get('pairs_s'), ',.2f'):>8} {_fmt(r.get('mfu'), '.1f'):>6} "
                         f"{_fmt(r.get('tflops'), '.4g'):>8} "
                         f"{_fmt(r.get('mem'), '.1f'):>8} {_fmt(r.get('first_step_s'), '.1f'):>7} "
                         f"{_fmt(r.get('first_step_warm_s'), '.1f'):>7} "
                         f"{_fmt(r.get('step_ms'), '.1f'):>8} {_fmt(r.get('spread_pct'), '.1f'):>8} "
                         f"{_fmt(r.get('data_pct'), '.1f'):>6} {loss:>16} "
                         f"{_fmt(ratio, '.3f'):>6}")
    return "\n".join(lines)
