#!/usr/bin/env python3
"""Forward-pass calibration benchmark for Llama-architecture models.

Self-contained (needs only PyTorch).  It builds a minimal Llama decoder in
plain torch with random bf16 weights and times, on one GPU:

* ``decode``   one step of B sequences, each adding 1 token on top of a KV
               cache already holding C tokens (eager and CUDA-graph replay);
* ``prefill``  B sequences of L new tokens on top of P cached tokens
               (P = 0 is a plain prefill, P > 0 a chunked-prefill chunk);
* ``chain``    only the model's linear layers (all layers + LM head) for M
               tokens: the weight-streaming / GEMM part of a step, no
               attention, norms or elementwise work;
* ``gemm``     single bf16 GEMMs of the model's layer shapes;
* ``bandwidth`` device-to-device copy, read-only reduction and fill.

Every measurement is written immediately as one JSON line, so a run that is
cut short still leaves its data.  ``--assemble`` turns one or more JSON-lines
files into the single JSON document the perf model reads.

Examples::

    python3 calibrate.py --smoke                      # CPU, tiny model, seconds
    python3 calibrate.py --model llama3.1-8b --sections env,bandwidth,gemm,chain,decode,prefill \
        --budget-s 300 --out results.jsonl
    python3 calibrate.py --assemble a.jsonl b.jsonl --out h100-sxm-forward.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --assemble needs no torch
    torch = F = None

SCRIPT_VERSION = 1

# ---------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------

MODELS = {
    "llama3.1-8b": dict(
        num_layers=32,
        full_num_layers=32,
        hidden=4096,
        intermediate=14336,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    "llama2-7b": dict(
        num_layers=32,
        full_num_layers=32,
        hidden=4096,
        intermediate=11008,
        heads=32,
        kv_heads=32,
        head_dim=128,
        vocab=32000,
        rope_theta=10000.0,
        tie_embeddings=False,
    ),
    # Llama-3.1-70B shapes, truncated to 8 of its 80 decoder layers.  The
    # embedding and LM head are whole (they are per-model, not per-layer).
    "llama3.1-70b-8L": dict(
        num_layers=8,
        full_num_layers=80,
        hidden=8192,
        intermediate=28672,
        heads=64,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # Same shapes with fewer layers: the difference to the models above gives
    # the per-layer cost directly (embedding / LM head / launch are per-model).
    "llama3.1-70b-4L": dict(
        num_layers=4,
        full_num_layers=80,
        hidden=8192,
        intermediate=28672,
        heads=64,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    "llama3.1-8b-16L": dict(
        num_layers=16,
        full_num_layers=32,
        hidden=4096,
        intermediate=14336,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # For --smoke only.
    "tiny": dict(
        num_layers=2,
        full_num_layers=2,
        hidden=256,
        intermediate=512,
        heads=4,
        kv_heads=2,
        head_dim=64,
        vocab=1000,
        rope_theta=10000.0,
        tie_embeddings=False,
    ),
}

DTYPE = torch.bfloat16 if torch is not None else None
BYTES = 2  # bf16


def model_facts(cfg: dict) -> dict:
    """Parameter / byte / FLOP bookkeeping used by the analysis."""
    h, i, nh, kvh, d, v, nl = (
        cfg[k]
        for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "num_layers")
    )
    qkv = h * (nh + 2 * kvh) * d
    o = nh * d * h
    gate_up = h * 2 * i
    down = i * h
    per_layer_linear = qkv + o + gate_up + down
    per_layer_norm = 2 * h
    lm_head = v * h
    embed = v * h
    out = dict(cfg)
    out.update(
        params_per_layer=per_layer_linear + per_layer_norm,
        linear_params_per_layer=per_layer_linear,
        lm_head_params=lm_head,
        embedding_params=embed,
        total_params=nl * (per_layer_linear + per_layer_norm)
        + h
        + lm_head
        + (0 if cfg["tie_embeddings"] else embed),
        # bytes a decode step must stream from HBM for weights: every linear
        # layer + LM head + norms (the embedding is a gather of B rows).
        streamed_weight_bytes=BYTES * (nl * (per_layer_linear + per_layer_norm) + h + lm_head),
        kv_bytes_per_token=BYTES * 2 * nl * kvh * d,
        kv_bytes_per_token_per_layer=BYTES * 2 * kvh * d,
        # matmul FLOPs per token excluding attention score/value products
        linear_flops_per_token_per_layer=2 * per_layer_linear,
        lm_head_flops_per_token=2 * lm_head,
        # attention FLOPs per (query token, key token) pair per layer: QK^T + PV
        attn_flops_per_qk_pair_per_layer=4 * nh * d,
        layer_shapes=dict(  # (K, N) of y = x @ W^T with W [N, K]
            qkv=[h, (nh + 2 * kvh) * d],
            o_proj=[nh * d, h],
            gate_up=[h, 2 * i],
            down=[i, h],
            lm_head=[h, v],
        ),
    )
    return out


# ---------------------------------------------------------------------------
# Minimal Llama decoder (inference only)
# ---------------------------------------------------------------------------


class Llama:
    """Llama-architecture decoder with fused QKV and fused gate/up weights
    (the layout vLLM uses), RMSNorm, RoPE, GQA, SiLU-gated MLP.  Weights are
    random N(0, 0.02); norms are ones.  Attention runs FlashAttention-2 via
    ``aten._scaled_dot_product_flash_attention`` on CUDA (``attn="flash"``)
    or an explicit fp32 reference (``attn="math"``)."""

    def __init__(self, cfg: dict, device, max_pos: int, attn: str, seed: int = 0):
        self.cfg = cfg
        self.device = device
        self.attn = attn
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        h, i, nh, kvh, d = (
            cfg[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim")
        )

        def w(*shape):
            t = torch.empty(*shape, device=device, dtype=DTYPE)
            t.normal_(0.0, 0.02, generator=g)
            return t

        self.embed = w(cfg["vocab"], h)
        self.layers = []
        for _ in range(cfg["num_layers"]):
            self.layers.append(
                dict(
                    ln1=torch.ones(h, device=device, dtype=DTYPE),
                    wqkv=w((nh + 2 * kvh) * d, h),
                    wo=w(h, nh * d),
                    ln2=torch.ones(h, device=device, dtype=DTYPE),
                    wgu=w(2 * i, h),
                    wdown=w(h, i),
                )
            )
        self.norm = torch.ones(h, device=device, dtype=DTYPE)
        self.lm_head = self.embed if cfg["tie_embeddings"] else w(cfg["vocab"], h)
        # RoPE tables (plain rope; Llama-3.1's frequency rescaling only changes
        # the table values, not the cost).
        inv = 1.0 / (
            cfg["rope_theta"] ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        )
        pos = torch.arange(max_pos, device=device, dtype=torch.float32)
        ang = torch.outer(pos, inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos = ang.cos().to(DTYPE)
        self.sin = ang.sin().to(DTYPE)
        self.eps = 1e-5

    def new_cache(self, batch: int, seq: int, fill: bool = True):
        c = self.cfg
        shape = (c["num_layers"], batch, seq, c["kv_heads"], c["head_dim"])
        k = torch.empty(shape, device=self.device, dtype=DTYPE)
        v = torch.empty(shape, device=self.device, dtype=DTYPE)
        if fill:
            k.normal_()
            v.normal_()
        return k, v

    # -- attention -----------------------------------------------------------
    def _attention(self, q, k, v, causal: bool):
        """q [B, H, T, D]; k, v [B, KVH, S, D] (S >= T).  With causal=True the
        mask is aligned to the bottom-right (query t sits at position S-T+t)."""
        return attend(self.attn, q, k, v, causal)

    # -- forward ---------------------------------------------------------------
    def forward(self, ids, start: int, cache, all_logits: bool = False):
        """ids [B, T] new tokens at positions start..start+T-1; cache (k, v)
        of shape [layers, B, S, KVH, D] with S == start + T.  Returns logits
        [B, V] for the last token of every sequence (or [B, T, V])."""
        c = self.cfg
        B, T = ids.shape
        nh, kvh, d = c["heads"], c["kv_heads"], c["head_dim"]
        S = start + T
        ck, cv = cache
        x = F.embedding(ids, self.embed)  # [B, T, h]
        cos = self.cos[start:S].view(1, T, 1, d)
        sin = self.sin[start:S].view(1, T, 1, d)
        half = d // 2
        for li, L in enumerate(self.layers):
            hN = F.rms_norm(x, (c["hidden"],), L["ln1"], self.eps)
            qkv = F.linear(hN, L["wqkv"]).view(B, T, nh + 2 * kvh, d)
            qk = qkv[:, :, : nh + kvh]
            rot = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = torch.addcmul(qk * cos, rot, sin)  # RoPE on q and k together
            ck[li, :, start:S] = qk[:, :, nh:]
            cv[li, :, start:S] = qkv[:, :, nh + kvh :]
            q = qk[:, :, :nh].transpose(1, 2)  # [B, H, T, D]
            kk = ck[li].transpose(1, 2)  # [B, KVH, S, D]
            vv = cv[li].transpose(1, 2)
            a = self._attention(q, kk, vv, causal=T > 1)
            a = a.transpose(1, 2).reshape(B, T, nh * d)
            x = x + F.linear(a, L["wo"])
            hN = F.rms_norm(x, (c["hidden"],), L["ln2"], self.eps)
            gu = F.linear(hN, L["wgu"])
            gate, up = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, L["wdown"])
        if not all_logits:
            x = x[:, -1]
        x = F.rms_norm(x, (c["hidden"],), self.norm, self.eps)
        return F.linear(x, self.lm_head)

    def linear_weights(self):
        out = []
        for L in self.layers:
            out += [L["wqkv"], L["wo"], L["wgu"], L["wdown"]]
        out.append(self.lm_head)
        return out


def attend(impl: str, q, k, v, causal: bool):
    if impl == "flash":
        # FlashAttention-2 kernel; handles GQA natively and, for causal with
        # T < S, aligns the mask bottom-right (what a chunk on a prefix needs).
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[0]
    if impl == "sdpa":  # fallback: let SDPA choose the kernel
        from torch.nn.attention.bias import causal_lower_right

        T, S = q.shape[2], k.shape[2]
        if causal and T != S:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(T, S), enable_gqa=True
            )
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return attention_reference(q, k, v, causal).to(q.dtype)


def attention_reference(q, k, v, causal: bool):
    """fp32 reference: GQA by repeating KV heads, bottom-right causal mask."""
    B, H, T, D = q.shape
    S = k.shape[2]
    g = H // k.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k.to(ct).repeat_interleave(g, dim=1)
    vf = v.to(ct).repeat_interleave(g, dim=1)
    s = (q.to(ct) @ kf.transpose(-1, -2)) / math.sqrt(D)
    if causal:
        qpos = torch.arange(S - T, S, device=q.device).view(T, 1)
        kpos = torch.arange(S, device=q.device).view(1, S)
        s = s.masked_fill(kpos > qpos, float("-inf"))
    return torch.softmax(s, dim=-1) @ vf


def attend_varlen(impl: str, q, k, v, cu_q, cu_k, max_q: int, max_k: int, spans):
    """Packed variable-length attention, one call for all sequences (what
    vLLM's flash_attn_varlen_func does).  q [Nq, H, D], k, v [Nk, KVH, D];
    sequence i owns queries cu_q[i]:cu_q[i+1] and keys cu_k[i]:cu_k[i+1],
    causal mask bottom-right per sequence (a 1-query sequence sees all its
    keys).  ``spans`` is the same layout as host-side tuples, for the loop
    fallback used off CUDA."""
    if impl == "flash":
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False
        )[0]
    out = []
    for q0, q1, k0, k1 in spans:
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ks = k[k0:k1].transpose(0, 1).unsqueeze(0)
        vs = v[k0:k1].transpose(0, 1).unsqueeze(0)
        o = attend(impl, qs, ks, vs, causal=q1 - q0 > 1)
        out.append(o[0].transpose(0, 1).to(q.dtype))
    return torch.cat(out)


class MixedStep:
    """One engine iteration as vLLM's scheduler builds it with chunked prefill:
    decode sequences (1 new token each, grouped as ``groups`` = [(batch, cached
    context), ...]) plus at most one prompt chunk of L new tokens on P cached.

    All B + L tokens go through the embedding, norms, RoPE and the linear
    layers as ONE [B+L, hidden] activation (weights read once for the step);
    the LM head runs on the last token of every sequence (B + 1 rows).

    Attention layouts:
    * ``split``  one FlashAttention call per decode group (its own contiguous
      cache [layers, b, c+1, kvh, d], b queries of 1 token) and one for the
      chunk (cache [layers, 1, P+L, kvh, d], causal bottom-right);
    * ``varlen`` every sequence's KV packed in one buffer [layers, sum k, kvh,
      d] and ONE varlen FlashAttention call per layer for decode + chunk."""

    def __init__(self, model: Llama, groups, L: int, P: int, layout: str, fill: bool = True):
        self.m = model
        c = model.cfg
        dev = model.device
        self.groups = [(b, cc) for b, cc in groups if b > 0]
        self.B = sum(b for b, _ in self.groups)
        self.L, self.P, self.layout = L, P, layout
        N = self.B + L
        if N == 0:
            raise ValueError("empty step")
        self.N = N
        pos = []
        for b, cc in self.groups:
            pos += [cc] * b
        pos += list(range(P, P + L))
        self.pos = torch.tensor(pos, device=dev, dtype=torch.long)
        self.ids = torch.randint(0, c["vocab"], (N,), device=dev)
        # rows that produce logits: every decode token + the chunk's last token
        sel = list(range(self.B)) + ([N - 1] if L else [])
        self.sel = torch.tensor(sel, device=dev, dtype=torch.long)
        nl, kvh, d = c["num_layers"], c["kv_heads"], c["head_dim"]

        def buf(*shape):
            t = torch.empty(*shape, device=dev, dtype=DTYPE)
            if fill:
                t.normal_()
            return t

        if layout == "split":
            self.gk = [buf(nl, b, cc + 1, kvh, d) for b, cc in self.groups]
            self.gv = [buf(nl, b, cc + 1, kvh, d) for b, cc in self.groups]
            if L:
                self.ck = buf(nl, 1, P + L, kvh, d)
                self.cv = buf(nl, 1, P + L, kvh, d)
        elif layout == "varlen":
            spans, widx = [], []
            qo = ko = 0
            for b, cc in self.groups:
                for _ in range(b):
                    spans.append((qo, qo + 1, ko, ko + cc + 1))
                    widx.append(ko + cc)
                    qo += 1
                    ko += cc + 1
            if L:
                spans.append((qo, qo + L, ko, ko + P + L))
                widx += range(ko + P, ko + P + L)
                ko += P + L
            self.spans = spans
            self.widx = torch.tensor(widx, device=dev, dtype=torch.long)
            self.cu_q = torch.tensor(
                [s[0] for s in spans] + [spans[-1][1]], device=dev, dtype=torch.int32
            )
            self.cu_k = torch.tensor(
                [s[2] for s in spans] + [spans[-1][3]], device=dev, dtype=torch.int32
            )
            self.max_q = max(s[1] - s[0] for s in spans)
            self.max_k = max(s[3] - s[2] for s in spans)
            self.pk = buf(nl, ko, kvh, d)
            self.pv = buf(nl, ko, kvh, d)
        else:
            raise ValueError(layout)
        self.kv_tokens = sum(b * (cc + 1) for b, cc in self.groups) + (P + L if L else 0)

    def forward(self):
        m = self.m
        c = m.cfg
        N, L, P = self.N, self.L, self.P
        nh, kvh, d = c["heads"], c["kv_heads"], c["head_dim"]
        half = d // 2
        x = F.embedding(self.ids, m.embed)  # [N, h]
        cos = m.cos.index_select(0, self.pos).view(N, 1, d)
        sin = m.sin.index_select(0, self.pos).view(N, 1, d)
        for li, Ly in enumerate(m.layers):
            hN = F.rms_norm(x, (c["hidden"],), Ly["ln1"], m.eps)
            qkv = F.linear(hN, Ly["wqkv"]).view(N, nh + 2 * kvh, d)
            qk = qkv[:, : nh + kvh]
            rot = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = torch.addcmul(qk * cos, rot, sin)
            k_new, v_new, q = qk[:, nh:], qkv[:, nh + kvh :], qk[:, :nh]
            if self.layout == "varlen":
                self.pk[li].index_copy_(0, self.widx, k_new)
                self.pv[li].index_copy_(0, self.widx, v_new)
                a = attend_varlen(
                    m.attn,
                    q,
                    self.pk[li],
                    self.pv[li],
                    self.cu_q,
                    self.cu_k,
                    self.max_q,
                    self.max_k,
                    self.spans,
                ).reshape(N, nh * d)
            else:
                outs, off = [], 0
                for gi, (b, cc) in enumerate(self.groups):
                    kc, vc = self.gk[gi][li], self.gv[gi][li]  # [b, cc+1, kvh, d]
                    kc[:, cc] = k_new[off : off + b]
                    vc[:, cc] = v_new[off : off + b]
                    qg = q[off : off + b].view(b, 1, nh, d).transpose(1, 2)
                    o = attend(m.attn, qg, kc.transpose(1, 2), vc.transpose(1, 2), False)
                    outs.append(o.transpose(1, 2).reshape(b, nh * d))
                    off += b
                if L:
                    kc, vc = self.ck[li, 0], self.cv[li, 0]  # [P+L, kvh, d]
                    kc[P:] = k_new[off:]
                    vc[P:] = v_new[off:]
                    qc = q[off:].view(1, L, nh, d).transpose(1, 2)
                    o = attend(
                        m.attn,
                        qc,
                        kc.unsqueeze(0).transpose(1, 2),
                        vc.unsqueeze(0).transpose(1, 2),
                        L > 1,
                    )
                    outs.append(o.transpose(1, 2).reshape(L, nh * d))
                a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + F.linear(a, Ly["wo"])
            hN = F.rms_norm(x, (c["hidden"],), Ly["ln2"], m.eps)
            gu = F.linear(hN, Ly["wgu"])
            gate, up = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, Ly["wdown"])
        if L:  # LM head on B + 1 rows (decode tokens + the chunk's last token)
            x = x.index_select(0, self.sel)
        x = F.rms_norm(x, (c["hidden"],), m.norm, m.eps)
        return F.linear(x, m.lm_head)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn, warmup: int, target_s: float, min_rep: int, max_rep: int):
        """Run fn ``warmup`` times, then time ``n`` single calls, with n chosen
        so that the timed part takes about target_s (clamped).  Each call is
        timed on its own with CUDA events (or perf_counter on CPU)."""
        for _ in range(warmup):
            fn()
        self.sync()
        est = self._time_once(fn)
        n = int(max(min_rep, min(max_rep, target_s / max(est, 1e-6))))
        times = []
        if self.cuda:
            evs = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(n)
            ]
            for s, e in evs:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in evs]
        else:
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return dict(
            ms_p50=round(statistics.median(times), 5),
            ms_min=round(times[0], 5),
            ms_mean=round(statistics.fmean(times), 5),
            ms_p90=round(times[min(len(times) - 1, int(0.9 * len(times)))], 5),
            ms_max=round(times[-1], 5),
            repeats=n,
            warmup=warmup + 1,
        )

    def _time_once(self, fn):
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def capture_graph(fn, warmup: int = 2):
    """Capture fn into a CUDA graph (after warm-up on a side stream).
    Returns (graph, output-of-captured-call)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


class Sink:
    def __init__(self, path: str | None, tag: str = "primary"):
        self.path = path
        self.tag = tag
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, kind: str, row: dict):
        rec = {"kind": kind, **row, "run_tag": self.tag}
        line = json.dumps(rec, sort_keys=False)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()
        return rec


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gib(x):
    return round(x / 2**30, 3)


def peak_mem(device):
    if device.type == "cuda":
        return gib(torch.cuda.max_memory_allocated())
    return None


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def nvsmi(query: str):
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip()
    except Exception as e:
        return f"unavailable: {e}"


def section_env(args, device, sink):
    info = dict(
        script_version=SCRIPT_VERSION,
        argv=sys.argv,
        date_utc=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        device=str(device),
    )
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:
        info["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            gpu_name=p.name,
            capability=f"{p.major}.{p.minor}",
            sm_count=p.multi_processor_count,
            total_mem_gib=gib(p.total_memory),
            l2_cache_mb=round(getattr(p, "L2_cache_size", 0) / 1e6, 1),
            nvidia_smi=nvsmi(
                "name,driver_version,pstate,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
                "power.draw,power.limit,temperature.gpu,persistence_mode,compute_mode"
            ),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        )
    log("env: " + json.dumps(info))
    sink.write("env", info)
    return info


def section_attn_check(args, device, sink, attn):
    """Check the attention path used for timing against the fp32 reference,
    for decode (T=1), plain prefill and prefill on top of a prefix, GQA+MHA."""
    rows = []
    g = torch.Generator(device=device)
    g.manual_seed(1)
    for B, H, KVH, T, P in [
        (2, 8, 2, 1, 37),
        (2, 8, 8, 1, 37),
        (2, 8, 2, 45, 0),
        (2, 8, 2, 33, 70),
        (1, 8, 8, 33, 70),
    ]:
        D = 128 if device.type == "cuda" else 64
        S = P + T
        q = torch.randn(B, T, H, D, device=device, generator=g).to(DTYPE).transpose(1, 2)
        k = torch.randn(B, S, KVH, D, device=device, generator=g).to(DTYPE).transpose(1, 2)
        v = torch.randn(B, S, KVH, D, device=device, generator=g).to(DTYPE).transpose(1, 2)
        ref = attention_reference(q.double(), k.double(), v.double(), causal=T > 1)
        try:
            out = attend(attn, q, k, v, causal=T > 1)
        except Exception as e:
            log(f"attention impl {attn} failed: {e!r}")
            return False
        err = ((out.double() - ref).norm() / ref.norm()).item()
        row = dict(
            attn=attn,
            batch=B,
            heads=H,
            kv_heads=KVH,
            new_tokens=T,
            cached_tokens=P,
            rel_err=err,
            ok=bool(err < 2e-2),
        )
        rows.append(sink.write("check", row))
        log(f"attn check {row}")
    return all(r["ok"] for r in rows)


def section_model_check(model: Llama, device, sink):
    """Prefill of 2*n tokens vs prefill of n then n single decode steps:
    last-token logits must agree (KV-cache bookkeeping is right)."""
    B, n = 2, 6
    ids = torch.randint(0, model.cfg["vocab"], (B, 2 * n), device=device)
    full = model.forward(ids, 0, model.new_cache(B, 2 * n, fill=False), all_logits=True)
    ck, cv = model.new_cache(B, 2 * n, fill=False)
    # prefill the first n via a cache of exactly n, then grow by views
    sub = (ck[:, :, :n], cv[:, :, :n])
    model.forward(ids[:, :n], 0, sub)
    errs = []
    for t in range(n, 2 * n):
        step = (ck[:, :, : t + 1], cv[:, :, : t + 1])
        lg = model.forward(ids[:, t : t + 1], t, step)
        ref = full[:, t]
        errs.append(((lg.float() - ref.float()).norm() / ref.float().norm()).item())
    row = dict(
        model_check="prefill_vs_incremental_decode",
        max_rel_err=max(errs),
        finite=bool(torch.isfinite(full).all().item()),
        ok=bool(max(errs) < 5e-2),
    )
    sink.write("check", row)
    log(f"model check {row}")
    if not row["ok"]:
        # bf16 rounding differs between the M=B*T and M=B GEMMs; a real cache or
        # position bug gives O(1) errors.  Do not kill a device run over it.
        log("WARNING: model self-check above tolerance; see the check row")


def section_bandwidth(args, device, sink, timer, deadline):
    n_bytes = (args.bw_gib * 2**30) if device.type == "cuda" else 64 * 2**20
    n = n_bytes // BYTES
    a = torch.empty(n, device=device, dtype=DTYPE).normal_()
    b = torch.empty_like(a)
    tests = [
        ("d2d_copy", lambda: b.copy_(a), 2 * n_bytes, "bytes read + bytes written"),
        (
            "read_sum",
            lambda: a.sum(dtype=torch.float32),
            n_bytes,
            "bytes read (bf16 sum reduction)",
        ),
        ("write_fill", lambda: b.fill_(1.0), n_bytes, "bytes written"),
    ]
    for name, fn, nb, what in tests:
        if time.time() > deadline:
            break
        r = timer.measure(fn, warmup=3, target_s=0.5, min_rep=10, max_rep=100)
        row = dict(
            test=name,
            buffer_bytes=n_bytes,
            bytes_counted=nb,
            counting=what,
            gb_s_p50=round(nb / (r["ms_p50"] / 1e3) / 1e9, 1),
            gb_s_best=round(nb / (r["ms_min"] / 1e3) / 1e9, 1),
            **r,
        )
        sink.write("bandwidth", row)
        log(f"bandwidth {name}: {row['gb_s_p50']} GB/s (p50), {row['ms_p50']} ms")
    del a, b
    free(device)


def _graph_or_eager_loop(fns, device):
    """Returns a callable that runs all fns; on CUDA captured in one graph."""

    def run_all():
        out = None
        for f in fns:
            out = f()
        return out

    if device.type != "cuda":
        return run_all, None
    g, _ = capture_graph(run_all)
    return g.replay, g


def section_gemm(args, model_name, cfg, device, sink, timer, deadline):
    facts = model_facts(cfg)
    shapes = dict(facts["layer_shapes"])
    if device.type == "cuda":
        shapes["square_8192"] = [8192, 8192]
    l2 = 50 * 2**20
    for M in args.gemm_m:
        for name, (K, N) in shapes.items():
            if time.time() > deadline:
                sink.write(
                    "skip",
                    dict(section="gemm", model=model_name, op=name, m=M, reason="time_budget"),
                )
                continue
            mm = 8192 if name == "square_8192" else M
            if name == "square_8192" and args.gemm_m[-1] != M:
                continue
            wbytes = K * N * BYTES
            # rotate through enough weight copies that they cannot sit in L2
            copies = 1 if wbytes >= 4 * l2 else max(2, math.ceil(8 * l2 / wbytes))
            copies = min(copies, 64)
            ws = [
                torch.empty(N, K, device=device, dtype=DTYPE).normal_(0, 0.02)
                for _ in range(copies)
            ]
            x = torch.empty(mm, K, device=device, dtype=DTYPE).normal_()
            calls = max(copies, 4 if mm * N * K < 2**33 else 1)
            fns = [(lambda w=ws[j % copies]: F.linear(x, w)) for j in range(calls)]
            reset_peak(device)
            fn, g = _graph_or_eager_loop(fns, device)
            r = timer.measure(fn, warmup=2, target_s=0.25, min_rep=5, max_rep=200)
            per_call_ms = r["ms_p50"] / calls
            flops = 2 * mm * N * K
            nbytes = BYTES * (mm * K + N * K + mm * N)
            row = dict(
                model=model_name,
                op=name,
                m=mm,
                k=K,
                n=N,
                calls_per_timed_replay=calls,
                weight_copies=copies,
                cuda_graph=g is not None,
                ms_p50=round(per_call_ms, 5),
                ms_min=round(r["ms_min"] / calls, 5),
                tflops_p50=round(flops / (per_call_ms / 1e3) / 1e12, 2),
                gb_s_p50=round(nbytes / (per_call_ms / 1e3) / 1e9, 1),
                repeats=r["repeats"],
                flops=flops,
                min_bytes=nbytes,
            )
            sink.write("gemm", row)
            log(
                f"gemm {name} M={mm}: {row['ms_p50']:.4f} ms {row['tflops_p50']} TF/s {row['gb_s_p50']} GB/s"
            )
            del ws, x, fns, fn, g
            free(device)


def section_chain(args, model_name, model: Llama, device, sink, timer, deadline):
    """All linear layers of the model (+LM head) back-to-back for M tokens."""
    facts = model_facts(model.cfg)
    wl = model.linear_weights()
    h = model.cfg["hidden"]
    for M in args.chain_m:
        if time.time() > deadline:
            sink.write("skip", dict(section="chain", model=model_name, m=M, reason="time_budget"))
            continue
        xs = {}
        for w in wl:
            K = w.shape[1]
            if K not in xs:
                xs[K] = torch.empty(M, K, device=device, dtype=DTYPE).normal_()
        fns = [(lambda w=w: F.linear(xs[w.shape[1]], w)) for w in wl]
        reset_peak(device)
        fn, g = _graph_or_eager_loop(fns, device)
        r = timer.measure(fn, warmup=2, target_s=0.3, min_rep=5, max_rep=100)
        flops = sum(2 * M * w.shape[0] * w.shape[1] for w in wl)
        wbytes = sum(BYTES * w.numel() for w in wl)
        row = dict(
            model=model_name,
            m=M,
            cuda_graph=g is not None,
            n_gemms=len(wl),
            weight_bytes=wbytes,
            flops=flops,
            tflops_p50=round(flops / (r["ms_p50"] / 1e3) / 1e12, 2),
            weight_gb_s_p50=round(wbytes / (r["ms_p50"] / 1e3) / 1e9, 1),
            peak_mem_gib=peak_mem(device),
            **r,
        )
        sink.write("chain", row)
        log(
            f"chain {model_name} M={M}: {r['ms_p50']:.3f} ms, {row['tflops_p50']} TF/s, {row['weight_gb_s_p50']} GB/s"
        )
        del xs, fns, fn, g
        free(device)
    del h, facts


def section_decode(args, model_name, model: Llama, device, sink, timer, deadline):
    facts = model_facts(model.cfg)
    kvpt = facts["kv_bytes_per_token"]
    vocab = model.cfg["vocab"]
    for C in args.decode_contexts:
        for B in args.decode_batches:
            base = dict(model=model_name, batch=B, context=C, num_layers=model.cfg["num_layers"])
            kv_bytes = kvpt * B * (C + 1)
            if kv_bytes > args.kv_limit_gb * 1e9:
                sink.write(
                    "skip",
                    dict(
                        section="decode",
                        reason="kv_cache_over_limit",
                        kv_cache_gb=round(kv_bytes / 1e9, 2),
                        **base,
                    ),
                )
                continue
            if time.time() > deadline:
                sink.write("skip", dict(section="decode", reason="time_budget", **base))
                continue
            try:
                reset_peak(device)
                cache = model.new_cache(B, C + 1)
                ids = torch.randint(0, vocab, (B, 1), device=device)
                step = lambda: model.forward(ids, C, cache)  # noqa: E731
                modes = (
                    ["eager", "graph"] if device.type == "cuda" and not args.no_graph else ["eager"]
                )
                if args.no_eager and "graph" in modes:
                    modes = ["graph"]
                for mode in modes:
                    if mode == "graph":
                        g, _ = capture_graph(step)
                        fn = g.replay
                    else:
                        g, fn = None, step
                    r = timer.measure(
                        fn,
                        warmup=2,
                        target_s=args.target_s,
                        min_rep=args.min_rep,
                        max_rep=args.max_rep,
                    )
                    row = dict(
                        cuda_graph=mode == "graph",
                        **base,
                        **r,
                        kv_cache_gb=round(kv_bytes / 1e9, 3),
                        peak_mem_gib=peak_mem(device),
                    )
                    sink.write("decode", row)
                    log(
                        f"decode {model_name} B={B} C={C} {mode}: p50 {r['ms_p50']:.3f} ms min {r['ms_min']:.3f} "
                        f"n={r['repeats']} peak {row['peak_mem_gib']} GiB"
                    )
                    del g, fn
            except Exception as e:
                reason = "oom" if isinstance(e, torch.cuda.OutOfMemoryError) else "error"
                sink.write(
                    "skip", dict(section="decode", reason=reason, detail=repr(e)[:300], **base)
                )
                log(f"decode B={B} C={C}: {reason}: {e!r}"[:400])
            finally:
                cache = ids = step = None
                free(device)


def section_prefill(args, model_name, model: Llama, device, sink, timer, deadline):
    facts = model_facts(model.cfg)
    kvpt = facts["kv_bytes_per_token"]
    vocab = model.cfg["vocab"]
    points = []
    for L in args.prefill_lens:
        for B in args.prefill_batches:
            if args.max_prefill_tokens >= B * L:
                points.append((B, L, 0))
    for P in args.chunk_cached:
        if P == 0:
            continue
        for L in args.chunk_lens:
            for B in args.chunk_batches:
                if args.max_prefill_tokens >= B * L:
                    points.append((B, L, P))
    for B, L, P in points:
        base = dict(
            model=model_name,
            batch=B,
            new_tokens=L,
            cached_tokens=P,
            num_layers=model.cfg["num_layers"],
        )
        kv_bytes = kvpt * B * (P + L)
        if kv_bytes > args.kv_limit_gb * 1e9:
            sink.write("skip", dict(section="prefill", reason="kv_cache_over_limit", **base))
            continue
        if time.time() > deadline:
            sink.write("skip", dict(section="prefill", reason="time_budget", **base))
            continue
        try:
            reset_peak(device)
            cache = model.new_cache(B, P + L)
            ids = torch.randint(0, vocab, (B, L), device=device)
            step = lambda: model.forward(ids, P, cache)  # noqa: E731
            modes = ["eager"]
            if (
                device.type == "cuda"
                and not args.no_graph
                and args.prefill_graph_max_tokens >= B * L
            ):
                modes.append("graph")
            for mode in modes:
                if mode == "graph":
                    g, _ = capture_graph(step, warmup=1)
                    fn = g.replay
                else:
                    g, fn = None, step
                r = timer.measure(
                    fn,
                    warmup=1,
                    target_s=args.target_s,
                    min_rep=args.prefill_min_rep,
                    max_rep=args.max_rep,
                )
                row = dict(
                    cuda_graph=mode == "graph",
                    **base,
                    **r,
                    kv_cache_gb=round(kv_bytes / 1e9, 3),
                    peak_mem_gib=peak_mem(device),
                )
                sink.write("prefill", row)
                log(
                    f"prefill {model_name} B={B} L={L} P={P} {mode}: p50 {r['ms_p50']:.3f} ms "
                    f"min {r['ms_min']:.3f} n={r['repeats']} peak {row['peak_mem_gib']} GiB"
                )
                del g, fn
        except Exception as e:
            reason = "oom" if isinstance(e, torch.cuda.OutOfMemoryError) else "error"
            sink.write("skip", dict(section="prefill", reason=reason, detail=repr(e)[:300], **base))
            log(f"prefill B={B} L={L} P={P}: {reason}: {e!r}"[:400])
        finally:
            cache = ids = step = None
            free(device)


def _varlen_copy(ms: MixedStep) -> MixedStep:
    """A varlen-layout step holding the same ids and KV data as split-layout ``ms``."""
    vl = MixedStep(ms.m, ms.groups, ms.L, ms.P, "varlen", fill=False)
    vl.ids.copy_(ms.ids)
    ko = 0
    for gi, (b, cc) in enumerate(ms.groups):
        for j in range(b):
            vl.pk[:, ko : ko + cc + 1] = ms.gk[gi][:, j]
            vl.pv[:, ko : ko + cc + 1] = ms.gv[gi][:, j]
            ko += cc + 1
    if ms.L:
        vl.pk[:, ko:] = ms.ck[:, 0]
        vl.pv[:, ko:] = ms.cv[:, 0]
    return vl


def section_mixed_check(model: Llama, device, sink):
    """Mixed step (split layout) against separate Llama.forward calls for each
    decode group and the chunk on the same caches; varlen layout against split
    on copies of the same data, with a chunk and decode-only (two decode groups,
    so the packing order is exercised)."""
    groups, L, P = [(2, 9), (1, 20)], 7, 5
    ms = MixedStep(model, groups, L, P, "split")
    B = ms.B
    refs, off = [], 0
    for gi, (b, cc) in enumerate(ms.groups):
        ids = ms.ids[off : off + b].view(b, 1)
        refs.append(model.forward(ids, cc, (ms.gk[gi].clone(), ms.gv[gi].clone())))
        off += b
    refs.append(model.forward(ms.ids[B:].view(1, L), P, (ms.ck.clone(), ms.cv.clone())))
    ref = torch.cat(refs).float()
    vl = _varlen_copy(ms)
    dec = MixedStep(model, groups, 0, 0, "split")
    dvl = _varlen_copy(dec)
    out_split = ms.forward().float()
    out_dec = dec.forward().float()
    row = dict(
        model_check="mixed_step_vs_separate_forwards",
        groups=groups,
        chunk_tokens=L,
        chunk_cached=P,
        max_rel_err_split_vs_separate=((out_split - ref).norm() / ref.norm()).item(),
    )
    try:
        out_var = vl.forward().float()
        out_dvar = dvl.forward().float()
        row["max_rel_err_varlen_vs_split"] = max(
            ((out_var - out_split).norm() / out_split.norm()).item(),
            ((out_dvar - out_dec).norm() / out_dec.norm()).item(),
        )
        row["varlen_ok"] = bool(row["max_rel_err_varlen_vs_split"] < 2e-2)
    except Exception as e:
        row["varlen_error"] = repr(e)[:300]
        row["varlen_ok"] = False
    row["finite"] = bool(torch.isfinite(out_split).all().item())
    row["ok"] = bool(row["max_rel_err_split_vs_separate"] < 5e-2 and row["finite"])
    sink.write("check", row)
    log(f"mixed check {row}")
    if not row["ok"]:
        log("WARNING: mixed-step self-check above tolerance; see the check row")
    return row


def _time_step(step, args, device, timer, graph_ok: bool, eager_ok: bool, big: bool):
    """Yield (cuda_graph, timing) for the step function in the requested modes."""
    modes = []
    if device.type == "cuda" and not args.no_graph and graph_ok:
        modes.append("graph")
    if eager_ok or not modes:
        modes.append("eager")
    for mode in modes:
        if mode == "graph":
            g, _ = capture_graph(step, warmup=1 if big else 2)
            fn = g.replay
        else:
            g, fn = None, step
        r = timer.measure(
            fn,
            warmup=1 if big else 2,
            target_s=args.target_s,
            min_rep=args.prefill_min_rep if big else args.min_rep,
            max_rep=args.max_rep,
        )
        yield mode == "graph", r
        del g, fn


def mixed_points(args):
    """(B, C, L, P) points of the mixed grid, deduplicated: C is 0 when B = 0,
    P is 0 when L = 0.  L = 0 is decode only, B = 0 the chunk only."""
    pts, seen = [], set()
    cap = args.mixed_max_tokens
    for P in args.mixed_cached:
        for C in args.mixed_contexts:
            for B in args.mixed_batches:
                Ls = list(args.mixed_chunks)
                if cap and cap - B > max(Ls):
                    Ls.append(cap - B)
                for L in Ls:
                    key = (B, C if B else 0, L, P if L else 0)
                    if (B == 0 and L == 0) or (cap and cap < B + L) or key in seen:
                        continue
                    seen.add(key)
                    pts.append(key)
    return pts


def _mixed_row_facts(facts, B, C, L, P):
    nl = facts["num_layers"]
    pairs = B * (C + 1) + L * P + L * (L + 1) // 2
    return dict(
        tokens=B + L,
        logit_rows=B + (1 if L else 0),
        attn_pairs_per_layer=pairs,
        linear_flops=facts["linear_flops_per_token_per_layer"] * nl * (B + L)
        + facts["lm_head_flops_per_token"] * (B + (1 if L else 0)),
        attn_flops=facts["attn_flops_per_qk_pair_per_layer"] * nl * pairs,
    )


def section_mixed(args, model_name, model: Llama, device, sink, timer, deadline):
    """Mixed steps: B decode sequences at context C + one chunk of L tokens on P
    cached, linear layers once over B + L tokens.  Split layout (two flash calls
    per layer) on the whole grid, then the varlen layout on a subset."""
    facts = model_facts(model.cfg)
    kvpt = facts["kv_bytes_per_token"]
    plan = [(p, "split") for p in mixed_points(args)]
    plan += [
        (p, "varlen")
        for p in mixed_points(args)
        if p[1] in (0, *args.mixed_varlen_contexts) and p[2] in args.mixed_varlen_chunks
    ]
    for (B, C, L, P), layout in plan:
        base = dict(
            model=model_name,
            decode_seqs=B,
            decode_context=C,
            chunk_tokens=L,
            chunk_cached=P,
            attn_layout=layout,
            num_layers=model.cfg["num_layers"],
        )
        kv_bytes = kvpt * (B * (C + 1) + (P + L if L else 0))
        if layout == "varlen" and not getattr(args, "varlen_ok", True):
            sink.write("skip", dict(section="mixed", reason="varlen_check_failed", **base))
            continue
        if kv_bytes > args.kv_limit_gb * 1e9:
            sink.write("skip", dict(section="mixed", reason="kv_cache_over_limit", **base))
            continue
        if time.time() > deadline:
            sink.write("skip", dict(section="mixed", reason="time_budget", **base))
            continue
        try:
            reset_peak(device)
            ms = MixedStep(model, [(B, C)], L, P, layout)
            big = B + L > 1024
            eager = layout == "split" and not args.no_eager
            for graph, r in _time_step(ms.forward, args, device, timer, True, eager, big):
                row = dict(
                    cuda_graph=graph,
                    **base,
                    **r,
                    **_mixed_row_facts(facts, B, C, L, P),
                    kv_cache_gb=round(kv_bytes / 1e9, 3),
                    peak_mem_gib=peak_mem(device),
                )
                sink.write("mixed", row)
                log(
                    f"mixed {model_name} B={B} C={C} L={L} P={P} {layout} "
                    f"{'graph' if graph else 'eager'}: p50 {r['ms_p50']:.3f} ms min {r['ms_min']:.3f} n={r['repeats']}"
                )
        except Exception as e:
            reason = "oom" if isinstance(e, torch.cuda.OutOfMemoryError) else "error"
            sink.write("skip", dict(section="mixed", reason=reason, detail=repr(e)[:300], **base))
            log(f"mixed B={B} C={C} L={L} P={P} {layout}: {reason}: {e!r}"[:400])
        finally:
            ms = None
            free(device)


def nonuniform_variants(B: int, seed: int = 11):
    """Decode batches whose contexts differ, and the batches they are compared
    with.  Returns {distribution: (contexts, [(variant, groups, layout), ...])}."""
    import random

    rng = random.Random(seed + B)
    levels = [round(128 + i * (4096 - 128) / 7) for i in range(8)]
    hi = max(1, B // 16)
    dists = {
        # 8 context levels evenly spread over 128..4096, each sequence draws one
        "spread": [rng.choice(levels) for _ in range(B)],
        # mostly short sequences with a few long ones (padding is worst here)
        "skewed": [128] * (B - hi) + [4096] * hi,
    }
    out = {}
    for name, ctxs in dists.items():
        counts = {}
        for cc in ctxs:
            counts[cc] = counts.get(cc, 0) + 1
        groups = [(n, cc) for cc, n in sorted(counts.items())]
        mean = round(sum(ctxs) / B)
        out[name] = (
            ctxs,
            [
                ("varlen", groups, "varlen"),  # exact lengths, one packed call per layer
                ("grouped", groups, "split"),  # one batched call per distinct length
                ("padded", [(B, max(ctxs))], "split"),  # every sequence padded to the longest
                ("uniform_mean", [(B, mean)], "split"),  # same Σ context, all equal
                ("uniform_mean_varlen", [(B, mean)], "varlen"),
            ],
        )
    return out


def section_nonuniform(args, model_name, model: Llama, device, sink, timer, deadline):
    facts = model_facts(model.cfg)
    kvpt = facts["kv_bytes_per_token"]
    for B in args.nonuniform_batches:
        for dist, (ctxs, variants) in nonuniform_variants(B).items():
            for variant, groups, layout in variants:
                kv_tokens = sum(b * (cc + 1) for b, cc in groups)
                base = dict(
                    model=model_name,
                    decode_seqs=B,
                    distribution=dist,
                    variant=variant,
                    attn_layout=layout,
                    attn_calls_per_layer=1 if layout == "varlen" else len(groups),
                    contexts_sum=sum(ctxs),
                    contexts_mean=round(sum(ctxs) / B, 1),
                    contexts_min=min(ctxs),
                    contexts_max=max(ctxs),
                    context_groups=[[cc, b] for b, cc in groups],
                    kv_tokens_read=kv_tokens,
                )
                if layout == "varlen" and not getattr(args, "varlen_ok", True):
                    sink.write(
                        "skip", dict(section="nonuniform", reason="varlen_check_failed", **base)
                    )
                    continue
                if time.time() > deadline:
                    sink.write("skip", dict(section="nonuniform", reason="time_budget", **base))
                    continue
                try:
                    reset_peak(device)
                    ms = MixedStep(model, groups, 0, 0, layout)
                    for graph, r in _time_step(ms.forward, args, device, timer, True, False, False):
                        row = dict(
                            cuda_graph=graph,
                            **base,
                            **r,
                            kv_cache_gb=round(kvpt * kv_tokens / 1e9, 3),
                            peak_mem_gib=peak_mem(device),
                        )
                        sink.write("decode_nonuniform", row)
                        log(
                            f"nonuniform {model_name} B={B} {dist} {variant}: p50 {r['ms_p50']:.3f} ms "
                            f"(Σctx {sum(ctxs)}, read {kv_tokens} tokens, {base['attn_calls_per_layer']} calls/layer)"
                        )
                except Exception as e:
                    sink.write(
                        "skip",
                        dict(section="nonuniform", reason="error", detail=repr(e)[:300], **base),
                    )
                    log(f"nonuniform B={B} {dist} {variant}: {e!r}"[:400])
                finally:
                    ms = None
                    free(device)


def section_attn(args, model_name, cfg, device, sink, timer, deadline, attn):
    """The attention kernel alone, with this model's head shapes.
    prefill: one call on B x L new tokens over P+L keys (causal, bottom-right).
    decode: B queries over C+1 cached keys, looped over up to num_layers
    distinct per-layer caches in one CUDA graph (as in a real step, so small
    caches are not served from L2); time reported per layer."""
    H, KVH, D, nl = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["num_layers"]
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    for B, L, P in [
        (b, L, p)
        for p in args.attn_prefill_cached
        for L in args.attn_prefill_lens
        for b in args.attn_prefill_batches
    ]:
        base = dict(
            model=model_name,
            phase="prefill",
            batch=B,
            new_tokens=L,
            cached_tokens=P,
            heads=H,
            kv_heads=KVH,
            head_dim=D,
        )
        if time.time() > deadline:
            sink.write("skip", dict(section="attn", reason="time_budget", **base))
            continue
        try:
            q = torch.randn(B, L, H, D, device=device, generator=gen, dtype=DTYPE).transpose(1, 2)
            k = torch.randn(B, P + L, KVH, D, device=device, generator=gen, dtype=DTYPE).transpose(
                1, 2
            )
            v = torch.randn(B, P + L, KVH, D, device=device, generator=gen, dtype=DTYPE).transpose(
                1, 2
            )
            fn, g = _graph_or_eager_loop([lambda: attend(attn, q, k, v, True)], device)
            r = timer.measure(fn, warmup=2, target_s=0.2, min_rep=5, max_rep=50)
            flops = 4 * H * D * B * (L * P + L * (L + 1) // 2)
            row = dict(
                **base,
                cuda_graph=g is not None,
                layers_per_replay=1,
                flops=flops,
                tflops_p50=round(flops / (r["ms_p50"] / 1e3) / 1e12, 2),
                **r,
            )
            sink.write("attn", row)
            log(
                f"attn prefill {model_name} B={B} L={L} P={P}: {r['ms_p50']:.3f} ms {row['tflops_p50']} TF/s"
            )
        except Exception as e:
            sink.write("skip", dict(section="attn", reason="error", detail=repr(e)[:300], **base))
            log(f"attn prefill B={B} L={L} P={P}: {e!r}"[:300])
        finally:
            q = k = v = fn = g = None
            free(device)
    per_tok = 2 * KVH * D * BYTES  # K and V bytes per token per layer
    for C in args.decode_contexts:
        for B in args.attn_decode_batches:
            layers = int(min(nl, args.kv_limit_gb * 1e9 // (per_tok * B * (C + 1))))
            base = dict(
                model=model_name,
                phase="decode",
                batch=B,
                context=C,
                heads=H,
                kv_heads=KVH,
                head_dim=D,
            )
            if layers < 1 or time.time() > deadline:
                sink.write(
                    "skip",
                    dict(
                        section="attn",
                        reason="time_budget" if layers >= 1 else "kv_cache_over_limit",
                        **base,
                    ),
                )
                continue
            try:
                q = torch.randn(B, 1, H, D, device=device, generator=gen, dtype=DTYPE).transpose(
                    1, 2
                )
                kc = torch.empty(layers, B, C + 1, KVH, D, device=device, dtype=DTYPE).normal_()
                vc = torch.empty_like(kc).normal_()
                fns = [
                    (
                        lambda i=i: attend(
                            attn, q, kc[i].transpose(1, 2), vc[i].transpose(1, 2), False
                        )
                    )
                    for i in range(layers)
                ]
                fn, g = _graph_or_eager_loop(fns, device)
                r = timer.measure(fn, warmup=2, target_s=0.2, min_rep=5, max_rep=50)
                per = r["ms_p50"] / layers
                kv_bytes = per_tok * B * (C + 1)
                row = dict(
                    **base,
                    cuda_graph=g is not None,
                    layers_per_replay=layers,
                    ms_per_layer_p50=round(per, 5),
                    ms_per_layer_min=round(r["ms_min"] / layers, 5),
                    kv_bytes_per_layer=kv_bytes,
                    flops_per_layer=4 * H * D * B * (C + 1),
                    kv_gb_s_p50=round(kv_bytes / (per / 1e3) / 1e9, 1),
                    **r,
                )
                sink.write("attn", row)
                log(
                    f"attn decode {model_name} B={B} C={C}: {per * 1e3:.1f} us/layer ({layers} layers) "
                    f"{row['kv_gb_s_p50']} GB/s"
                )
            except Exception as e:
                sink.write(
                    "skip", dict(section="attn", reason="error", detail=repr(e)[:300], **base)
                )
                log(f"attn decode B={B} C={C}: {e!r}"[:300])
            finally:
                q = kc = vc = fns = fn = g = None
                free(device)


# ---------------------------------------------------------------------------
# Assemble JSON-lines into the calibration document
# ---------------------------------------------------------------------------

METHOD_TEXT = (
    "Minimal Llama decoder written in plain PyTorch (bench/gpu_calibration/calibrate.py), random "
    "N(0,0.02) bf16 weights, fused QKV and fused gate/up projections (vLLM layout), F.rms_norm, "
    "unfused RoPE (a few elementwise kernels), attention = FlashAttention-2 through "
    "aten._scaled_dot_product_flash_attention (GQA native, bottom-right causal mask for chunks), "
    "contiguous per-sequence KV cache [layers, B, S, kv_heads, head_dim] (not paged). "
    "Each point: KV cache filled with N(0,1) data, warm-up, then every repeat timed on its own "
    "with CUDA events; p50/min/mean/p90 over repeats (repeat count adapts so timed part takes "
    "~target seconds). Decode = one forward for B sequences x 1 new token with C cached tokens, "
    "including embedding, all layers, final norm and LM head for the B tokens; sampling is not "
    "included. Prefill = B sequences x L new tokens on top of P cached tokens, LM head on the last "
    "token of each sequence only. 'cuda_graph' true = the whole forward captured in one "
    "torch.cuda.CUDAGraph and replayed (as vLLM does for decode); false = eager PyTorch "
    "(includes Python/kernel-launch overhead). peak_mem_gib = torch.cuda.max_memory_allocated "
    "over the point (weights + KV cache + activations + graph pool). GEMM rows: one F.linear "
    "(cuBLAS) per call, several weight copies rotated so they do not sit in L2, calls replayed "
    "in a CUDA graph, time per call. Chain rows: all linear layers of the model + LM head back to "
    "back for M tokens in one CUDA graph (the weight-streaming/GEMM part of a step). Attn rows: the "
    "FlashAttention-2 call alone with the model's head shapes; prefill = one call (B x L queries over "
    "P+L keys, causal), decode = B single-token queries over C+1 keys, looped over up to num_layers "
    "distinct per-layer caches in one CUDA graph, time per layer. torch.inference_mode throughout. "
    "Rows under 'repeats' are second measurements of points in the main lists (run-to-run spread); "
    "do not fit on both without weighting. "
    "Mixed rows (chunked-prefill steps): one iteration with decode_seqs sequences decoding 1 token "
    "each at decode_context cached tokens plus one prompt chunk of chunk_tokens new tokens on "
    "chunk_cached cached tokens; embedding, norms, RoPE and all linear layers run ONCE over the "
    "concatenated decode_seqs + chunk_tokens tokens; attn_layout=split: per layer one "
    "FlashAttention-2 call for the decode batch (its own contiguous cache, 1 query over C+1 keys "
    "each) and one for the chunk (L queries over P+L keys, causal bottom-right), outputs "
    "concatenated; attn_layout=varlen: all sequences' KV packed in one buffer and one varlen "
    "FlashAttention-2 call per layer (aten._flash_attention_forward with cu_seqlens, as vLLM's "
    "flash_attn_varlen_func); LM head on decode_seqs + 1 rows. chunk_tokens=0 rows are decode-only "
    "and decode_seqs=0 rows chunk-only steps through the same code. decode_nonuniform rows: decode "
    "steps whose sequences have different contexts (context_groups = [context, count] pairs); "
    "variant varlen = one packed varlen call per layer over the exact lengths, grouped = one "
    "batched call per distinct length, padded = every sequence padded to the longest, "
    "uniform_mean(_varlen) = all sequences at the mean context (same total context)."
)


def assemble(paths, out_path):
    doc = {
        "meta": {},
        "models": {},
        "checks": [],
        "decode": [],
        "prefill": [],
        "chain": [],
        "attn": [],
        "gemm": [],
        "bandwidth": [],
        "mixed": [],
        "decode_nonuniform": [],
        "skipped": [],
    }
    envs, ends = [], []
    doc["repeats"] = {"decode": [], "prefill": [], "chain": [], "gemm": [], "bandwidth": []}
    for kind in ("mixed", "decode_nonuniform"):  # keep the document as before when absent
        if not any(kind in open(spec.partition("@")[0]).read() for spec in paths):
            del doc[kind]
    for spec in paths:
        # "path", "path@tag" (retag every row) or "path@tag:decode+prefill" (retag those kinds)
        p, _, override = spec.partition("@")
        tag_override, _, kinds = override.partition(":")
        kinds = set(kinds.split("+")) if kinds else None
        with open(p) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                if tag_override and (kinds is None or rec["kind"] in kinds):
                    rec["run_tag"] = tag_override
                kind = rec.pop("kind")
                if rec.get("run_tag", "primary") != "primary" and kind in doc["repeats"]:
                    doc["repeats"][kind].append(rec)
                    continue
                if kind == "env":
                    envs.append(rec)
                elif kind == "attn_impl":
                    doc["meta"].setdefault("attention_impls_used", []).append(rec["attn"])
                elif kind == "env_end":
                    ends.append(rec.get("nvidia_smi"))
                elif kind == "model":
                    doc["models"][rec["name"]] = rec["config"]
                elif kind == "check":
                    doc["checks"].append(rec)
                elif kind == "skip":
                    doc["skipped"].append(rec)
                elif kind in doc:
                    doc[kind].append(rec)
    e0 = envs[0] if envs else {}
    smi = e0.get("nvidia_smi", "")
    used = doc["meta"].get("attention_impls_used", [])
    doc["meta"] = dict(
        attention_impls_used=used,
        description="Measured forward-pass times of Llama-architecture models on one GPU, "
        "calibration data for gpufleet's analytical performance model.",
        gpu_name=e0.get("gpu_name"),
        driver=smi.split(",")[1].strip() if smi.count(",") >= 1 else None,
        nvidia_smi_at_start=[e.get("nvidia_smi") for e in envs],
        nvidia_smi_at_end=ends,
        sm_count=e0.get("sm_count"),
        gpu_mem_gib=e0.get("total_mem_gib"),
        torch=e0.get("torch"),
        cuda=e0.get("torch_cuda"),
        cudnn=e0.get("cudnn"),
        python=e0.get("python"),
        transformers_installed=e0.get("transformers"),
        transformers_used=False,
        date_utc=[e.get("date_utc") for e in envs],
        commands=[" ".join(e.get("argv", [])) for e in envs],
        dtype="bfloat16",
        weights="random N(0, 0.02)",
        attention_implementation="FlashAttention-2 (torch aten._scaled_dot_product_flash_attention), "
        "contiguous KV cache, no paged attention",
        gemm_implementation="torch F.linear -> cuBLAS (cublasLt) bf16, fp32 accumulate",
        cuda_graphs={
            "decode": "llama3.1-8b: both, rows with cuda_graph=true (whole step captured, as vLLM) and false "
            "(eager, includes Python launch overhead, noisy); other models: graph only",
            "prefill": "eager for all points; graph rows too where batch*new_tokens <= 1024",
            "chain": "yes",
            "attn": "yes",
            "gemm": "yes",
            "bandwidth": "no",
            "mixed": "llama3.1-8b: both, rows with cuda_graph=true (whole mixed step captured; shapes are "
            "static per point) and false (eager) for attn_layout=split; varlen rows graph only",
            "decode_nonuniform": "yes",
        },
        model_notes={
            "llama3.1-70b-8L": "Llama-3.1-70B shapes with 8 of 80 decoder layers; embedding and LM head "
            "are whole (per-model). Per-layer cost = (8L - 4L) / 4.",
            "llama3.1-70b-4L": "same shapes, 4 layers; only for differencing against 8L",
            "llama3.1-8b-16L": "Llama-3.1-8B shapes with 16 of 32 layers; per-layer cost = (32L - 16L) / 16",
        },
        method=METHOD_TEXT,
        units=dict(
            ms="milliseconds per call/step",
            gb="1e9 bytes",
            gib="2^30 bytes",
            tflops="1e12 FLOP/s",
            gb_s="1e9 bytes/s",
        ),
    )
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    size = os.path.getsize(out_path)
    print(
        f"wrote {out_path}: {size / 1e3:.0f} kB; decode {len(doc['decode'])}, prefill {len(doc['prefill'])}, "
        f"chain {len(doc['chain'])}, gemm {len(doc['gemm'])}, bandwidth {len(doc['bandwidth'])}, "
        f"skipped {len(doc['skipped'])}"
    )


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def guarded(fn, *a):
    """Run one section; an unexpected error ends that section, not the run."""
    try:
        fn(*a)
    except Exception as e:
        log(f"ERROR in {fn.__name__}: {e!r}"[:500])
        free(next(x for x in a if isinstance(x, torch.device)))


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS))
    ap.add_argument(
        "--sections",
        default="env,check,decode,prefill,chain,bandwidth,gemm",
        help="comma list of env,check,decode,prefill,chain,nonuniform,mixed,bandwidth,attn,gemm "
        "(run in this order)",
    )
    ap.add_argument("--out", default=None, help="JSON-lines output (appended)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="stop starting new points after this many seconds",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU (or --device), small grid"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--decode-batches", type=ints, default=ints("1,2,4,8,16,32,64,128,256"))
    ap.add_argument("--decode-contexts", type=ints, default=ints("128,512,1024,2048,4096,8192"))
    ap.add_argument("--prefill-lens", type=ints, default=ints("128,256,512,1024,2048,4096,8192"))
    ap.add_argument("--prefill-batches", type=ints, default=ints("1,2,4,8"))
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--chunk-lens", type=ints, default=ints("256,512,1024,2048,4096"))
    ap.add_argument("--chunk-cached", type=ints, default=ints("2048,8192"))
    ap.add_argument("--chunk-batches", type=ints, default=ints("1"))
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=1024)
    ap.add_argument("--gemm-m", type=ints, default=ints("1,8,32,128,512,2048,8192"))
    ap.add_argument(
        "--chain-m", type=ints, default=ints("1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192")
    )
    ap.add_argument("--attn-prefill-lens", type=ints, default=ints("512,1024,2048,4096,8192,16384"))
    ap.add_argument("--attn-prefill-batches", type=ints, default=ints("1"))
    ap.add_argument("--attn-prefill-cached", type=ints, default=ints("0,8192"))
    ap.add_argument("--attn-decode-batches", type=ints, default=ints("1,8,32,64,128,256"))
    ap.add_argument("--mixed-batches", type=ints, default=ints("0,16,64,128,256"))
    ap.add_argument("--mixed-contexts", type=ints, default=ints("2048,1024"))
    ap.add_argument(
        "--mixed-chunks",
        type=ints,
        default=ints("0,256,512,1024,2048,4096"),
        help="chunk lengths L of the mixed grid (0 = decode only)",
    )
    ap.add_argument("--mixed-cached", type=ints, default=ints("0,2048"))
    ap.add_argument(
        "--mixed-max-tokens",
        type=int,
        default=8192,
        help="token budget per step: adds L = budget - B and drops points with B + L over it",
    )
    ap.add_argument("--mixed-varlen-contexts", type=ints, default=ints("2048"))
    ap.add_argument("--mixed-varlen-chunks", type=ints, default=ints("0,512,2048"))
    ap.add_argument("--nonuniform-batches", type=ints, default=ints("64,128"))
    ap.add_argument("--kv-limit-gb", type=float, default=55.0)
    ap.add_argument("--bw-gib", type=int, default=4)
    ap.add_argument(
        "--target-s", type=float, default=0.25, help="timed seconds per point (sets repeats)"
    )
    ap.add_argument("--min-rep", type=int, default=10)
    ap.add_argument("--prefill-min-rep", type=int, default=5)
    ap.add_argument("--max-rep", type=int, default=40)
    ap.add_argument(
        "--tag",
        default="primary",
        help="run_tag stored in every row; --assemble files rows whose tag is not 'primary' "
        "under 'repeats' (repeat measurements for run-to-run spread)",
    )
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument(
        "--attn",
        choices=["flash", "sdpa", "math"],
        default=None,
        help="attention implementation (default: flash on CUDA, math on CPU)",
    )
    ap.add_argument("--no-eager", action="store_true", help="decode and mixed: graph mode only")
    ap.add_argument(
        "--assemble",
        nargs="+",
        metavar="JSONL[@TAG]",
        help="merge JSON-lines files into --out JSON; 'file@TAG' overrides the rows' run_tag, "
        "'file@TAG:decode+prefill' only for rows of those kinds",
    )
    args = ap.parse_args(argv)

    if args.assemble:
        assemble(args.assemble, args.out or "h100-sxm-forward.json")
        return

    if args.smoke:
        args.model = "tiny"
        args.decode_batches = [1, 4]
        args.decode_contexts = [16, 64]
        args.prefill_lens = [16, 64]
        args.prefill_batches = [1, 2]
        args.chunk_lens = [16]
        args.chunk_cached = [32]
        args.gemm_m = [1, 16]
        args.attn_prefill_lens = [16, 32]
        args.attn_prefill_cached = [0, 32]
        args.attn_decode_batches = [1, 4]
        args.chain_m = [1, 16]
        args.target_s = 0.01
        args.min_rep = 3
        args.prefill_min_rep = 3
        args.max_rep = 5
        args.max_prefill_tokens = 128
        args.mixed_batches = [0, 3]
        args.mixed_contexts = [24, 12]
        args.mixed_chunks = [0, 8, 16]
        args.mixed_cached = [0, 20]
        args.mixed_max_tokens = 24
        args.mixed_varlen_contexts = [24]
        args.mixed_varlen_chunks = [0, 16]
        args.nonuniform_batches = [16]
    device = torch.device(
        args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    )
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    attn = args.attn or ("flash" if device.type == "cuda" else "math")
    sink = Sink(args.out, args.tag)
    timer = Timer(device)
    t0 = time.time()
    deadline = t0 + args.budget_s
    sections = [s for s in args.sections.split(",") if s]
    cfg = MODELS[args.model]
    log(
        f"model {args.model} device {device} attn {attn} sections {sections} budget {args.budget_s}s"
    )

    with torch.inference_mode():
        if "env" in sections:
            section_env(args, device, sink)
        if "check" in sections:
            if not section_attn_check(args, device, sink, attn):
                if attn != "flash":
                    raise SystemExit("attention self-check failed")
                attn = "sdpa"
                log("falling back to attention via F.scaled_dot_product_attention")
                if not section_attn_check(args, device, sink, attn):
                    raise SystemExit("attention self-check failed")
            sink.write("attn_impl", dict(attn=attn))
        if device.type == "cuda":  # bring clocks up before the first timed point
            a = torch.randn(8192, 8192, device=device, dtype=DTYPE)
            t1 = time.time()
            while time.time() - t1 < 2.0:
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize()
            del a
            free(device)
        need_model = any(
            s in sections for s in ("chain", "decode", "prefill", "check", "mixed", "nonuniform")
        )
        if need_model:
            max_pos = max(
                [c + 1 for c in args.decode_contexts]
                + [L for L in args.prefill_lens]
                + [p + L for p in args.chunk_cached for L in args.chunk_lens]
                + [c + 1 for c in args.mixed_contexts]
                + [p + args.mixed_max_tokens for p in args.mixed_cached]
                + [p + L for p in args.mixed_cached for L in args.mixed_chunks]
                + [4097]  # nonuniform decode contexts reach 4096
                + [64]
            )
            tb = time.time()
            model = Llama(cfg, device, max_pos=max_pos, attn=attn)
            timer.sync()
            facts = model_facts(cfg)
            facts["attention_impl"] = attn
            sink.write("model", dict(name=args.model, config=facts))
            log(
                f"built {args.model} in {time.time() - tb:.1f}s: {facts['total_params'] / 1e9:.3f} B params, "
                f"streamed weights {facts['streamed_weight_bytes'] / 1e9:.2f} GB, "
                f"mem {gib(torch.cuda.memory_allocated()) if device.type == 'cuda' else '-'} GiB"
            )
            if "check" in sections:
                small = dict(cfg)
                small["num_layers"] = 2
                cm = Llama(small, device, max_pos=64, attn=attn, seed=3)
                for L in cm.layers:  # sharper attention so position/cache bugs show up
                    L["wqkv"].mul_(8.0)
                section_model_check(cm, device, sink)
                if "mixed" in sections or "nonuniform" in sections:
                    args.varlen_ok = section_mixed_check(cm, device, sink)["varlen_ok"]
                del cm
                free(device)
            if "decode" in sections:
                section_decode(args, args.model, model, device, sink, timer, deadline)
            if "prefill" in sections:
                section_prefill(args, args.model, model, device, sink, timer, deadline)
            if "chain" in sections:
                guarded(section_chain, args, args.model, model, device, sink, timer, deadline)
            if "nonuniform" in sections:
                guarded(section_nonuniform, args, args.model, model, device, sink, timer, deadline)
            if "mixed" in sections:
                guarded(section_mixed, args, args.model, model, device, sink, timer, deadline)
            del model
            free(device)
        if "bandwidth" in sections:
            guarded(section_bandwidth, args, device, sink, timer, deadline)
        if "attn" in sections:
            guarded(section_attn, args, args.model, cfg, device, sink, timer, deadline, attn)
        if "gemm" in sections:
            guarded(section_gemm, args, args.model, cfg, device, sink, timer, deadline)
        if device.type == "cuda":
            sink.write(
                "env_end",
                dict(
                    nvidia_smi=nvsmi(
                        "pstate,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                        "clocks_throttle_reasons.active"
                    )
                ),
            )
    log(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
