/* XXH3-128 of prefix || row, computed while the row is copied: one pass over the row's bytes.
 * Included by mint_read.c (copy_row), AVX2 builds only.
 *
 *   h = xxh3_128(pre + src[0:n]); dest[0:n] = src[0:n]      # requires len(pre) < 64, len(pre) + n > 240
 *
 * XXH3's long-input path (the one for inputs over 240 bytes), following its specification
 * (xxhash's doc/xxhash_spec.md, "XXH3 Algorithm Overview"): eight 64-bit accumulators absorb the
 * input in 64-byte stripes, each with the secret at a step of 8 bytes; after a block of
 * (secret size - 64) / 8 stripes they are scrambled; the input's final 64 bytes are one more
 * stripe; two merges give the low and high halves. Each stripe's two 32-byte loads are stored
 * to dest as well, so the copy takes its bytes from registers rather than reading them again.
 *
 * The secret is XXH3's default, a constant of the specification. native.py's self-check
 * compares this code with python-xxhash (the library that wrote the content ids) on every
 * load; if they ever disagree, copy_row hashes with python-xxhash instead (set_one_pass).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define XXH_SECRET_SIZE 192
#define XXH_STRIPE 64
#define XXH_P32_1 0x9E3779B1U
#define XXH_P32_2 0x85EBCA77U
#define XXH_P32_3 0xC2B2AE3DU
#define XXH_P64_1 0x9E3779B185EBCA87ULL
#define XXH_P64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_P64_3 0x165667B19E3779F9ULL
#define XXH_P64_4 0x85EBCA77C2B2AE63ULL
#define XXH_P64_5 0x27D4EB2F165667C5ULL

static const uint8_t xxh3_secret[XXH_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t xxh_rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* one stripe (d0 || d1) into acc[0..1] (eight u64 lanes), with the secret at key:
 *   for i in 0..7: x = data[i] ^ key[i]; acc[i ^ 1] += data[i]; acc[i] += lo32(x) * hi32(x) */
static inline void xxh_accumulate(__m256i *acc, __m256i d0, __m256i d1, const uint8_t *key) {
    __m256i x0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)key));
    __m256i x1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(key + 32)));
    __m256i p0 = _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)), p1 = _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32));
    __m256i s0 = _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2)), s1 = _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2));
    acc[0] = _mm256_add_epi64(p0, _mm256_add_epi64(acc[0], s0));
    acc[1] = _mm256_add_epi64(p1, _mm256_add_epi64(acc[1], s1));
}

/* after each block: for i in 0..7: a = acc[i]; a ^= a >> 47; a ^= key[i]; acc[i] = a * P32_1 */
static inline void xxh_scramble(__m256i *acc, const uint8_t *key) {
    const __m256i prime = _mm256_set1_epi32((int)XXH_P32_1);
    for (int j = 0; j < 2; j++) {
        __m256i a = acc[j];
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(key + 32 * j)));
        __m256i lo = _mm256_mul_epu32(a, prime), hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        acc[j] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
}

static inline uint64_t xxh_fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static uint64_t xxh_merge(const uint64_t *acc, const uint8_t *key, uint64_t start) {
    uint64_t r = start;
    for (int i = 0; i < 4; i++)
        r += xxh_fold64(acc[2 * i] ^ xxh_rd64(key + 16 * i), acc[2 * i + 1] ^ xxh_rd64(key + 16 * i + 8));
    r ^= r >> 37; /* avalanche */
    r *= 0x165667919E3779F9ULL;
    return r ^ (r >> 32);
}

/* h = xxh3_128(pre[0:np] + src[0:n]) and dest[0:n] = src[0:n]; np < 64 and np + n > 240 */
static h128_t xxh3_copy(const uint8_t *pre, size_t np, const uint8_t *src, uint8_t *dest, size_t n) {
    const uint8_t *secret = xxh3_secret;
    const size_t per_block = (XXH_SECRET_SIZE - XXH_STRIPE) / 8; /* stripes between scrambles */
    const uint8_t *scramble_key = secret + XXH_SECRET_SIZE - XXH_STRIPE;
    const uint64_t init[8] = {XXH_P32_3, XXH_P64_1, XXH_P64_2, XXH_P64_3, XXH_P64_4, XXH_P32_2, XXH_P64_5, XXH_P32_1};
    __m256i acc[2];
    memcpy(acc, init, sizeof acc);
    size_t len = np + n, stripes = (len - 1) / XXH_STRIPE; /* the full stripes before the last one */
    { /* stripe s is stream [64 s, 64 s + 64); the first: the prefix and the row's first 64 - np bytes */
        uint8_t first[XXH_STRIPE];
        memcpy(first, pre, np);
        memcpy(first + np, src, XXH_STRIPE - np);
        memcpy(dest, src, XXH_STRIPE - np);
        xxh_accumulate(acc, _mm256_loadu_si256((const __m256i *)first),
                       _mm256_loadu_si256((const __m256i *)(first + 32)), secret);
    }
    size_t s = 1, within = 1; /* (len > 240: at least three full stripes) */
    const uint8_t *in = src + (XXH_STRIPE - np); /* stripe s starts at src + 64 s - np */
    uint8_t *out = dest + (XXH_STRIPE - np);
    for (; s < stripes; s++, in += XXH_STRIPE, out += XXH_STRIPE) {
        __m256i d0 = _mm256_loadu_si256((const __m256i *)in), d1 = _mm256_loadu_si256((const __m256i *)(in + 32));
        _mm256_storeu_si256((__m256i *)out, d0);
        _mm256_storeu_si256((__m256i *)(out + 32), d1);
        xxh_accumulate(acc, d0, d1, secret + within * 8);
        if (++within == per_block) {
            xxh_scramble(acc, scramble_key);
            within = 0;
        }
    }
    memcpy(out, in, n - (size_t)(out - dest)); /* the row's tail, at most one stripe */
    const uint8_t *last = src + n - XXH_STRIPE; /* the stream's last 64 bytes (n > 176 > 64) */
    xxh_accumulate(acc, _mm256_loadu_si256((const __m256i *)last), _mm256_loadu_si256((const __m256i *)(last + 32)),
                   secret + XXH_SECRET_SIZE - XXH_STRIPE - 7);
    uint64_t a[8];
    memcpy(a, acc, sizeof a);
    h128_t h;
    h.low64 = xxh_merge(a, secret + 11, (uint64_t)len * XXH_P64_1);
    h.high64 = xxh_merge(a, secret + XXH_SECRET_SIZE - XXH_STRIPE - 11, ~((uint64_t)len * XXH_P64_2));
    return h;
}
