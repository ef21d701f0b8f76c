/* SHRINK and EXPAND of the batched multi-LoRA ops on CPU, float32.
 *
 * The same semantics as the Triton kernels (engine_client/kernels/triton_ops.py), loop for loop:
 *
 *   SHRINK: for each group g with slot s = slots[g] >= 0, A = a[s] (or a[s, experts[g]]):
 *           h_row(g, t)[:r] = scaling[s] * (A @ x_row(g, t))     for t < lens[g]
 *   EXPAND: y_row(g, t) += B @ h_row(g, t)[:r],  B = b[s] (or b[s, experts[g]])
 *   (h is laid out like x and y, with r features: its size is bounded by the activations)
 *
 * Every tensor is passed as a base pointer and its strides in elements, so slot pools are
 * read in place (a group's weights are one [r, in] / [out, r] block at slot * stride).
 * Why a C loop and not torch.bmm: a group is a few tokens (8 in an MoE prefill, 1 in a decode)
 * against a rank-8 weight, shapes where BLAS spends more on setup than on arithmetic, and
 * torch can batch only groups of equal length with weights one stride apart. Here a group
 * costs its weights' bytes: the [r, in] block stays in L1 while the group's tokens stream past.
 *
 * How: SHRINK takes tokens two at a time against blocks of 8 weight rows (16 independent
 * sums, folded by a shuffle tree at the end, not by 16 serial horizontal sums). EXPAND wants
 * B with unit stride over out: B as stored ([out, r], PEFT's and the device pool's layout) is
 * transposed once per group by 16 x 8 shuffle blocks; a group of 4 or more tokens then holds 32 columns
 * of those 8 rows in registers while its tokens stream past (each y element read and written once),
 * shorter ones take two tokens x 64 outputs x 8 ranks per step; a one-token group (decode) skips the
 * transpose and reads row pairs of B as stored. Both passes prefetch the next tokens' rows: a
 * prefill's activations come from L3, and the loops waited on them. Shuffle masks are constants
 * and vectors are never assembled through memory: both stalled these loops 4-5x when measured
 * (store forwarding).
 * Products accumulate in float32 (16-wide vectors, GCC vector extensions: AVX-512 or AVX2
 * from -march=native, no intrinsics, no -ffast-math: the sums are ordered as written).
 * Every group is checked against the extents of x, y and the pool before anything runs (return 2).
 * Groups are split over n_threads OpenMP threads when the call is large enough to pay for them;
 * groups never overlap in y (EXPAND adds without atomics).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
#define W 16
#define RB 8 /* ranks per register block */

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

typedef struct {
    const float *x, *a, *scaling;
    float *h;
    const float *b;
    float *y;
    const int64_t *slots, *experts, *rows, *lens;
    int64_t n_tokens, d_in, d_out, rank;
    int64_t sx_g, sx_t, sx_k, sa_s, sa_e, sa_r, sa_k, s_scaling, sh_g, sh_t;
    int64_t sb_s, sb_e, sb_n, sb_r, sy_g, sy_t, sy_n;
    int64_t n_rows, row_tokens, n_slots, n_experts; /* the extents of x (or y) and of the weights */
} Args;

static int64_t group_len(const Args *p, int64_t g) { return p->lens ? p->lens[g] : p->n_tokens; }
static int64_t group_row(const Args *p, int64_t g) { return p->rows ? p->rows[g] : g; }

/* (a, b) -> lanes [a0+a8.., b0+b8..] and so on: four levels turn 16 accumulators into one
   vector of their 16 totals (a horizontal sum per accumulator would cost 4x the dot itself) */
/* shuffle masks as macros of constant lane indices, 0..15 from the first vector, 16..31 from
   the second: __builtin_shufflevector on GCC >= 12 and clang, __builtin_shuffle on older GCC */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int i16 __attribute__((vector_size(64)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif
#define L1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define H1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define H2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define H3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define H4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define FOLD(a, b, lo, hi) (SHUF((a), (b), lo) + SHUF((a), (b), hi))

/* 8 vectors of two 8-lane groups each (vector k: sums 2k and 2k + 1) -> one vector of the 16 totals */
static inline v16 reduce8(const v16 *v) {
    v16 e[4], g[2];
    for (int i = 0; i < 4; i++) e[i] = FOLD(v[2 * i], v[2 * i + 1], L2, H2);
    for (int i = 0; i < 2; i++) g[i] = FOLD(e[2 * i], e[2 * i + 1], L3, H3);
    return FOLD(g[0], g[1], L4, H4);
}

/* 16 vectors of 16 lanes (vector k: sum k) -> one vector of the 16 totals */
static inline v16 reduce16(const v16 *acc) {
    v16 c[8];
    for (int i = 0; i < 8; i++) c[i] = FOLD(acc[2 * i], acc[2 * i + 1], L1, H1);
    return reduce8(c);
}

typedef float v8 __attribute__((vector_size(32)));
/* one float in every lane: a broadcast load (not (v16){0} + f, which adds first, then broadcasts a register) */
#define SPLAT(f) ((v16){(f), (f), (f), (f), (f), (f), (f), (f), (f), (f), (f), (f), (f), (f), (f), (f)})

/* v16 of two 8-float runs: lanes 0..7 from p, 8..15 from q (two loads and one insert; built
   through memory instead, the 64-byte read of two 32-byte writes stalls store forwarding) */
static inline v16 ld2(const float *p, const float *q) {
#if defined(__clang__) || __GNUC__ >= 12
    v8 a, b;
    memcpy(&a, p, sizeof a);
    memcpy(&b, q, sizeof b);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else /* (older GCC: correct, slower) */
    v16 v;
    memcpy(&v, p, 8 * sizeof(float));
    memcpy((char *)&v + 8 * sizeof(float), q, 8 * sizeof(float));
    return v;
#endif
}

/* out0[j], out1[j] = A[j] . x0, A[j] . x1 for j < RB: two tokens (x1 may equal x0) against a
   full block of RB weight rows, contiguous in k; 16 independent accumulators. pf0, pf1: the next
   pair's rows, fetched while this pair computes (a prefill's activations come from L3: without it
   the loop waits on them, 1.3-1.4x slower at 64 sequences of 32 tokens, measured) */
static void dot_block(const float *x0, const float *x1, const float *A, int64_t sa_r, int64_t d_in,
                      float *out0, float *out1, const float *pf0, const float *pf1) {
    v16 acc[2 * RB];
    for (int j = 0; j < 2 * RB; j++) acc[j] = (v16){0};
    int64_t k = 0;
    for (; k + W <= d_in; k += W) {
        __builtin_prefetch(pf0 + k, 0, 3); /* one per 64-byte line: W floats */
        __builtin_prefetch(pf1 + k, 0, 3);
        v16 xv0 = ld(x0 + k), xv1 = ld(x1 + k);
#pragma GCC unroll 8
        for (int j = 0; j < RB; j++) {
            v16 av = ld(A + j * sa_r + k);
#ifdef __AVX512F__
            __asm__("" : "+v"(av)); /* one load for both tokens: GCC folds it into both FMAs, and loads bind */
#endif
            acc[j] += xv0 * av;
            acc[RB + j] += xv1 * av;
        }
    }
    v16 tot = reduce16(acc); /* lanes 0..7: token 0's ranks, 8..15: token 1's */
    for (int j = 0; j < RB; j++) {
        float s0 = tot[j], s1 = tot[RB + j];
        for (int64_t kk = k; kk < d_in; kk++) {
            s0 += x0[kk] * A[j * sa_r + kk];
            s1 += x1[kk] * A[j * sa_r + kk];
        }
        out0[j] = s0;
        out1[j] = s1;
    }
}

/* out[j] = A[j] . x for j < RB, one token (a decode group): 8 sums, no second token to waste FMAs on */
static void dot_block1(const float *x, const float *A, int64_t sa_r, int64_t d_in, float *out) {
    v16 acc[2 * RB];
    for (int j = 0; j < 2 * RB; j++) acc[j] = (v16){0};
    int64_t k = 0;
    for (; k + W <= d_in; k += W) {
        v16 xv = ld(x + k);
#pragma GCC unroll 8
        for (int j = 0; j < RB; j++) acc[j] += xv * ld(A + j * sa_r + k);
    }
    v16 tot = reduce16(acc);
    for (int j = 0; j < RB; j++) {
        float s0 = tot[j];
        for (int64_t kk = k; kk < d_in; kk++) s0 += x[kk] * A[j * sa_r + kk];
        out[j] = s0;
    }
}

/* the same for the last nr < RB rows of a rank that is not a multiple of RB */
static void dot_tail(const float *x0, const float *x1, const float *A, int64_t sa_r, int64_t d_in, int nr,
                     float *out0, float *out1) {
    for (int j = 0; j < nr; j++) {
        v16 a0 = (v16){0}, a1 = (v16){0};
        int64_t k = 0;
        for (; k + W <= d_in; k += W) {
            v16 av = ld(A + j * sa_r + k);
            a0 += ld(x0 + k) * av;
            a1 += ld(x1 + k) * av;
        }
        float s0 = hsum(a0), s1 = hsum(a1);
        for (; k < d_in; k++) {
            s0 += x0[k] * A[j * sa_r + k];
            s1 += x1[k] * A[j * sa_r + k];
        }
        out0[j] = s0;
        out1[j] = s1;
    }
}

static void shrink_group(const Args *p, int64_t g) {
    int64_t s = p->slots[g];
    if (s < 0) return;
    const float *A = p->a + s * p->sa_s + (p->experts ? p->experts[g] * p->sa_e : 0);
    const float *xg = p->x + group_row(p, g) * p->sx_g;
    float *hg = p->h + group_row(p, g) * p->sh_g; /* h is laid out like x's rows */
    float sc = p->scaling[s * p->s_scaling];
    int64_t len = group_len(p, g);
    if (len <= 0) return;
    if (p->sx_k != 1 || p->sa_k != 1) { /* strided features: the plain loop */
        for (int64_t t = 0; t < len; t++)
            for (int64_t j = 0; j < p->rank; j++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < p->d_in; k++) acc += xg[t * p->sx_t + k * p->sx_k] * A[j * p->sa_r + k * p->sa_k];
                hg[t * p->sh_t + j] = sc * acc;
            }
        return;
    }
    for (int64_t t = 0; t < len; t += 2) {
        int64_t t1 = t + 1 < len ? t + 1 : t;
        for (int64_t j0 = 0; j0 < p->rank; j0 += RB) {
            int nr = (int)(p->rank - j0 < RB ? p->rank - j0 : RB);
            float o0[RB], o1[RB];
            if (nr == RB && t1 == t)
                dot_block1(xg + t * p->sx_t, A + j0 * p->sa_r, p->sa_r, p->d_in, o0);
            else if (nr == RB)
                dot_block(xg + t * p->sx_t, xg + t1 * p->sx_t, A + j0 * p->sa_r, p->sa_r, p->d_in, o0, o1,
                          xg + (t + 2 < len ? t + 2 : t) * p->sx_t, xg + (t + 3 < len ? t + 3 : t1) * p->sx_t);
            else
                dot_tail(xg + t * p->sx_t, xg + t1 * p->sx_t, A + j0 * p->sa_r, p->sa_r, p->d_in, nr, o0, o1);
            for (int j = 0; j < nr; j++) {
                hg[t1 * p->sh_t + j0 + j] = sc * o1[j]; /* (t1 == t: o0 is the one written last) */
                hg[t * p->sh_t + j0 + j] = sc * o0[j];
            }
        }
    }
}

#define OB 4 /* output vectors per step of EXPAND */

/* y0 += Bt^T h0 and y1 += Bt^T h1 over one block of RB ranks (rows of Bt [RB, out], sbt apart, zero past the
   rank; h0, h1 the tokens' RB values, zero past it): 2 tokens x OB vectors = 8 independent sums */
static void expand_block(float *y0, float *y1, const float *Bt, int64_t sbt, const float *h0, const float *h1,
                         int64_t d_out, int two) {
    v16 b0[RB], b1[RB];
    for (int j = 0; j < RB; j++) { b0[j] = (v16){0} + h0[j]; b1[j] = (v16){0} + h1[j]; }
    int64_t o = 0;
    for (; o + OB * W <= d_out; o += OB * W) {
        v16 a0[OB], a1[OB];
        for (int i = 0; i < OB; i++) { a0[i] = ld(y0 + o + i * W); a1[i] = two ? ld(y1 + o + i * W) : (v16){0}; }
#pragma GCC unroll 8
        for (int j = 0; j < RB; j++)
            for (int i = 0; i < OB; i++) {
                v16 bv = ld(Bt + j * sbt + o + i * W);
                a0[i] += b0[j] * bv;
                a1[i] += b1[j] * bv;
            }
        for (int i = 0; i < OB; i++) { st(y0 + o + i * W, a0[i]); if (two) st(y1 + o + i * W, a1[i]); }
    }
    for (; o < d_out; o++) {
        float s0 = y0[o], s1 = two ? y1[o] : 0.0f;
        for (int j = 0; j < RB; j++) { s0 += h0[j] * Bt[j * sbt + o]; s1 += h1[j] * Bt[j * sbt + o]; }
        y0[o] = s0;
        if (two) y1[o] = s1;
    }
}

/* lanes of the two inputs swapped between vector bit `stage` (u: 0, v: 1) and lane bit `stage`:
   new u[l] = l has the bit ? v[l without it] : u[l];  new v[l] = l has the bit ? v[l] : u[l with it]
   (constants: masks built at run time go through the stack and stall the shuffles' loads) */
#define SWAP_U0 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define SWAP_V0 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define SWAP_U1 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define SWAP_V1 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SWAP_U2 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define SWAP_V2 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define I0_LAST 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15 /* lane (i0 i3 i2 i1) -> (i3 i2 i1 i0) */
#define SWAP(k, step, U, V)                                     \
    do {                                                        \
        v16 u_ = v[k], w_ = v[(k) + (step)];                    \
        v[k] = SHUF(u_, w_, U);                                 \
        v[(k) + (step)] = SHUF(u_, w_, V);                      \
    } while (0)

/* bt [8, 16] (rows bt_stride apart) = the 16 x 8 block of B at rows o.., ranks j0.. (row stride sb_n,
   unit rank stride): element (i, j) sits at vector i / 2, lane (i % 2) * 8 + j after the loads; three
   two-input shuffle stages swap the vector bits (i3 i2 i1) with the lane bits (j2 j1 j0), one
   in-vector shuffle puts i0 last: 32 shuffles for 128 elements instead of 128 scalar moves */
static void transpose_16x8(float *bt, int64_t bt_stride, const float *B, int64_t sb_n) {
    v16 v[8];
    for (int k = 0; k < 8; k++) v[k] = ld2(B + (2 * k) * sb_n, B + (2 * k + 1) * sb_n);
    /* stage s swaps vector bit s with lane bit s, over the pairs of vectors 2^s apart */
    SWAP(0, 1, SWAP_U0, SWAP_V0); SWAP(2, 1, SWAP_U0, SWAP_V0); SWAP(4, 1, SWAP_U0, SWAP_V0); SWAP(6, 1, SWAP_U0, SWAP_V0);
    SWAP(0, 2, SWAP_U1, SWAP_V1); SWAP(1, 2, SWAP_U1, SWAP_V1); SWAP(4, 2, SWAP_U1, SWAP_V1); SWAP(5, 2, SWAP_U1, SWAP_V1);
    SWAP(0, 4, SWAP_U2, SWAP_V2); SWAP(1, 4, SWAP_U2, SWAP_V2); SWAP(2, 4, SWAP_U2, SWAP_V2); SWAP(3, 4, SWAP_U2, SWAP_V2);
    for (int j = 0; j < 8; j++) st(bt + j * bt_stride, SHUF(v[j], v[j], I0_LAST));
}

/* bt [rp, n] = B^T for B [n, r] at strides (sb_n, sb_r); rows r..rp-1 zero */
static void transpose_b(float *bt, const float *B, int64_t sb_n, int64_t sb_r, int64_t r, int64_t rp, int64_t n) {
    int64_t o0 = 0;
    if (sb_r == 1 && r % RB == 0) /* whole 16 x 8 blocks */
        for (; o0 + 16 <= n; o0 += 16)
            for (int64_t j0 = 0; j0 < r; j0 += RB)
                transpose_16x8(bt + j0 * n + o0, n, B + o0 * sb_n + j0, sb_n);
    for (int64_t j = 0; j < rp; j++)
        for (int64_t o = o0; o < n; o++) bt[j * n + o] = j < r ? B[o * sb_n + j * sb_r] : 0.0f;
}

/* y[o] += B[o, :] . h for one token with B [n, r] as stored (unit rank stride, r % RB == 0): rows
   o and o + 1 side by side in a vector, 8 row pairs folded into 16 sums. A decode group reads
   its B once; transposing it first (the longer groups' way) would cost more than the product */
static void expand_one(float *y, const float *B, int64_t sb_n, const float *h, int64_t r, int64_t n) {
    int64_t o = 0;
    for (; o + 16 <= n; o += 16) {
        v16 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = (v16){0};
        for (int64_t j0 = 0; j0 < r; j0 += RB) {
            v16 hh = ld2(h + j0, h + j0);
            for (int k = 0; k < 8; k++) acc[k] += ld2(B + (o + 2 * k) * sb_n + j0, B + (o + 2 * k + 1) * sb_n + j0) * hh;
        }
        st(y + o, ld(y + o) + reduce8(acc));
    }
    for (; o < n; o++) {
        float acc = y[o];
        for (int64_t j = 0; j < r; j++) acc += h[j] * B[o * sb_n + j];
        y[o] = acc;
    }
}

/* y[t, o .. o + nv W) += Bt[:RB, o .. o + nv W)^T h[t, :RB] for every token t < len: nv (1 or 2, a
   constant where inlined) vectors of Bt's RB rows held in registers while the tokens stream past,
   the rank values broadcast from h; the y rows four tokens ahead are fetched */
static inline __attribute__((always_inline)) void expand_cols(float *yg, int64_t sy_t, const float *hg, int64_t sh_t,
                                                              const float *Bt, int64_t sbt, int64_t len, int64_t o,
                                                              const int nv) {
    v16 w[2][RB];
    for (int i = 0; i < nv; i++)
        for (int j = 0; j < RB; j++) w[i][j] = ld(Bt + j * sbt + o + i * W);
    for (int64_t t = 0; t < len; t++) {
        float *yt = yg + t * sy_t + o;
        const float *ht = hg + t * sh_t;
        if (t + 4 < len)
            for (int i = 0; i < nv; i++) __builtin_prefetch(yt + 4 * sy_t + i * W, 1, 3);
        v16 u[2];
        for (int i = 0; i < nv; i++) u[i] = ld(yt + i * W);
#pragma GCC unroll 8
        for (int j = 0; j < RB; j++) {
            v16 hj = SPLAT(ht[j]);
            for (int i = 0; i < nv; i++) u[i] += hj * w[i][j];
        }
        for (int i = 0; i < nv; i++) st(yt + i * W, u[i]);
    }
}

/* y[t, :] += Bt[:RB, :]^T h[t, :RB] for every token t < len of a group (several tokens): each y
   element read and written once per rank block. 32 columns at a time, then 16, then one by one;
   1.35x the pair loop's rate in cache (measured) */
static void expand_tokens(float *yg, int64_t sy_t, const float *hg, int64_t sh_t, const float *Bt, int64_t sbt,
                          int64_t len, int64_t n) {
    int64_t o = 0;
    for (; o + 2 * W <= n; o += 2 * W) expand_cols(yg, sy_t, hg, sh_t, Bt, sbt, len, o, 2);
    if (o + W <= n) {
        expand_cols(yg, sy_t, hg, sh_t, Bt, sbt, len, o, 1);
        o += W;
    }
    for (; o < n; o++)
        for (int64_t t = 0; t < len; t++) {
            float acc = yg[t * sy_t + o];
            for (int j = 0; j < RB; j++) acc += hg[t * sh_t + j] * Bt[j * sbt + o];
            yg[t * sy_t + o] = acc;
        }
}

static void expand_group(const Args *p, int64_t g, float *bt) {
    int64_t s = p->slots[g];
    if (s < 0) return;
    const float *B = p->b + s * p->sb_s + (p->experts ? p->experts[g] * p->sb_e : 0);
    float *yg = p->y + group_row(p, g) * p->sy_g;
    const float *hg = p->h + group_row(p, g) * p->sh_g;
    int64_t len = group_len(p, g), r = p->rank, n = p->d_out;
    if (len <= 0) return; /* (an MoE layer passes every (expert, sequence) pair, most of them empty in decode) */
    if (p->sy_n != 1) {
        for (int64_t t = 0; t < len; t++)
            for (int64_t o = 0; o < n; o++) {
                float acc = yg[t * p->sy_t + o * p->sy_n];
                for (int64_t j = 0; j < r; j++) acc += hg[t * p->sh_t + j] * B[o * p->sb_n + j * p->sb_r];
                yg[t * p->sy_t + o * p->sy_n] = acc;
            }
        return;
    }
    if (len == 1 && p->sb_r == 1 && r % RB == 0) {
        expand_one(yg, B, p->sb_n, hg, r, n);
        return;
    }
    const float *Bt = B;
    int64_t sbt = p->sb_r, rp = r;
    if (p->sb_n != 1 || r % RB) { /* B [out, r] as stored (PEFT's lora_B): transposed once into bt [rp, out] */
        rp = (r + RB - 1) / RB * RB;
        transpose_b(bt, B, p->sb_n, p->sb_r, r, rp, n);
        Bt = bt;
        sbt = n;
    } /* else B is [r, out] already: its rows are read in place */
    if (len >= 4 && r % RB == 0) { /* several tokens: Bt's columns held, tokens streamed */
        for (int64_t j0 = 0; j0 < r; j0 += RB) expand_tokens(yg, p->sy_t, hg + j0, p->sh_t, Bt + j0 * sbt, sbt, len, n);
        return;
    }
    for (int64_t t = 0; t < len; t += 2) {
        int two = t + 1 < len;
        const float *h0 = hg + t * p->sh_t, *h1 = two ? h0 + p->sh_t : h0;
        for (int64_t j0 = 0; j0 < rp; j0 += RB) {
            float q0[RB], q1[RB];
            for (int j = 0; j < RB; j++) {
                q0[j] = j0 + j < r ? h0[j0 + j] : 0.0f;
                q1[j] = j0 + j < r ? h1[j0 + j] : 0.0f;
            }
            expand_block(yg + t * p->sy_t, yg + (two ? t + 1 : t) * p->sy_t, Bt + j0 * sbt, sbt, q0, q1, n, two);
        }
    }
}

typedef struct {
    const Args *p;
    int64_t g0, g1;
    int expand;
} Part;

static void *run_part(void *arg) {
    const Part *q = (const Part *)arg;
    float *bt = NULL;
    if (q->expand && q->p->sy_n == 1) {
        bt = (float *)malloc((size_t)((q->p->rank + RB - 1) / RB * RB * q->p->d_out) * sizeof(float));
        if (!bt) return (void *)1;
    }
    for (int64_t g = q->g0; g < q->g1; g++) {
        if (q->expand) expand_group(q->p, g, bt);
        else shrink_group(q->p, g);
    }
    free(bt);
    return NULL;
}

#define MAX_THREADS 64
#define MIN_WORK_PER_THREAD (1 << 22) /* multiply-adds (~50 us): a decode step stays on one thread (measured faster) */

/* every group inside the tensors, before anything is read or written: the Python side passes
   indices it did not check (a bad slot or row would reach outside x, y or the pool) */
static int in_bounds(const Args *p, int64_t n_groups) {
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t s = p->slots[g], len = group_len(p, g), row = group_row(p, g);
        if (s < -1 || s >= p->n_slots) return 0;
        if (s < 0) continue; /* skipped: never read or written, so its row, length and expert may be anything */
        if (len < 0 || len > p->n_tokens) return 0;
        if (p->experts && (p->experts[g] < 0 || p->experts[g] >= p->n_experts)) return 0;
        if (p->row_tokens >= 0) { /* 3-D [R, T, f]: token t of group g at x[row, t] */
            if (row < 0 || row >= p->n_rows || p->n_tokens > p->row_tokens) return 0;
        } else if (row < 0 || row > p->n_rows - len) { /* 2-D [N, f]: rows row .. row + len - 1 (no overflow) */
            return 0;
        }
    }
    return 1;
}

/* split groups [0, G) into parts of about equal work (tokens), one per thread; 0 on success */
/* (the caller checked the groups: in_bounds) */
static int run(const Args *p, int64_t n_groups, int expand, int n_threads) {
    int64_t total = 0;
    for (int64_t g = 0; g < n_groups; g++) total += p->slots[g] >= 0 ? group_len(p, g) : 0;
    int64_t per_token = p->rank * (expand ? p->d_out : p->d_in);
    int64_t by_work = total * per_token / MIN_WORK_PER_THREAD;
    int n = n_threads < 1 ? 1 : (n_threads > MAX_THREADS ? MAX_THREADS : n_threads);
    if (by_work < n) n = by_work < 1 ? 1 : (int)by_work;
    Part parts[MAX_THREADS];
    int64_t g = 0, done = 0;
    for (int i = 0; i < n; i++) {
        int64_t goal = total * (i + 1) / n;
        parts[i].p = p;
        parts[i].expand = expand;
        parts[i].g0 = g;
        while (g < n_groups && (done < goal || i == n - 1)) {
            done += p->slots[g] >= 0 ? group_len(p, g) : 0;
            g++;
        }
        parts[i].g1 = g;
    }
    int err = 0;
    /* built by GCC, this is torch's own OpenMP runtime (the one libgomp.so.1 in the process): its
       warm thread pool, not threads of our own competing with its spinning workers for the same
       cores (clang links its libomp instead: correct, two pools) */
#pragma omp parallel for num_threads(n) schedule(static, 1) reduction(| : err) if (n > 1)
    for (int i = 0; i < n; i++) err |= run_part(&parts[i]) != NULL;
    return err;
}

/* The one entry point: ``op`` 0 SHRINK, 1 EXPAND, 2 both (SHRINK into h, then EXPAND from it), every
 * argument an int64 of one array (pointers as integers; 0 for an absent experts, rows or lens). One
 * array instead of ~27 ctypes arguments: converting those cost ~20 us per call, more than a decode
 * step's kernel (measured). Layout, by index (Q_* below, mirrored by _Q in kernels/cpu.py), in three
 * blocks, so the caller builds each pass's block from its own tensors (zeros for a pass not run):
 *   shared  pointers x a scaling h b y slots experts rows lens; n_groups n_tokens rank; h's strides (g t);
 *           n_threads
 *   SHRINK  d_in; strides x (g t k), a (s e r k), scaling; extents x (rows, row_tokens), a (slots, experts)
 *   EXPAND  d_out; strides b (s e n r), y (g t n); extents y (rows, row_tokens), b (slots, experts) */
enum {
    Q_X, Q_A, Q_SCALING, Q_H, Q_B, Q_Y, Q_SLOTS, Q_EXPERTS, Q_ROWS, Q_LENS,
    Q_N_GROUPS, Q_N_TOKENS, Q_RANK, Q_SH_G, Q_SH_T, Q_N_THREADS,
    Q_D_IN, Q_SX_G, Q_SX_T, Q_SX_K, Q_SA_S, Q_SA_E, Q_SA_R, Q_SA_K, Q_S_SCALING,
    Q_X_ROWS, Q_X_ROW_TOKENS, Q_A_SLOTS, Q_A_EXPERTS,
    Q_D_OUT, Q_SB_S, Q_SB_E, Q_SB_N, Q_SB_R, Q_SY_G, Q_SY_T, Q_SY_N,
    Q_Y_ROWS, Q_Y_ROW_TOKENS, Q_B_SLOTS, Q_B_EXPERTS,
    Q_LEN
};

int mint_lora_args(void) { return Q_LEN; } /* the Python side checks its layout against this */

#define PTR(T, i) ((T)(intptr_t)q[i])

int mint_lora_op(int op, const int64_t *q) {
    if (op < 0 || op > 2) return 3;
    Args p = {0};
    p.x = PTR(const float *, Q_X); p.a = PTR(const float *, Q_A); p.scaling = PTR(const float *, Q_SCALING);
    p.h = PTR(float *, Q_H); p.b = PTR(const float *, Q_B); p.y = PTR(float *, Q_Y);
    p.slots = PTR(const int64_t *, Q_SLOTS); p.experts = PTR(const int64_t *, Q_EXPERTS);
    p.rows = PTR(const int64_t *, Q_ROWS); p.lens = PTR(const int64_t *, Q_LENS);
    p.n_tokens = q[Q_N_TOKENS]; p.d_in = q[Q_D_IN]; p.d_out = q[Q_D_OUT]; p.rank = q[Q_RANK];
    p.sx_g = q[Q_SX_G]; p.sx_t = q[Q_SX_T]; p.sx_k = q[Q_SX_K];
    p.sa_s = q[Q_SA_S]; p.sa_e = q[Q_SA_E]; p.sa_r = q[Q_SA_R]; p.sa_k = q[Q_SA_K];
    p.s_scaling = q[Q_S_SCALING]; p.sh_g = q[Q_SH_G]; p.sh_t = q[Q_SH_T];
    p.sb_s = q[Q_SB_S]; p.sb_e = q[Q_SB_E]; p.sb_n = q[Q_SB_N]; p.sb_r = q[Q_SB_R];
    p.sy_g = q[Q_SY_G]; p.sy_t = q[Q_SY_T]; p.sy_n = q[Q_SY_N];
    int64_t n_groups = q[Q_N_GROUPS];
    int n_threads = (int)q[Q_N_THREADS];
    Args ps = p, pe = p; /* each pass is checked against the extents of what it reads and writes */
    ps.n_rows = q[Q_X_ROWS]; ps.row_tokens = q[Q_X_ROW_TOKENS]; ps.n_slots = q[Q_A_SLOTS]; ps.n_experts = q[Q_A_EXPERTS];
    pe.n_rows = q[Q_Y_ROWS]; pe.row_tokens = q[Q_Y_ROW_TOKENS]; pe.n_slots = q[Q_B_SLOTS]; pe.n_experts = q[Q_B_EXPERTS];
    if ((op != 1 && !in_bounds(&ps, n_groups)) || (op != 0 && !in_bounds(&pe, n_groups))) return 2;
    int err = op != 1 ? run(&ps, n_groups, 0, n_threads) : 0;
    return err ? err : (op != 0 ? run(&pe, n_groups, 1, n_threads) : 0);
}
