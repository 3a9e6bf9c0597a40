/* einpage.runtime._cpu: contractions that read a weight as it lies in memory.
 *
 * A host contraction whose weight is held as f16, bf16 or a GGUF block format (Q8_0, Q4_0,
 * Q4_1, einpage's Q4_G128) would otherwise be converted by NumPy into a float32 copy of the
 * whole weight before the BLAS reads it: several passes over memory, each bound by NumPy's
 * element loops. These kernels read the stored bytes once:
 *
 *   gemv     out[b, m, n] = sum_k x[b, m, k] * W_b[n, k] for rows n0 <= n < n1 of each of a
 *            batch of W's (rows at a byte stride, each batch at its own byte offset: a block
 *            of a KV store read per head): each row decoded a chunk at a time into a small
 *            float32 buffer (in L1) and dotted with the (few) rows of x; with one row of
 *            x and AVX-512, a 4-bit row's levels are looked up from its nibbles where they lie
 *            instead (dot_q4_avx512: decode at B=1, where the decoding binds).
 *   dequant  rows n0 <= n < n1 of W decoded into a float32 tile, for the BLAS to multiply
 *            (many rows of x: prefill), the tile sized by the caller to stay in cache.
 *
 * Rows of W hold K logical elements, contiguous (packed formats: K / group whole groups).
 * Values are exactly those of einpage.ir.quant.dequantize: a packed value is computed in
 * float32 (scale times level, as NumPy does, never fused into an FMA) and then, with `round`,
 * rounded to the tensor's logical dtype (f16 or bf16, to nearest even) before it is used.
 * The dot products sum in float32 in a fixed order, so results do not depend on threads.
 *
 * Three code paths, picked once at import from what the CPU has: AVX-512F, AVX2 with FMA and
 * F16C, and portable C. `use_isa(name)` makes every call take a slower one (tests prove the
 * paths agree). Every call releases the GIL: the caller cuts rows over its threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EP_X86 1
#include <immintrin.h>
#else
#define EP_X86 0
#endif

enum { F_F32 = 0, F_F16 = 1, F_BF16 = 2, F_Q8_0 = 3, F_Q4_0 = 4, F_Q4_1 = 5, F_Q4_G128 = 6,
       F_COUNT = 7 };
enum { R_NONE = 0, R_F16 = 1, R_BF16 = 2 };

static const int GROUP[F_COUNT] = {1, 1, 1, 32, 32, 32, 128};
static const int GROUP_BYTES[F_COUNT] = {4, 2, 2, 34, 18, 20, 68};

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int best_isa = ISA_PORTABLE;
static int isa = ISA_PORTABLE;

/* ------------------------------------------------------------------ portable */

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float h2f(uint16_t h)
{
    /* exact, subnormals, infinities and NaNs included */
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    if (e == 0x1f) return bits_f(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * bits_f(0x33800000u); /* m * 2^-24 */
        return bits_f(sign | f_bits(v));
    }
    return bits_f(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t f2h(float f)
{
    /* to nearest even, overflow to infinity (F16C's and NumPy's rounding) */
    uint32_t u = f_bits(f), sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    if (u >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    if (u < 0x38800000u) { /* below 2^-14: a subnormal (or zero) */
        float v = bits_f(u) + 0.5f; /* 2^-1 + x: the ulp there is 2^-24, as f16's subnormals */
        return (uint16_t)(sign | (f_bits(v) - 0x3f000000u));
    }
    uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd; /* rebias the exponent (-112 << 23) and round */
    return (uint16_t)(sign | (u >> 13));
}

static inline float round_bf16(float f)
{
    uint32_t u = f_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bits_f((u | 0x00400000u) & 0xffff0000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return bits_f(u & 0xffff0000u);
}

static inline float rounded(float v, int round)
{
    if (round == R_F16) return h2f(f2h(v));
    if (round == R_BF16) return round_bf16(v);
    return v;
}

static inline float read_f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h2f(h); }

/* the 16 values a 4-bit group's nibbles stand for (einpage.ir.quant's _LEVELS) */
static void levels4(int fmt, const uint8_t *g, int round, float *lv)
{
    float d = read_f16(g);
    for (int j = 0; j < 16; j++) {
        float v;
        if (fmt == F_Q4_0) v = d * (float)(j - 8);
        else if (fmt == F_Q4_1) v = d * (float)j + read_f16(g + 2); /* no FMA: -ffp-contract=off */
        else v = ((float)j - (float)g[2]) * d;
        lv[j] = rounded(v, round);
    }
}

static void decode_portable(int fmt, const uint8_t *row, int64_t K, int round, float *out)
{
    if (fmt == F_F32) { memcpy(out, row, (size_t)K * 4); return; }
    if (fmt == F_F16) {
        for (int64_t k = 0; k < K; k++) out[k] = read_f16(row + 2 * k);
        return;
    }
    if (fmt == F_BF16) {
        for (int64_t k = 0; k < K; k++) {
            uint16_t b; memcpy(&b, row + 2 * k, 2);
            out[k] = bits_f((uint32_t)b << 16);
        }
        return;
    }
    const int G = GROUP[fmt], GB = GROUP_BYTES[fmt];
    for (int64_t g0 = 0; g0 < K; g0 += G, row += GB, out += G) {
        if (fmt == F_Q8_0) {
            float d = read_f16(row);
            for (int i = 0; i < 32; i++) out[i] = rounded(d * (float)(int8_t)row[2 + i], round);
            continue;
        }
        float lv[16];
        levels4(fmt, row, round, lv);
        const uint8_t *qs = row + (GB - G / 2);
        for (int i = 0; i < G / 2; i++) {
            out[i] = lv[qs[i] & 15];
            out[i + G / 2] = lv[qs[i] >> 4];
        }
    }
}

static void dot_portable(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                         float *out, int64_t ldo)
{
    for (int64_t m = 0; m < M; m++) {
        float acc[16] = {0};
        const float *xm = x + m * ldx;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            for (int l = 0; l < 16; l++) acc[l] += xm[k + l] * w[k + l];
        for (; k < K; k++) acc[k & 15] += xm[k] * w[k];
        float s = 0;
        for (int l = 0; l < 16; l++) s += acc[l];
        out[m * ldo] += s;
    }
}

#if EP_X86
/* ------------------------------------------------------------------ AVX2 + FMA + F16C */

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline __m256 round8(__m256 v, int round)
{
    if (round == R_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    if (round == R_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
        r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
        __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)),
                                       _mm256_set1_epi32((int)0xffff0000u));
        __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan), isnan);
    }
    return v;
}

/* one f16 (a group's scale) to float32 with F16C: exact, as h2f */
AVX2 static inline float scale_f16c(const uint8_t *p)
{
    uint16_t h; memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

AVX2 static inline __m256 lookup8(__m256 lo, __m256 hi, __m256i idx)
{
    __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

AVX2 static void decode_avx2(int fmt, const uint8_t *row, int64_t K, int round, float *out)
{
    int64_t k = 0;
    if (fmt == F_F16) {
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(out + k, _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(row + 2 * k))));
        for (; k < K; k++) out[k] = read_f16(row + 2 * k);
        return;
    }
    if (fmt == F_BF16) {
        for (; k + 8 <= K; k += 8) {
            __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * k)));
            _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
        }
        for (; k < K; k++) {
            uint16_t b; memcpy(&b, row + 2 * k, 2);
            out[k] = bits_f((uint32_t)b << 16);
        }
        return;
    }
    if (fmt == F_F32) { memcpy(out, row, (size_t)K * 4); return; }
    const int G = GROUP[fmt], GB = GROUP_BYTES[fmt];
    const __m256 steps_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 steps_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g0 = 0; g0 < K; g0 += G, row += GB, out += G) {
        __m256 d = _mm256_set1_ps(scale_f16c(row));
        if (fmt == F_Q8_0) {
            for (int i = 0; i < 32; i += 8) {
                __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 2 + i)));
                _mm256_storeu_ps(out + i, round8(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), round));
            }
            continue;
        }
        __m256 lo, hi;
        if (fmt == F_Q4_0) {
            __m256 eight = _mm256_set1_ps(8);
            lo = _mm256_mul_ps(d, _mm256_sub_ps(steps_lo, eight));
            hi = _mm256_mul_ps(d, _mm256_sub_ps(steps_hi, eight));
        } else if (fmt == F_Q4_1) {
            __m256 mn = _mm256_set1_ps(scale_f16c(row + 2));
            lo = _mm256_add_ps(_mm256_mul_ps(d, steps_lo), mn);
            hi = _mm256_add_ps(_mm256_mul_ps(d, steps_hi), mn);
        } else {
            __m256 z = _mm256_set1_ps((float)row[2]);
            lo = _mm256_mul_ps(_mm256_sub_ps(steps_lo, z), d);
            hi = _mm256_mul_ps(_mm256_sub_ps(steps_hi, z), d);
        }
        lo = round8(lo, round);
        hi = round8(hi, round);
        const uint8_t *qs = row + (GB - G / 2);
        const __m256i low4 = _mm256_set1_epi32(15);
        for (int i = 0; i < G / 2; i += 8) {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + i)));
            _mm256_storeu_ps(out + i, lookup8(lo, hi, _mm256_and_si256(q, low4)));
            _mm256_storeu_ps(out + i + G / 2, lookup8(lo, hi, _mm256_srli_epi32(q, 4)));
        }
    }
}

AVX2 static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static void dot_avx2(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                          float *out, int64_t ldo)
{
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        const float *x0 = x + m * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 wk = _mm256_loadu_ps(w + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wk, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), wk, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k), wk, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k), wk, a3);
        }
        float s0 = hsum8(a0), s1 = hsum8(a1), s2 = hsum8(a2), s3 = hsum8(a3);
        for (; k < K; k++) {
            s0 += x0[k] * w[k]; s1 += x1[k] * w[k]; s2 += x2[k] * w[k]; s3 += x3[k] * w[k];
        }
        out[m * ldo] += s0; out[(m + 1) * ldo] += s1; out[(m + 2) * ldo] += s2;
        out[(m + 3) * ldo] += s3;
    }
    for (; m < M; m++) {
        const float *xm = x + m * ldx;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), _mm256_loadu_ps(w + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 8), _mm256_loadu_ps(w + k + 8), a1);
        }
        float s = hsum8(_mm256_add_ps(a0, a1));
        for (; k < K; k++) s += xm[k] * w[k];
        out[m * ldo] += s;
    }
}

/* two rows of x against four decoded rows of W (w, stride K): 8 sums per pass */
AVX2 static void dot4_avx2(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                           int64_t ldw, float *out, int64_t ldo)
{
    const int64_t K8 = K & ~(int64_t)7;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
        __m256 acc[2][4];
        for (int i = 0; i < 2; i++)
            for (int r = 0; r < 4; r++) acc[i][r] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += 8) {
            __m256 x0 = _mm256_loadu_ps(x + m * ldx + k);
            __m256 x1 = _mm256_loadu_ps(x + (m + 1) * ldx + k);
            for (int r = 0; r < 4; r++) {
                __m256 wv = _mm256_loadu_ps(w + r * ldw + k);
                acc[0][r] = _mm256_fmadd_ps(x0, wv, acc[0][r]);
                acc[1][r] = _mm256_fmadd_ps(x1, wv, acc[1][r]);
            }
        }
        for (int i = 0; i < 2; i++)
            for (int r = 0; r < 4; r++) {
                float s = hsum8(acc[i][r]);
                for (int64_t k = K8; k < K; k++) s += x[(m + i) * ldx + k] * w[r * ldw + k];
                out[(m + i) * ldo + r] += s;
            }
    }
    for (int r = 0; r < 4 && m < M; r++)
        dot_avx2(x + m * ldx, ldx, M - m, K, w + r * ldw, out + m * ldo + r, ldo);
}

/* ------------------------------------------------------------------ AVX-512F */

#define AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

AVX512 static inline __m512 round16(__m512 v, int round)
{
    if (round == R_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    if (round == R_BF16) {
        __m512i u = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
        __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
        __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, isnan, nan);
        return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
    }
    return v;
}

/* the 16 values a 4-bit group's nibbles stand for, d its scale (levels4's, 16 at once) */
AVX512 static inline __m512 levels16(int fmt, const uint8_t *g, __m512 d, int round)
{
    const __m512 steps = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 lv;
    if (fmt == F_Q4_0)
        lv = _mm512_mul_ps(d, _mm512_sub_ps(steps, _mm512_set1_ps(8)));
    else if (fmt == F_Q4_1)
        lv = _mm512_add_ps(_mm512_mul_ps(d, steps), _mm512_set1_ps(scale_f16c(g + 2)));
    else
        lv = _mm512_mul_ps(_mm512_sub_ps(steps, _mm512_set1_ps((float)g[2])), d);
    return round16(lv, round);
}

AVX512 static void decode_avx512(int fmt, const uint8_t *row, int64_t K, int round, float *out)
{
    int64_t k = 0;
    if (fmt == F_F16) {
        for (; k + 16 <= K; k += 16)
            _mm512_storeu_ps(out + k, _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(row + 2 * k))));
        for (; k < K; k++) out[k] = read_f16(row + 2 * k);
        return;
    }
    if (fmt == F_BF16) {
        for (; k + 16 <= K; k += 16) {
            __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * k)));
            _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
        }
        for (; k < K; k++) {
            uint16_t b; memcpy(&b, row + 2 * k, 2);
            out[k] = bits_f((uint32_t)b << 16);
        }
        return;
    }
    if (fmt == F_F32) { memcpy(out, row, (size_t)K * 4); return; }
    const int G = GROUP[fmt], GB = GROUP_BYTES[fmt];
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g0 = 0; g0 < K; g0 += G, row += GB, out += G) {
        __m512 d = _mm512_set1_ps(scale_f16c(row));
        if (fmt == F_Q8_0) {
            for (int i = 0; i < 32; i += 16) {
                __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 2 + i)));
                _mm512_storeu_ps(out + i, round16(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), round));
            }
            continue;
        }
        __m512 lv = levels16(fmt, row, d, round);
        const uint8_t *qs = row + (GB - G / 2);
        for (int i = 0; i < G / 2; i += 16) {
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + i)));
            _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(_mm512_and_si512(q, low4), lv));
            _mm512_storeu_ps(out + i + G / 2,
                             _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lv));
        }
    }
}

AVX512 static void dot_avx512(const float *x, int64_t ldx, int64_t M, int64_t K,
                              const float *w, float *out, int64_t ldo)
{
    const int64_t K16 = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        const float *x0 = x + m * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K16; k += 16) {
            __m512 wk = _mm512_loadu_ps(w + k);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), wk, a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k), wk, a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x2 + k), wk, a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x3 + k), wk, a3);
        }
        if (tail) {
            __m512 wk = _mm512_maskz_loadu_ps(tail, w + K16);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x0 + K16), wk, a0);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x1 + K16), wk, a1);
            a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x2 + K16), wk, a2);
            a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x3 + K16), wk, a3);
        }
        out[m * ldo] += _mm512_reduce_add_ps(a0);
        out[(m + 1) * ldo] += _mm512_reduce_add_ps(a1);
        out[(m + 2) * ldo] += _mm512_reduce_add_ps(a2);
        out[(m + 3) * ldo] += _mm512_reduce_add_ps(a3);
    }
    for (; m < M; m++) {
        const float *xm = x + m * ldx;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        int64_t k = 0;
        for (; k + 32 <= K16; k += 32) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k), _mm512_loadu_ps(w + k), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k + 16), _mm512_loadu_ps(w + k + 16), a1);
        }
        if (k < K16)
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k), _mm512_loadu_ps(w + k), a0);
        if (tail)
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, xm + K16),
                                 _mm512_maskz_loadu_ps(tail, w + K16), a1);
        out[m * ldo] += _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

/* One row of x against one row of W in a 4-bit format, its nibbles looked up in the group's
 * levels where they lie: a group's 16 bytes broadcast to the four 128-bit lanes and shifted by
 * 8c (low nibbles) or 8c + 4 (high) leave, in lane 4c + j, the nibble of byte 4j + c in the
 * low 4 bits the lookup reads. Decoding into a buffer spends a widening and two stores per 16
 * values more on the ports the lookups need. So every run of 16 elements arrives in the order
 * of lanes 4c + j <- element 4j + c, and x is read in that order: xp, permuted once a call
 * (permute_runs16). Sums in float32 over the groups in order, two accumulators. */
AVX512 static float dot_q4_avx512(int fmt, int round, const float *xp, const uint8_t *row,
                                  int64_t K)
{
    const int G = GROUP[fmt], GB = GROUP_BYTES[fmt], H = G / 2;
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16,
                                            24, 24, 24, 24);
    const __m512i shift4 = _mm512_add_epi32(shift, _mm512_set1_epi32(4));
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (int64_t g0 = 0; g0 < K; g0 += G, row += GB, xp += G) {
        uint16_t h; memcpy(&h, row, 2);
        __m512 lv = levels16(fmt, row, _mm512_cvtph_ps(_mm256_set1_epi16((short)h)), round);
        const uint8_t *qs = row + (GB - H);
        for (int i = 0; i < H; i += 16) {
            __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qs + i)));
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i),
                                 _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shift), lv), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + H + i),
                                 _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shift4), lv), a1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* four rows of x against four decoded rows of W (w, stride K): 16 sums, each x and W vector
 * loaded once for four products */
AVX512 static void dot4_avx512(const float *x, int64_t ldx, int64_t M, int64_t K,
                               const float *w, int64_t ldw, float *out, int64_t ldo)
{
    const int64_t K16 = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __mmask16 mask = k < K16 ? (__mmask16)0xffff : tail;
            __m512 wv[4], xv[4];
            for (int r = 0; r < 4; r++) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * ldw + k);
            for (int i = 0; i < 4; i++) xv[i] = _mm512_maskz_loadu_ps(mask, x + (m + i) * ldx + k);
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < 4; r++) acc[i][r] = _mm512_fmadd_ps(xv[i], wv[r], acc[i][r]);
        }
        for (int i = 0; i < 4; i++)
            for (int r = 0; r < 4; r++) out[(m + i) * ldo + r] += _mm512_reduce_add_ps(acc[i][r]);
    }
    for (int r = 0; r < 4 && m < M; r++)
        dot_avx512(x + m * ldx, ldx, M - m, K, w + r * ldw, out + m * ldo + r, ldo);
}
#endif /* EP_X86 */

/* the order dot_q4_avx512 reads x in: in each run of 16, lane 4c + j holds element 4j + c */
static void permute_runs16(const float *x, int64_t K, float *xp)
{
    for (int64_t r = 0; r < K; r += 16)
        for (int l = 0; l < 16; l++) xp[r + l] = x[r + 4 * (l % 4) + l / 4];
}

/* a row of x against rows of W looked up where they lie (dot_q4_avx512) rather than decoded */
static int lookup_q4(int fmt, int64_t M)
{
    return EP_X86 && isa == ISA_AVX512 && M == 1
        && (fmt == F_Q4_0 || fmt == F_Q4_1 || fmt == F_Q4_G128);
}

static void decode_row(int fmt, const uint8_t *row, int64_t K, int round, float *out)
{
#if EP_X86
    if (isa == ISA_AVX512) { decode_avx512(fmt, row, K, round, out); return; }
    if (isa == ISA_AVX2) { decode_avx2(fmt, row, K, round, out); return; }
#endif
    decode_portable(fmt, row, K, round, out);
}

/* out[m, r] for four decoded rows r of W (stride K) */
static void dot4_rows(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                      int64_t ldw, float *out, int64_t ldo)
{
#if EP_X86
    if (isa == ISA_AVX512) { dot4_avx512(x, ldx, M, K, w, ldw, out, ldo); return; }
    if (isa == ISA_AVX2) { dot4_avx2(x, ldx, M, K, w, ldw, out, ldo); return; }
#endif
    for (int r = 0; r < 4; r++) dot_portable(x, ldx, M, K, w + r * ldw, out + r, ldo);
}

static void dot_rows(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                     float *out, int64_t ldo)
{
#if EP_X86
    if (isa == ISA_AVX512) { dot_avx512(x, ldx, M, K, w, out, ldo); return; }
    if (isa == ISA_AVX2) { dot_avx2(x, ldx, M, K, w, out, ldo); return; }
#endif
    dot_portable(x, ldx, M, K, w, out, ldo);
}

/* out[i] += a * w[i], i < n (a product, then a sum: the portable path's order) */
static void axpy_portable(float a, const float *w, float *out, int64_t n)
{
    for (int64_t i = 0; i < n; i++) out[i] += a * w[i];
}

#if EP_X86
AVX2 static void axpy_avx2(float a, const float *w, float *out, int64_t n)
{
    __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(w + i),
                                                  _mm256_loadu_ps(out + i)));
    for (; i < n; i++) out[i] += a * w[i];
}

AVX512 static void axpy_avx512(float a, const float *w, float *out, int64_t n)
{
    __m512 av = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(w + i),
                                                  _mm512_loadu_ps(out + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, w + i),
                                                          _mm512_maskz_loadu_ps(m, out + i)));
    }
}
#endif

static void axpy(float a, const float *w, float *out, int64_t n)
{
#if EP_X86
    if (isa == ISA_AVX512) { axpy_avx512(a, w, out, n); return; }
    if (isa == ISA_AVX2) { axpy_avx2(a, w, out, n); return; }
#endif
    axpy_portable(a, w, out, n);
}

/* ------------------------------------------------------------------ Python */

static int64_t row_bytes(int fmt, int64_t K) { return K / GROUP[fmt] * GROUP_BYTES[fmt]; }

/* ask for the bytes of the rows after [p, p + len) while this one is decoded: one stream of
 * reads per core does not keep enough of them in flight to reach the memory's bandwidth */
static inline void prefetch(const uint8_t *p, int64_t len, const uint8_t *end)
{
#if defined(__GNUC__) || defined(__clang__)
    for (int64_t off = 0; off < len && p + off < end; off += 64) __builtin_prefetch(p + off, 0, 3);
#else
    (void)p; (void)len; (void)end;
#endif
}

/* check the arguments every call shares; 0 with an exception set where they do not hold */
/* a * b * c <= limit, for a, b, c >= 0, computed without overflow */
static int le3(int64_t a, int64_t b, int64_t c, int64_t limit)
{
    if (a < 0 || b < 0 || c < 0 || limit < 0) return 0;
    if (a == 0 || b == 0 || c == 0) return 1;
    if (a > limit / b) return 0;
    return a * b <= limit / c;
}

static int check(int fmt, int round, int64_t K, int64_t n0, int64_t n1, const Py_buffer *w)
{
    if (fmt < 0 || fmt >= F_COUNT || round < R_NONE || round > R_BF16) {
        PyErr_SetString(PyExc_ValueError, "unknown format or rounding");
        return 0;
    }
    if (K <= 0 || K % GROUP[fmt] || n0 < 0 || n1 < n0 || !le3(K, 4, 1, (int64_t)w->len * 32)
            || !le3(n1, row_bytes(fmt, K), 1, (int64_t)w->len)) {
        PyErr_SetString(PyExc_ValueError, "rows out of the weight's bytes (or K not whole groups)");
        return 0;
    }
    return 1;
}

/* Elements of a row decoded at a time (a multiple of every group): the decoded chunk, four rows'
 * of it at most (16 KiB), stays in L1 beside the rows of x it meets */
#define CHUNK 1024

/* out[m, n] for rows n0 <= n < n1 of W: each row decoded a chunk at a time and dotted with
 * every row of x (four rows of W at once where x has two rows or more: each x vector is then
 * loaded once per four products); the chunks' sums are added in order */
static void gemv_rows(int fmt, int round, const float *x, int64_t M, int64_t K,
                      const uint8_t *w, int64_t ldw, int64_t n0, int64_t n1, float *out,
                      int64_t N, float *buf)
{
    const int64_t rb = row_bytes(fmt, K), G = GROUP[fmt], GB = GROUP_BYTES[fmt];
    const uint8_t *end = w + (n1 - 1) * ldw + rb;
    for (int64_t m = 0; m < M; m++)
        memset(out + m * N + n0, 0, (size_t)(n1 - n0) * 4);
    int64_t n = n0;
#if EP_X86
    if (lookup_q4(fmt, M)) {
        permute_runs16(x, K, buf);
        for (; n < n1; n++) {
            prefetch(w + (n + 2) * ldw, rb, end);
            out[n] = dot_q4_avx512(fmt, round, buf, w + n * ldw, K);
        }
        return;
    }
#endif
    if (M >= 2)
        for (; n + 4 <= n1; n += 4) {
            for (int r = 0; r < 4; r++) prefetch(w + (n + 4 + r) * ldw, rb, end);
            for (int64_t c = 0; c < K; c += CHUNK) {
                int64_t len = K - c < CHUNK ? K - c : CHUNK;
                for (int r = 0; r < 4; r++)
                    decode_row(fmt, w + (n + r) * ldw + c / G * GB, len, round, buf + r * CHUNK);
                dot4_rows(x + c, K, M, len, buf, CHUNK, out + n, N);
            }
        }
    for (; n < n1; n++) {
        prefetch(w + (n + 2) * ldw, rb, end);
        for (int64_t c = 0; c < K; c += CHUNK) {
            int64_t len = K - c < CHUNK ? K - c : CHUNK;
            decode_row(fmt, w + n * ldw + c / G * GB, len, round, buf);
            dot_rows(x + c, K, M, len, buf, out + n, N);
        }
    }
}

/* out[m, n] = sum_k x[m, k] * W[k, n] for columns n0 <= n < n1, W's rows (N elements each, in
 * format fmt) ldw bytes apart: each row's columns decoded a chunk at a time and added, scaled
 * by x[m, k], into the rows of out (k in order) */
static void gemv_t_rows(int fmt, int round, const float *x, int64_t M, int64_t K,
                        const uint8_t *w, int64_t ldw, int64_t n0, int64_t n1, float *out,
                        int64_t N, float *buf)
{
    const int64_t G = GROUP[fmt], GB = GROUP_BYTES[fmt];
    for (int64_t m = 0; m < M; m++)
        memset(out + m * N + n0, 0, (size_t)(n1 - n0) * 4);
    for (int64_t c = n0; c < n1; c += CHUNK) {
        int64_t len = n1 - c < CHUNK ? n1 - c : CHUNK;
        for (int64_t k = 0; k < K; k++) {
            decode_row(fmt, w + k * ldw + c / G * GB, len, round, buf);
            for (int64_t m = 0; m < M; m++)
                axpy(x[m * K + k], buf, out + m * N + c, len);
        }
    }
}

static PyObject *py_gemv(PyObject *self, PyObject *args)
{
    Py_buffer x, w, out, offsets;
    int fmt, round, transposed = 0;
    Py_ssize_t M, N, K, ldw, b0, b1, n0, n1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*iinnny*nnnnn|p", &x, &w, &out, &fmt, &round, &M, &N, &K,
                          &offsets, &ldw, &b0, &b1, &n0, &n1, &transposed))
        return NULL;
    PyObject *result = NULL;
    const int64_t *off = (const int64_t *)offsets.buf;
    const int64_t count = offsets.len / 8;
    /* rows of W: N of K elements, or (transposed) K of N elements, whole groups each */
    const int64_t wrows = transposed ? K : n1, wlen = transposed ? N : K;
    if (!check(fmt, round, wlen, 0, 0, &w)) goto done;
    if (M <= 0 || K <= 0 || n0 < 0 || n1 <= n0 || n1 > N || b0 < 0 || b1 <= b0 || b1 > count
            || wlen % GROUP[fmt] || (transposed && (n0 % GROUP[fmt] || n1 % GROUP[fmt]))
            || ldw < row_bytes(fmt, wlen) || ldw > (int64_t)w.len
            || !le3(b1, M, K, (int64_t)x.len / 4) || !le3(b1, M, N, (int64_t)out.len / 4)) {
        PyErr_SetString(PyExc_ValueError, "gemv: x, out or the batch range do not fit M, N, K");
        goto done;
    }
    for (int64_t b = b0; b < b1; b++)
        if (off[b] < 0 || off[b] > (int64_t)w.len - row_bytes(fmt, wlen)
                || !le3(wrows - 1, ldw, 1, (int64_t)w.len - row_bytes(fmt, wlen) - off[b])) {
            PyErr_SetString(PyExc_ValueError, "gemv: rows out of the weight's bytes");
            goto done;
        }
    /* four decoded chunks, or x permuted for the lookups */
    float *buf = (float *)malloc((size_t)(K > 4 * CHUNK ? K : 4 * CHUNK) * 4 + 64);
    if (!buf) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = b0; b < b1; b++)
        (transposed ? gemv_t_rows : gemv_rows)(
            fmt, round, (const float *)x.buf + b * M * K, M, K, (const uint8_t *)w.buf + off[b],
            ldw, n0, n1, (float *)out.buf + b * M * N, N, buf);
    Py_END_ALLOW_THREADS
    free(buf);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    PyBuffer_Release(&offsets);
    return result;
}

static PyObject *py_dequant(PyObject *self, PyObject *args)
{
    Py_buffer w, out;
    int fmt, round;
    Py_ssize_t K, n0, n1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*iinnn", &w, &out, &fmt, &round, &K, &n0, &n1))
        return NULL;
    PyObject *result = NULL;
    if (!check(fmt, round, K, n0, n1, &w)) goto done;
    if (!le3(n1 - n0, K, 4, (int64_t)out.len)) {
        PyErr_SetString(PyExc_ValueError, "out too small for the rows");
        goto done;
    }
    const int64_t rb = row_bytes(fmt, K);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t n = n0; n < n1; n++)
        decode_row(fmt, (const uint8_t *)w.buf + n * rb, K, round, (float *)out.buf + (n - n0) * K);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

static const char *ISA_NAMES[] = {"portable", "avx2", "avx512"};

static PyObject *py_isa(PyObject *self, PyObject *noargs)
{
    (void)self; (void)noargs;
    return PyUnicode_FromString(ISA_NAMES[isa]);
}

static PyObject *py_use_isa(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int i = ISA_PORTABLE; i <= best_isa; i++)
        if (!strcmp(name, ISA_NAMES[i])) {
            isa = i;
            return PyUnicode_FromString(ISA_NAMES[isa]);
        }
    PyErr_Format(PyExc_ValueError, "code path %R: this CPU takes portable up to %s", arg,
                 ISA_NAMES[best_isa]);
    return NULL;
}

static PyObject *py_isas(PyObject *self, PyObject *noargs)
{
    (void)self; (void)noargs;
    PyObject *out = PyTuple_New(best_isa + 1);
    for (int i = 0; out && i <= best_isa; i++) {
        PyObject *name = PyUnicode_FromString(ISA_NAMES[i]);
        if (!name) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"gemv", py_gemv, METH_VARARGS,
     "gemv(x, w, out, fmt, round, M, N, K, offsets, ldw, b0, b1, n0, n1): for each batch "
     "b0 <= b < b1 and row n0 <= n < n1, out[b, m, n] = x[b, m, :] . W_b[n, :], where row n of "
     "W_b (K elements in format fmt) starts at byte offsets[b] + n * ldw of w (x, out float32 "
     "C-contiguous [B, M, K], [B, M, N]; offsets int64). With transposed=True, W_b is held "
     "as K rows of N elements (W_b[k, n] at byte offsets[b] + k * ldw): columns n0..n1 "
     "(whole groups) are computed"},
    {"dequant", py_dequant, METH_VARARGS,
     "dequant(w, out, fmt, round, K, n0, n1): rows n0 <= n < n1 of W into out, float32 "
     "[n1 - n0, K]"},
    {"isa", py_isa, METH_NOARGS, "the code path in use: 'avx512', 'avx2' or 'portable'"},
    {"use_isa", py_use_isa, METH_O,
     "use_isa(name): take code path `name` (one of isas()) from now on; returns it"},
    {"isas", py_isas, METH_NOARGS, "the code paths this CPU can take, best last"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu", "Contractions that read a weight as it lies (f16, bf16, "
    "GGUF blocks): see einpage.runtime.storedmm.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu(void)
{
#if EP_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("f16c"))
        best_isa = ISA_AVX2;
    if (best_isa == ISA_AVX2 && __builtin_cpu_supports("avx512f"))
        best_isa = ISA_AVX512;
#endif
    isa = best_isa;
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "F32", F_F32) || PyModule_AddIntConstant(m, "F16", F_F16)
              || PyModule_AddIntConstant(m, "BF16", F_BF16)
              || PyModule_AddIntConstant(m, "Q8_0", F_Q8_0)
              || PyModule_AddIntConstant(m, "Q4_0", F_Q4_0)
              || PyModule_AddIntConstant(m, "Q4_1", F_Q4_1)
              || PyModule_AddIntConstant(m, "Q4_G128", F_Q4_G128))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
