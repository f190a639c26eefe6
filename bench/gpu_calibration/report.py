#!/usr/bin/env python3
"""Tables and derived numbers from a calibration document (no torch needed).

    python3 report.py ../../src/gpufleet/perf/data/measured/h100-sxm-forward.json

Prints Markdown: the tables in docs/calibration/h100-forward-pass.md are this
script's output.  Datasheet peaks (for the "fraction" columns) default to the
H100 SXM figures in gpufleet's GPU catalog (989 dense bf16 TFLOP/s, 3350 GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics


def fmt(x, nd=2):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(rows_keys, cols_keys, cell, row_label, col_label):
    out = [
        "| "
        + row_label
        + " \\ "
        + col_label
        + " | "
        + " | ".join(str(c) for c in cols_keys)
        + " |",
        "|" + "---|" * (len(cols_keys) + 1),
    ]
    for r in rows_keys:
        out.append(f"| {r} | " + " | ".join(cell(r, c) for c in cols_keys) + " |")
    return "\n".join(out)


def lstsq(X, y):
    """Least squares via normal equations (small problems only)."""
    n = len(X[0])
    A = [[sum(x[i] * x[j] for x in X) for j in range(n)] for i in range(n)]
    b = [sum(x[i] * yy for x, yy in zip(X, y)) for i in range(n)]
    # Gauss-Jordan
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(A[r][i]))
        A[i], A[p] = A[p], A[i]
        b[i], b[p] = b[p], b[i]
        for r in range(n):
            if r != i:
                f = A[r][i] / A[i][i]
                A[r] = [a - f * c for a, c in zip(A[r], A[i])]
                b[r] -= f * b[i]
    return [b[i] / A[i][i] for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("doc")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--peak-gb-s", type=float, default=3350.0)
    a = ap.parse_args()
    d = json.load(open(a.doc))
    M = d["models"]
    P, BW = a.peak_tflops, a.peak_gb_s
    p = print

    meta = d["meta"]
    p(
        f"GPU {meta['gpu_name']}, driver {meta['driver']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
        f"{meta['sm_count']} SMs; runs {', '.join(meta['date_utc'][:1])} .. {meta['date_utc'][-1]}\n"
    )

    # -- bandwidth ------------------------------------------------------------
    p("### HBM bandwidth (4 GiB buffers)\n")
    p("| test | counted | GB/s p50 | GB/s best | fraction of datasheet |\n|---|---|---|---|---|")
    bw = {}
    for r in d["bandwidth"]:
        bw[r["test"]] = r["gb_s_p50"]
        p(
            f"| {r['test']} | {r['counting']} | {r['gb_s_p50']:.0f} | {r['gb_s_best']:.0f} | {r['gb_s_p50'] / BW:.2f} |"
        )
    read_bw = bw.get("read_sum")

    # -- gemm ------------------------------------------------------------------
    for model in ("llama3.1-8b", "llama3.1-70b-8L"):
        rows = [r for r in d["gemm"] if r["model"] == model and r["op"] != "square_8192"]
        if not rows:
            continue
        ms = sorted({r["m"] for r in rows})
        ops = [
            o
            for o in ("qkv", "o_proj", "gate_up", "down", "lm_head")
            if any(r["op"] == o for r in rows)
        ]
        g = {(r["op"], r["m"]): r for r in rows}
        p(f"\n### bf16 GEMM, {model} layer shapes: TFLOP/s (GB/s of minimum traffic)\n")
        p(
            table(
                ops,
                ms,
                lambda o, m: (
                    f"{g[(o, m)]['tflops_p50']:.0f} ({g[(o, m)]['gb_s_p50']:.0f})"
                    if (o, m) in g
                    else "–"
                ),
                "op (K→N)",
                "M tokens",
            )
        )
    sq = [r for r in d["gemm"] if r["op"] == "square_8192"]
    if sq:
        p(
            f"\n8192³ GEMM: {statistics.median(r['tflops_p50'] for r in sq):.0f} TFLOP/s "
            f"({statistics.median(r['tflops_p50'] for r in sq) / P:.2f} of {P:.0f})."
        )
    big = [r["tflops_p50"] for r in d["gemm"] if r["m"] >= 2048 and r["op"] != "square_8192"]
    gemm_big = statistics.median(big) if big else None

    # -- chain -----------------------------------------------------------------
    p("\n### All linear layers + LM head back to back (CUDA graph), by tokens M\n")
    cm = sorted({r["model"] for r in d["chain"]})
    ms = sorted({r["m"] for r in d["chain"]})
    c = {(r["model"], r["m"]): r for r in d["chain"]}
    p(
        table(
            ms,
            cm,
            lambda m, mo: (
                f"{c[(mo, m)]['ms_p50']:.2f} ms · {c[(mo, m)]['tflops_p50']:.0f} TF/s · "
                f"{c[(mo, m)]['weight_gb_s_p50']:.0f} GB/s"
                if (mo, m) in c
                else "–"
            ),
            "M",
            "model",
        )
    )

    # -- decode ----------------------------------------------------------------
    def dec(model, graph=True):
        return {
            (r["batch"], r["context"]): r
            for r in d["decode"]
            if r["model"] == model and r["cuda_graph"] == graph
        }

    for model in (
        "llama3.1-8b",
        "llama3.1-8b-16L",
        "llama2-7b",
        "llama3.1-70b-8L",
        "llama3.1-70b-4L",
    ):
        for graph in (True, False):
            t = dec(model, graph)
            if not t:
                continue
            bs = sorted({k[0] for k in t})
            cs = sorted({k[1] for k in t})
            p(
                f"\n### Decode step, {model}, {'CUDA graph' if graph else 'eager'}: ms p50 "
                f"(batch rows × context columns; – = KV cache over 55 GB or not run)\n"
            )
            p(
                table(
                    bs,
                    cs,
                    lambda b, cc: fmt(t[(b, cc)]["ms_p50"]) if (b, cc) in t else "–",
                    "batch",
                    "context",
                )
            )

    # -- prefill ---------------------------------------------------------------
    def pre_flops(mf, B, L, P0):
        lin = (
            mf["linear_flops_per_token_per_layer"] * mf["num_layers"] * B * L
            + mf["lm_head_flops_per_token"] * B
        )
        att = (
            mf["attn_flops_per_qk_pair_per_layer"]
            * mf["num_layers"]
            * B
            * (L * P0 + L * (L + 1) / 2)
        )
        return lin, att

    for model in ("llama3.1-8b", "llama2-7b", "llama3.1-70b-8L"):
        rows = [r for r in d["prefill"] if r["model"] == model and not r["cuda_graph"]]
        if not rows:
            continue
        mf = M[model]
        t = {(r["batch"], r["new_tokens"], r["cached_tokens"]): r for r in rows}
        Ls = sorted({k[1] for k in t if k[2] == 0})
        Bs = sorted({k[0] for k in t if k[2] == 0})

        def cell(L, B, t=t, mf=mf):
            r = t.get((B, L, 0))
            if not r:
                return "–"
            lin, att = pre_flops(mf, B, L, 0)
            return f"{r['ms_p50']:.1f} ({(lin + att) / (r['ms_p50'] / 1e3) / 1e12:.0f})"

        p(
            f"\n### Prefill, {model}, eager, no cached tokens: ms p50 (achieved TFLOP/s incl. attention)\n"
        )
        p(table(Ls, Bs, cell, "new tokens L", "batch B"))
        Ps = sorted({k[2] for k in t if k[2] > 0})
        if Ps:
            Lc = sorted({k[1] for k in t if k[2] > 0})

            def cellc(L, P0, t=t, mf=mf):
                r = t.get((1, L, P0))
                if not r:
                    return "–"
                lin, att = pre_flops(mf, 1, L, P0)
                return f"{r['ms_p50']:.1f} ({(lin + att) / (r['ms_p50'] / 1e3) / 1e12:.0f})"

            p(
                f"\n### Chunked prefill, {model}, batch 1: chunk of L new tokens on P cached: ms p50 (TFLOP/s)\n"
            )
            p(table(Lc, [0] + Ps, cellc, "chunk L", "cached P"))

    # -- attention -------------------------------------------------------------
    p("\n### FlashAttention-2 alone, prefill (batch 1): TFLOP/s (causal FLOPs)\n")
    ar = [r for r in d["attn"] if r["phase"] == "prefill"]
    keys = sorted({(r["model"], r["cached_tokens"]) for r in ar})
    Ls = sorted({r["new_tokens"] for r in ar})
    at = {(r["model"], r["cached_tokens"], r["new_tokens"]): r for r in ar}
    p(
        table(
            [f"{m} P={c}" for m, c in keys],
            Ls,
            lambda k, L: (
                fmt(at.get((k.split(" P=")[0], int(k.split(" P=")[1]), L), {}).get("tflops_p50"), 0)
                if (k.split(" P=")[0], int(k.split(" P=")[1]), L) in at
                else "–"
            ),
            "model, cached",
            "new tokens",
        )
    )
    for model in sorted({r["model"] for r in d["attn"]}):
        ad = {
            (r["batch"], r["context"]): r
            for r in d["attn"]
            if r["phase"] == "decode" and r["model"] == model
        }
        if not ad:
            continue
        bs = sorted({k[0] for k in ad})
        cs = sorted({k[1] for k in ad})
        p(f"\n### FlashAttention-2 alone, decode, {model}: µs per layer (KV GB/s)\n")
        p(
            table(
                bs,
                cs,
                lambda b, cc: (
                    f"{ad[(b, cc)]['ms_per_layer_p50'] * 1e3:.1f} ({ad[(b, cc)]['kv_gb_s_p50']:.0f})"
                    if (b, cc) in ad
                    else "–"
                ),
                "batch",
                "context",
            )
        )

    # -- derived ---------------------------------------------------------------
    p("\n### Derived numbers\n")
    m8 = M["llama3.1-8b"]
    t8 = dec("llama3.1-8b")
    te = dec("llama3.1-8b", graph=False)
    c8 = {r["m"]: r for r in d["chain"] if r["model"] == "llama3.1-8b"}
    w = m8["streamed_weight_bytes"]
    s1 = t8[(1, 128)]["ms_p50"]
    lines = []
    lines.append(
        f"- HBM: read {read_bw:.0f} GB/s, copy {bw.get('d2d_copy', 0):.0f} GB/s (read+write) = "
        f"{read_bw / BW:.2f} / {bw.get('d2d_copy', 0) / BW:.2f} of the {BW:.0f} GB/s datasheet."
    )
    if gemm_big:
        lines.append(
            f"- GEMM, M ≥ 2048, layer shapes: median {gemm_big:.0f} TFLOP/s = {gemm_big / P:.2f} of {P:.0f}."
        )
    lines.append(
        f"- Weight streaming, all 8B linears at M=1 (chain): {c8[1]['ms_p50']:.2f} ms for {w / 1e9:.2f} GB "
        f"= {c8[1]['weight_gb_s_p50']:.0f} GB/s ({c8[1]['weight_gb_s_p50'] / BW:.2f} of datasheet, "
        f"{c8[1]['weight_gb_s_p50'] / read_bw:.2f} of measured read)."
    )
    eff = (w + m8["kv_bytes_per_token"] * 129) / (s1 / 1e3) / 1e9
    lines.append(
        f"- Decode 8B B=1 C=128 (graph) {s1:.2f} ms: weights+KV / step = {eff:.0f} GB/s "
        f"({eff / BW:.2f} of datasheet). Eager: {te[(1, 128)]['ms_p50']:.2f} ms."
    )
    lines.append(
        f"- Fixed per-step overhead, 8B: step(B=1,C=128) − weights/measured-read-BW = "
        f"{s1 - w / (read_bw * 1e9) * 1e3:.2f} ms; step − chain(M=1) (all non-GEMM work) = {s1 - c8[1]['ms_p50']:.2f} ms."
    )
    t16 = dec("llama3.1-8b-16L")
    if (1, 128) in t16:
        per_layer = (s1 - t16[(1, 128)]["ms_p50"]) / 16
        fixed = s1 - 32 * per_layer
        lines.append(
            f"- Layer differencing (32L − 16L), B=1 C=128: {per_layer * 1e3:.1f} µs per layer, "
            f"{fixed:.2f} ms per step outside the layers (embedding, final norm, LM head "
            f"{m8['lm_head_params'] * 2 / 1e9:.2f} GB ≈ {m8['lm_head_params'] * 2 / (read_bw * 1e9) * 1e3:.2f} ms at read BW, graph launch)."
        )
        layer_bytes = m8["linear_params_per_layer"] * 2
        lines.append(
            f"  One layer streams {layer_bytes / 1e6:.0f} MB = {layer_bytes / (read_bw * 1e9) * 1e6:.1f} µs at read BW, "
            f"so ≈ {per_layer * 1e3 - layer_bytes / (read_bw * 1e9) * 1e6:.0f} µs per layer is non-GEMM / launch work "
            f"(≈ {(per_layer * 1e3 - layer_bytes / (read_bw * 1e9) * 1e6) * 32 / 1e3:.2f} ms per 32-layer step)."
        )
    t70, t70s = dec("llama3.1-70b-8L"), dec("llama3.1-70b-4L")
    if (1, 128) in t70 and (1, 128) in t70s:
        pl = (t70[(1, 128)]["ms_p50"] - t70s[(1, 128)]["ms_p50"]) / 4
        m70 = M["llama3.1-70b-8L"]
        lb = m70["linear_params_per_layer"] * 2
        lines.append(
            f"- 70B shapes, B=1 C=128: {pl:.3f} ms per layer ({lb / 1e9:.2f} GB of weights → "
            f"{lb / (pl / 1e3) / 1e9:.0f} GB/s); full 80-layer step ≈ "
            f"{t70[(1, 128)]['ms_p50'] + 72 * pl:.1f} ms on one GPU if it fitted "
            f"(8L step + 72 × per-layer)."
        )
    # decode fit: t = a + b*B + c*KVbytes
    for model in ("llama3.1-8b", "llama2-7b", "llama3.1-70b-8L"):
        t = dec(model)
        kvpt = M[model]["kv_bytes_per_token"]
        X, y, keys = [], [], []
        for (b, cc), r in t.items():
            X.append([1.0, b, b * (cc + 1) * kvpt / 1e9])
            y.append(r["ms_p50"])
            keys.append((b, cc))
        coef = lstsq(X, y)
        res = [abs(sum(ci * xi for ci, xi in zip(coef, x)) - yy) / yy for x, yy in zip(X, y)]
        worst = keys[res.index(max(res))]
        lines.append(
            f"- Linear fit of {model} graph decode, t = a + b·B + c·KV_GB: a = {coef[0]:.2f} ms, "
            f"b = {coef[1] * 1e3:.1f} µs/sequence, c = {coef[2]:.3f} ms/GB (→ {1e3 / coef[2]:.0f} GB/s for KV reads); "
            f"median |residual| {statistics.median(res) * 100:.1f} %, max {max(res) * 100:.1f} % at B,C={worst}."
        )
    # prefill TFLOP/s for 8B
    rows = {
        (r["batch"], r["new_tokens"], r["cached_tokens"]): r
        for r in d["prefill"]
        if r["model"] == "llama3.1-8b" and not r["cuda_graph"]
    }
    best = []
    for (B, L, P0), r in rows.items():
        lin, att = pre_flops(m8, B, L, P0)
        best.append(
            ((lin + att) / (r["ms_p50"] / 1e3) / 1e12, B, L, P0, lin / (r["ms_p50"] / 1e3) / 1e12)
        )
    best.sort(reverse=True)
    b0 = best[0]
    mid = [x for x in best if x[1] * x[2] >= 2048 and x[3] == 0]
    lines.append(
        f"- Prefill 8B achieved (linear+attention FLOPs / time): best {b0[0]:.0f} TFLOP/s "
        f"(B={b0[1]}, L={b0[2]}, P={b0[3]}); median over ≥2048-token prefills {statistics.median(x[0] for x in mid):.0f} "
        f"TFLOP/s = {statistics.median(x[0] for x in mid) / P:.2f} of peak."
    )
    ad = [r for r in d["attn"] if r["phase"] == "prefill" and r["new_tokens"] >= 4096]
    if ad:
        lines.append(
            f"- FlashAttention-2 prefill ≥4096 tokens: median {statistics.median(r['tflops_p50'] for r in ad):.0f} TFLOP/s "
            f"= {statistics.median(r['tflops_p50'] for r in ad) / P:.2f} of peak."
        )
    dd = [r for r in d["attn"] if r["phase"] == "decode" and r["batch"] * r["context"] >= 32 * 1024]
    if dd:
        lines.append(
            f"- FlashAttention-2 decode, B·C ≥ 32k: median KV read {statistics.median(r['kv_gb_s_p50'] for r in dd):.0f} GB/s "
            f"= {statistics.median(r['kv_gb_s_p50'] for r in dd) / BW:.2f} of datasheet."
        )
    # repeat spread
    rep = d.get("repeats", {}).get("decode", [])
    if rep:
        main = {
            (r["model"], r["batch"], r["context"], r["cuda_graph"]): r["ms_p50"]
            for r in d["decode"]
        }
        diffs = [
            abs(r["ms_p50"] / main[k] - 1) * 100
            for r in rep
            if (k := (r["model"], r["batch"], r["context"], r["cuda_graph"])) in main
        ]
        lines.append(
            f"- Run-to-run: {len(diffs)} graph-decode points measured twice: median |Δ| "
            f"{statistics.median(diffs):.2f} %, max {max(diffs):.2f} %."
        )
    for ln in lines:
        p(ln)
    p(
        "\nHeadline decode, llama3.1-8b graph: "
        + ", ".join(
            f"B={b}/C={cc}: {t8[(b, cc)]['ms_p50']:.2f} ms"
            for b, cc in [(1, 128), (64, 2048), (256, 1024)]
            if (b, cc) in t8
        )
    )
    if d.get("mixed") or d.get("decode_nonuniform"):
        p("")
        mixed_report(d, p)


def mixed_report(d, p):
    """Tables of the mixed prefill + decode steps and the non-uniform decode batches."""
    rows = [r for r in d.get("mixed", []) if r["model"] == "llama3.1-8b"]
    t = {
        (r["decode_seqs"], r["decode_context"], r["chunk_tokens"], r["chunk_cached"]): r["ms_p50"]
        for r in rows
        if r["attn_layout"] == "split" and r["cuda_graph"]
    }
    te = {
        (r["decode_seqs"], r["decode_context"], r["chunk_tokens"], r["chunk_cached"]): r["ms_p50"]
        for r in rows
        if r["attn_layout"] == "split" and not r["cuda_graph"]
    }
    tv = {
        (r["decode_seqs"], r["decode_context"], r["chunk_tokens"], r["chunk_cached"]): r["ms_p50"]
        for r in rows
        if r["attn_layout"] == "varlen" and r["cuda_graph"]
    }
    if t:
        Bs = sorted({k[0] for k in t})
        Cs = sorted({k[1] for k in t if k[0]}, reverse=True)
        Ps = sorted({k[3] for k in t if k[2]})
        Ls = sorted({k[2] for k in t if k[2] + k[0] < 8192 or k[0] == 0} - {8192})
        cap = 8192

        def key(B, C, L, P):
            return (B, C if B else 0, L, P if L else 0)

        for P in Ps:
            for C in Cs:
                p(
                    f"\n### Mixed step, llama3.1-8b, CUDA graph: ms p50 — B decode sequences at context {C} "
                    f"+ one chunk of L new tokens on P={P} cached (L=0: decode only; B=0: chunk only)\n"
                )

                def cell(B, L, C=C, P=P):
                    LL = cap - B if L == "8192−B" else L
                    k = key(B, C, LL, P)
                    return f"{t[k]:.2f}" if k in t else "–"

                p(table(Bs, [*Ls, "8192−B"], cell, "B", "L"))
        # batching saving: decode-only step + chunk-only step, measured separately, vs the mixed step
        p(
            "\n### Batching saving: (decode-only step + chunk-only step) − mixed step, ms "
            "(% of the separate sum); llama3.1-8b, CUDA graph\n"
        )
        out = [
            "| P | C | B | decode-only ms | " + " | ".join(f"L={L}" for L in Ls if L) + " |",
            "|" + "---|" * (4 + len([L for L in Ls if L])),
        ]
        savings = []
        for P in Ps:
            for C in Cs:
                for B in [b for b in Bs if b]:
                    dk = key(B, C, 0, 0)
                    if dk not in t:
                        continue
                    cells = []
                    for L in [x for x in Ls if x]:
                        mk, ck = key(B, C, L, P), key(0, 0, L, P)
                        if mk in t and ck in t:
                            sep = t[dk] + t[ck]
                            sv = sep - t[mk]
                            savings.append((B, C, L, P, sv, sv / sep, t[mk], sep))
                            cells.append(f"{sv:.1f} ({sv / sep * 100:.0f} %)")
                        else:
                            cells.append("–")
                    out.append(f"| {P} | {C} | {B} | {t[dk]:.2f} | " + " | ".join(cells) + " |")
        p("\n".join(out))
        p("")
        by_l = {}
        for _B, _C, L, _P, sv, fr, _, _ in savings:
            by_l.setdefault(L, []).append((sv, fr))
        for L in sorted(by_l):
            v = by_l[L]
            p(
                f"- L={L}: saving median {statistics.median(x[0] for x in v):.1f} ms "
                f"(range {min(x[0] for x in v):.1f} … {max(x[0] for x in v):.1f}), median "
                f"{statistics.median(x[1] for x in v) * 100:.0f} % of the separate sum"
            )
        for B, C, L, P in [(64, 2048, 2048, 0), (64, 2048, 256, 0), (128, 1024, 512, 2048)]:
            hit = [x for x in savings if x[:4] == (B, C, L, P)]
            if hit:
                x = hit[0]
                p(
                    f"- B={B}, C={C} decode + {L}-token chunk on P={P}: mixed {x[6]:.2f} ms vs separate "
                    f"{t[key(B, C, 0, 0)]:.2f} + {t[key(0, 0, L, P)]:.2f} = {x[7]:.2f} ms (saves {x[4]:.2f} ms, "
                    f"{x[5] * 100:.1f} %)"
                )
        # cost of a decode token inside a mixed step
        for C in Cs:
            for B in [b for b in Bs if b]:
                adds = [
                    t[key(B, C, L, P)] - t[key(0, 0, L, P)]
                    for P in Ps
                    for L in Ls
                    if L and key(B, C, L, P) in t and key(0, 0, L, P) in t
                ]
                if adds and key(B, C, 0, 0) in t:
                    p(
                        f"- B={B} at C={C}: adding the decode batch to a chunk costs median "
                        f"{statistics.median(adds):.2f} ms (range {min(adds):.2f} … {max(adds):.2f}) vs "
                        f"{t[key(B, C, 0, 0)]:.2f} ms as its own step"
                    )
        dec = {
            (r["batch"], r["context"]): r["ms_p50"]
            for r in d.get("decode", [])
            if r["model"] == "llama3.1-8b" and r["cuda_graph"]
        }
        cross = [
            abs(t[(B, C, 0, 0)] / dec[(B, C)] - 1) * 100
            for (B, C, L, P) in t
            if L == 0 and (B, C) in dec
        ]
        if cross:
            p(
                f"- Same-code cross-check: the {len(cross)} decode-only mixed points vs the decode table "
                f"(separate run): median |Δ| {statistics.median(cross):.2f} %, max {max(cross):.2f} %"
            )
        ratios = [te[k] / t[k] for k in t if k in te]
        big = [te[k] / t[k] for k in t if k in te and k[0] + k[2] >= 1024]
        if ratios:
            p(
                f"- Eager / graph (split layout, {len(ratios)} points): median {statistics.median(ratios):.3f}, "
                f"max {max(ratios):.2f}; for B + L ≥ 1024 median {statistics.median(big):.3f}"
            )
    if tv:
        p(
            "\n### One varlen FlashAttention call per layer vs two calls (split), llama3.1-8b, "
            "CUDA graph: ms p50\n"
        )
        p("| B | C | L | P | split | varlen | varlen / split |\n|---|---|---|---|---|---|---|")
        for k in sorted(tv, key=lambda k: (k[3], k[0], k[2])):
            if k in t:
                p(
                    f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {t[k]:.2f} | {tv[k]:.2f} | {tv[k] / t[k]:.2f} |"
                )
    nu = [r for r in d.get("decode_nonuniform", []) if r["model"] == "llama3.1-8b"]
    if nu:
        variants = ["uniform_mean", "uniform_mean_varlen", "grouped", "varlen", "padded"]
        p(
            "\n### Decode with unequal contexts vs the uniform batch with the same Σ context, "
            "llama3.1-8b, CUDA graph: ms p50 (attention calls per layer)\n"
        )
        p(
            "| B | distribution | Σ context (mean) | "
            + " | ".join(variants)
            + " |\n|"
            + "---|" * (3 + len(variants))
        )
        for B, dist in sorted({(r["decode_seqs"], r["distribution"]) for r in nu}):
            g = {r["variant"]: r for r in nu if r["decode_seqs"] == B and r["distribution"] == dist}
            r0 = next(iter(g.values()))
            cells = [
                f"{g[v]['ms_p50']:.2f} ({g[v]['attn_calls_per_layer']})" if v in g else "–"
                for v in variants
            ]
            p(
                f"| {B} | {dist} | {r0['contexts_sum']} ({r0['contexts_mean']:.0f}) | "
                + " | ".join(cells)
                + " |"
            )


if __name__ == "__main__":
    main()
