"""Flash-attention Triton kernels (forward, dk/dv, dq) for dense and packed layouts; imported lazily.

Scores live in the log2 domain (scale and ALiBi slopes are pre-multiplied by log2(e)) so the kernels use
exp2. A query row that sees no key keeps m = -inf and l = 0; it stores zeros and lse = +inf, so the backward
recomputes p = 0 for it and its gradients are exactly zero.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _keep_mask(seed, pid_bh, offs_m, offs_n, max_q, max_k, dropout_p):
    """Dropout keep-decision per (row, key); shared by the kernels and the test mask dump."""
    offs = (pid_bh * max_q + offs_m[:, None]) * max_k + offs_n[None, :]
    return tl.rand(seed, offs) >= dropout_p


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """Tile product with fp32 accumulation; IEEE keeps fp32 inputs out of TF32 when torch disallows it."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _visible(
    offs_m, offs_n, len_k, kpm_ptr, window_left, window_right,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
):  # fmt: skip
    """Boolean [M, N] tile: may query row i see key j (bounds, window/causal, key padding)."""
    ok = (offs_n[None, :] < len_k) & (offs_m[:, None] >= 0)
    if LIMIT_RIGHT:
        ok &= offs_n[None, :] <= offs_m[:, None] + window_right
    if LIMIT_LEFT:
        ok &= offs_n[None, :] >= offs_m[:, None] - window_left
    if HAS_KPM:
        kp = tl.load(kpm_ptr + offs_n, mask=offs_n < len_k, other=0)
        ok &= (kp != 0)[None, :]
    return ok


@triton.jit
def _partial_tile(
    m0, n0, len_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
):  # fmt: skip
    """Scalar: may some (row, key) of this tile be hidden? Interior tiles skip building the mask."""
    partial = n0 + BLOCK_N > len_k
    if LIMIT_RIGHT:
        partial = partial | (n0 + BLOCK_N - 1 > m0 + window_right)
    if LIMIT_LEFT:
        partial = partial | (n0 < m0 + BLOCK_M - 1 - window_left)
    if HAS_KPM:
        partial = n0 >= 0
    return partial


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, LSE, CU, KPM, SLOPES, SEED,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol, slb, slh, sll, skpb,
    len_q, len_k, n_heads, group, scale_log2, window_left, window_right, dropout_p, max_q, max_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // group
    start = 0
    lq = len_q
    lk = len_k
    if VARLEN:
        start = tl.load(CU + b)
        lq = tl.load(CU + b + 1) - start
        lk = lq
    m0 = pid_m * BLOCK_M
    if m0 >= lq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    rows_q = (start + offs_m).to(tl.int64)
    q = tl.load(
        Q + b * sqb + h * sqh + rows_q[:, None] * sql + offs_d[None, :],
        mask=(offs_m[:, None] < lq) & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    kpm_ptr = KPM + b * skpb
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    hi = lk
    if LIMIT_LEFT:
        lo = tl.maximum(m0 - window_left, 0) // BLOCK_N * BLOCK_N
    if LIMIT_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + window_right, lk)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows_k = (start + offs_n).to(tl.int64)
        kv_mask = (offs_n[:, None] < lk) & dmask[None, :]
        k = tl.load(k_base + rows_k[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows_k[:, None] * svl + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = _dot(q, tl.trans(k), IEEE)
        s = s * scale_log2
        if HAS_ALIBI:
            s -= slope * tl.abs(offs_m[:, None] - offs_n[None, :]).to(tl.float32)
        if _partial_tile(
            m0, n0, lk, window_left, window_right, BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT, HAS_KPM
        ):
            ok = _visible(
                offs_m, offs_n, lk, kpm_ptr, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT, HAS_KPM
            )
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = _keep_mask(seed, pid_bh, offs_m, offs_n, max_q, max_k, dropout_p)
            p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        acc += _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(
        Out + b * sob + h * soh + rows_q[:, None] * sol + offs_d[None, :],
        acc.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < lq) & dmask[None, :],
    )
    tl.store(LSE + b * slb + h * slh + rows_q * sll, lse, mask=offs_m < lq)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU, KPM, SLOPES, SEED,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdob, sdoh, sdol, slb, slh, sll,
    sdkb, sdkh, sdkl, sdvb, sdvh, sdvl, skpb,
    len_q, len_k, n_kv_heads, group, scale, scale_log2, window_left, window_right, dropout_p, max_q, max_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    start = 0
    lq = len_q
    lk = len_k
    if VARLEN:
        start = tl.load(CU + b)
        lq = tl.load(CU + b + 1) - start
        lk = lq
    n0 = pid_n * BLOCK_N
    if n0 >= lk:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    rows_k = (start + offs_n).to(tl.int64)
    kv_mask = (offs_n[:, None] < lk) & dmask[None, :]
    k = tl.load(K + b * skb + hk * skh + rows_k[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + rows_k[:, None] * svl + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kpm_ptr = KPM + b * skpb
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    hi = lq
    if LIMIT_RIGHT:
        lo = tl.maximum(n0 - window_right, 0) // BLOCK_M * BLOCK_M
    if LIMIT_LEFT:
        hi = tl.minimum(n0 + BLOCK_N + window_left, lq)
    # GQA: this program owns one kv head and sums the contributions of every query head in its group.
    for g in range(0, group):
        h = hk * group + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows_q = (start + offs_m).to(tl.int64)
            q_mask = (offs_m[:, None] < lq) & dmask[None, :]
            q = tl.load(
                Q + b * sqb + h * sqh + rows_q[:, None] * sql + offs_d[None, :], mask=q_mask, other=0.0
            )
            do = tl.load(
                DO + b * sdob + h * sdoh + rows_q[:, None] * sdol + offs_d[None, :], mask=q_mask, other=0.0
            )
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            row_mask = offs_m < lq
            lse = tl.load(LSE + b * slb + h * slh + rows_q * sll, mask=row_mask, other=float("inf"))
            delta = tl.load(DELTA + b * slb + h * slh + rows_q * sll, mask=row_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE)
            s = s * scale_log2
            if HAS_ALIBI:
                s -= slope * tl.abs(offs_m[:, None] - offs_n[None, :]).to(tl.float32)
            p = tl.exp2(s - lse[:, None])
            if _partial_tile(
                m0, n0, lk, window_left, window_right, BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT, HAS_KPM
            ):
                ok = _visible(
                    offs_m, offs_n, lk, kpm_ptr, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT, HAS_KPM
                )
                p = tl.where(ok, p, 0.0)
            dp = _dot(do, tl.trans(v), IEEE)
            pd = p
            if DROPOUT:
                keep = _keep_mask(seed, b * n_kv_heads * group + h, offs_m, offs_n, max_q, max_k, dropout_p)
                pd = tl.where(keep, p / (1.0 - dropout_p), 0.0)
                dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
            ds = p * (dp - delta[:, None])
            dv += _dot(tl.trans(pd.to(do.dtype)), do, IEEE)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    tl.store(
        DK + b * sdkb + hk * sdkh + rows_k[:, None] * sdkl + offs_d[None, :],
        (dk * scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b * sdvb + hk * sdvh + rows_k[:, None] * sdvl + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU, KPM, SLOPES, SEED,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdob, sdoh, sdol, slb, slh, sll, sdqb, sdqh, sdql, skpb,
    len_q, len_k, n_heads, group, scale, scale_log2, window_left, window_right, dropout_p, max_q, max_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // group
    start = 0
    lq = len_q
    lk = len_k
    if VARLEN:
        start = tl.load(CU + b)
        lq = tl.load(CU + b + 1) - start
        lk = lq
    m0 = pid_m * BLOCK_M
    if m0 >= lq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    rows_q = (start + offs_m).to(tl.int64)
    q_mask = (offs_m[:, None] < lq) & dmask[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows_q[:, None] * sql + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows_q[:, None] * sdol + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row_mask = offs_m < lq
    lse = tl.load(LSE + b * slb + h * slh + rows_q * sll, mask=row_mask, other=float("inf"))
    delta = tl.load(DELTA + b * slb + h * slh + rows_q * sll, mask=row_mask, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    kpm_ptr = KPM + b * skpb
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    hi = lk
    if LIMIT_LEFT:
        lo = tl.maximum(m0 - window_left, 0) // BLOCK_N * BLOCK_N
    if LIMIT_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + window_right, lk)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows_k = (start + offs_n).to(tl.int64)
        kv_mask = (offs_n[:, None] < lk) & dmask[None, :]
        k = tl.load(k_base + rows_k[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows_k[:, None] * svl + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = _dot(q, tl.trans(k), IEEE)
        dp = _dot(do, tl.trans(v), IEEE)
        s = s * scale_log2
        if HAS_ALIBI:
            s -= slope * tl.abs(offs_m[:, None] - offs_n[None, :]).to(tl.float32)
        p = tl.exp2(s - lse[:, None])
        if _partial_tile(
            m0, n0, lk, window_left, window_right, BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT, HAS_KPM
        ):
            ok = _visible(
                offs_m, offs_n, lk, kpm_ptr, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT, HAS_KPM
            )
            p = tl.where(ok, p, 0.0)
        if DROPOUT:
            keep = _keep_mask(seed, pid_bh, offs_m, offs_n, max_q, max_k, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(
        DQ + b * sdqb + h * sdqh + rows_q[:, None] * sdql + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit
def _keep_dump_kernel(OUT, SEED, n_q, n_k, max_q, max_k, dropout_p, BLOCK: tl.constexpr):
    pid_bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(SEED)
    for n0 in range(0, n_k, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        keep = _keep_mask(seed, pid_bh, offs_m, offs_n, max_q, max_k, dropout_p)
        ptr = OUT + pid_bh * n_q * n_k + offs_m[:, None] * n_k + offs_n[None, :]
        tl.store(ptr, keep.to(tl.int8), mask=(offs_m[:, None] < n_q) & (offs_n[None, :] < n_k))


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, read by triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_blocks(head_dim: int, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim; small tiles in the interpreter.

    Chosen so that ptxas (sm_90, bf16) reports no register spills for plain and causal inputs; not yet
    timed on a GPU, so these are starting points for autotuning, not tuned values.
    """
    if interpreting():
        return 16, 16, 1, 1
    if backward:
        return (64, 64, 8, 2) if head_dim <= 64 else (64, 32, 8, 2) if head_dim <= 128 else (32, 32, 8, 1)
    return (128, 64, 8, 3) if head_dim <= 64 else (128, 64, 8, 2) if head_dim <= 128 else (64, 32, 8, 1)


class Layout:
    """Strides and sizes that let one kernel read dense (B, H, L, D) and packed (T, H, D) tensors."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int):
        self.varlen = cu_seqlens is not None
        if self.varlen:
            self.batch = cu_seqlens.numel() - 1
            self.hq, self.hk = q.shape[1], k.shape[1]
            self.len_q = self.len_k = 0
            self.max_q = self.max_k = max_seqlen
        else:
            self.batch, self.hq, self.len_q = q.shape[0], q.shape[1], q.shape[2]
            self.hk, self.len_k = k.shape[1], k.shape[2]
            self.max_q, self.max_k = self.len_q, self.len_k
        self.group = self.hq // self.hk

    def strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, row) strides; packed tensors have no batch stride (rows start at cu_seqlens)."""
        if self.varlen:
            return 0, t.stride(1), t.stride(0)
        return t.stride(0), t.stride(1), t.stride(2)

    def new_lse(self, q: torch.Tensor) -> torch.Tensor:
        """fp32 log-sum-exp buffer: (B, Hq, Lq) dense, (Hq, T) packed."""
        if self.varlen:
            return torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
        return torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, row) strides of an lse-shaped buffer."""
        if self.varlen:
            return 0, lse.stride(0), lse.stride(1)
        return lse.stride(0), lse.stride(1), lse.stride(2)


def _flags(q, causal, window, key_padding_mask, alibi_slopes, dropout_p, layout) -> dict:
    limit_right = causal or window[1] >= 0
    return {
        "HEAD_DIM": q.shape[-1],
        "BLOCK_D": max(16, triton.next_power_of_2(q.shape[-1])),
        "VARLEN": layout.varlen,
        "LIMIT_LEFT": window[0] >= 0,
        "LIMIT_RIGHT": limit_right,
        "HAS_KPM": key_padding_mask is not None,
        "HAS_ALIBI": alibi_slopes is not None,
        "DROPOUT": dropout_p > 0.0,
        "UPCAST": interpreting() and q.dtype == torch.bfloat16,
        "IEEE": q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32,
    }


def _right(causal: bool, window: tuple[int, int]) -> int:
    return 0 if causal else max(window[1], 0)


def _aux(q, cu_seqlens, key_padding_mask, alibi_slopes, seed):
    """Placeholder pointers for absent optional inputs (never read: their constexpr flag is off)."""
    dummy = q
    kpm = dummy if key_padding_mask is None else key_padding_mask.view(torch.int8)
    return (
        dummy if cu_seqlens is None else cu_seqlens,
        kpm,
        dummy if alibi_slopes is None else alibi_slopes,
        dummy if seed is None else seed,
        0 if key_padding_mask is None else key_padding_mask.stride(0),
    )


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    window: tuple[int, int],
    scale: float,
    dropout_p: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel; returns (out, lse) with lse in log2 units (+inf for rows that see no key)."""
    layout = Layout(q, k, cu_seqlens, max_seqlen)
    bm, bn, warps, stages = default_blocks(q.shape[-1], backward=False)
    if blocks is not None:
        bm, bn = blocks
    # Packed tokens past cu_seqlens[-1] belong to no sequence; zeros there rather than stale memory.
    out = torch.zeros_like(q) if layout.varlen else torch.empty_like(q)
    lse = layout.new_lse(q)
    cu, kpm, slopes, seed_t, skpb = _aux(q, cu_seqlens, key_padding_mask, alibi_slopes, seed)
    grid = (triton.cdiv(layout.max_q, bm), layout.batch * layout.hq)
    extra = {} if interpreting() else {"num_warps": warps, "num_stages": stages}
    _fwd_kernel[grid](
        q, k, v, out, lse, cu, kpm, slopes, seed_t,
        *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(out),
        *layout.lse_strides(lse), skpb,
        layout.len_q, layout.len_k, layout.hq, layout.group, scale * LOG2E, window[0], _right(causal, window),
        dropout_p, layout.max_q, layout.max_k,
        BLOCK_M=bm, BLOCK_N=bn,
        **_flags(q, causal, window, key_padding_mask, alibi_slopes, dropout_p, layout), **extra,
    )  # fmt: skip
    return out, lse


def flash_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    window: tuple[int, int],
    scale: float,
    dropout_p: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the dk/dv and dq kernels; returns (dq, dk, dv) in the dtypes and layouts of q, k, v."""
    layout = Layout(q, k, cu_seqlens, max_seqlen)
    bm, bn, warps, stages = default_blocks(q.shape[-1], backward=True)
    if blocks is not None:
        bm, bn = blocks
    do = do if do.stride(-1) == 1 else do.contiguous()
    # delta_i = sum_d dO * O equals sum_j P_ij dP_ij (dropout included), the softmax-backward row term.
    delta = (do.float() * out.float()).sum(-1)
    delta = delta.t().contiguous() if layout.varlen else delta.contiguous()
    lse = lse.contiguous()
    new = torch.zeros_like if layout.varlen else torch.empty_like
    dq, dk, dv = new(q), new(k), new(v)
    cu, kpm, slopes, seed_t, skpb = _aux(q, cu_seqlens, key_padding_mask, alibi_slopes, seed)
    flags = _flags(q, causal, window, key_padding_mask, alibi_slopes, dropout_p, layout)
    extra = {} if interpreting() else {"num_warps": warps, "num_stages": stages}
    common = (
        layout.len_q, layout.len_k,
    )  # fmt: skip
    right = _right(causal, window)
    _bwd_dkdv_kernel[(triton.cdiv(layout.max_k, bn), layout.batch * layout.hk)](
        q, k, v, do, lse, delta, dk, dv, cu, kpm, slopes, seed_t,
        *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(do),
        *layout.lse_strides(lse), *layout.strides(dk), *layout.strides(dv), skpb,
        *common, layout.hk, layout.group, scale, scale * LOG2E, window[0], right, dropout_p,
        layout.max_q, layout.max_k,
        BLOCK_M=bm, BLOCK_N=bn, **flags, **extra,
    )  # fmt: skip
    _bwd_dq_kernel[(triton.cdiv(layout.max_q, bm), layout.batch * layout.hq)](
        q, k, v, do, lse, delta, dq, cu, kpm, slopes, seed_t,
        *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(do),
        *layout.lse_strides(lse), *layout.strides(dq), skpb,
        *common, layout.hq, layout.group, scale, scale * LOG2E, window[0], right, dropout_p,
        layout.max_q, layout.max_k,
        BLOCK_M=bm, BLOCK_N=bn, **flags, **extra,
    )  # fmt: skip
    return dq, dk, dv


def dropout_keep_mask(
    seed: torch.Tensor, batch_heads: int, max_q: int, max_k: int, dropout_p: float
) -> torch.Tensor:
    """The kernels' dropout keep mask as bool (batch*Hq, max_q, max_k), so tests can replay it exactly."""
    out = torch.empty(batch_heads, max_q, max_k, dtype=torch.int8, device=seed.device)
    block = 16
    _keep_dump_kernel[(triton.cdiv(max_q, block), batch_heads)](
        out, seed, max_q, max_k, max_q, max_k, dropout_p, BLOCK=block
    )
    return out.bool()


__all__ = ["dropout_keep_mask", "flash_backward", "flash_forward", "interpreting"]
