/*
 * XXH3-64 (seed 0, default secret), written from its public specification
 * (Cyan4973/xxHash, doc/xxhash_spec.md), so that a hash can be taken in the same pass that
 * copies the bytes: the block copies of _cpu_block_copy.c feed each 64-byte stripe they load to
 * the hash while it is still in registers, and KV bytes are read from memory once.
 *
 * Why XXH3-64 and not a hash of our own: it is what WriteDone always carried (producers and
 * consumers of earlier builds agree with this one, nothing on the wire changes), the Python
 * package xxhash checks it in tests, and it is strong enough for what integrity guards against
 * (a write landed in the wrong page, torn or repeated, memory scribbled over): a 64-bit hash
 * that passes SMHasher, where a flipped bit anywhere changes the result. It is not meant to stop
 * an attacker; nothing non-cryptographic is.
 *
 * Streaming over one contiguous input (the chunk: a staging page or a receive page), fed in
 * ascending pieces: stripe s (bytes [64 s, 64 s + 64)) is accumulated once every byte of it has
 * been seen; the input's last 64 bytes and inputs of 240 bytes or less are read back from the
 * input at the end, where they are still in the CPU's caches.
 */
#ifndef LMCACHE_PD_XXH3_H
#define LMCACHE_PD_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define XXH3_STRIPE 64
#define XXH3_STRIPES_PER_BLOCK 16 /* (secret bytes - 64) / 8 */
#define XXH3_SECRET_BYTES 192
#define XXH3_MIDSIZE_MAX 240

static const uint64_t P32_1 = 0x9E3779B1U, P32_2 = 0x85EBCA77U, P32_3 = 0xC2B2AE3DU;
static const uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P64_3 = 0x165667B19E3779F9ULL, P64_4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t P64_5 = 0x27D4EB2F165667C5ULL;
static const uint64_t PMX_1 = 0x165667919E3779F9ULL, PMX_2 = 0x9FB21C651E98DF25ULL;

/* The specification's default secret. */
static const uint8_t XXH3_SECRET[XXH3_SECRET_BYTES] = {
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

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only: x86-64 and aarch64 */
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX_1;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret) {
    return mul128_fold64(rd64(in) ^ rd64(secret), rd64(in + 8) ^ rd64(secret + 8));
}

/* Inputs of 0 to 240 bytes: each length range has its own mix in the specification. */
static uint64_t xxh3_short(const uint8_t *in, size_t len) {
    const uint8_t *s = XXH3_SECRET;
    if (len == 0) {
        return xxh64_avalanche(rd64(s + 56) ^ rd64(s + 64));
    }
    if (len <= 3) {
        uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                            (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        return xxh64_avalanche((uint64_t)combined ^ (uint64_t)(rd32(s) ^ rd32(s + 4)));
    }
    if (len <= 8) {
        uint64_t keyed = ((uint64_t)rd32(in + len - 4) + ((uint64_t)rd32(in) << 32)) ^
                         (rd64(s + 8) ^ rd64(s + 16));
        keyed ^= rotl64(keyed, 49) ^ rotl64(keyed, 24);
        keyed *= PMX_2;
        keyed ^= (keyed >> 35) + len;
        keyed *= PMX_2;
        return keyed ^ (keyed >> 28);
    }
    if (len <= 16) {
        uint64_t lo = rd64(in) ^ (rd64(s + 24) ^ rd64(s + 32));
        uint64_t hi = rd64(in + len - 8) ^ (rd64(s + 40) ^ rd64(s + 48));
        return xxh3_avalanche(len + __builtin_bswap64(lo) + hi + mul128_fold64(lo, hi));
    }
    uint64_t acc = len * P64_1;
    if (len <= 128) {
        /* pairs from both ends, outermost first, as far in as the length reaches */
        for (size_t i = 0, pairs = (len - 1) / 32 + 1; i < pairs; i++) {
            acc += mix16(in + 16 * i, s + 32 * i) + mix16(in + len - 16 * (i + 1), s + 32 * i + 16);
        }
        return xxh3_avalanche(acc);
    }
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++) {
        acc += mix16(in + 16 * i, s + 16 * i);
    }
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < rounds; i++) {
        acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3);
    }
    acc += mix16(in + len - 16, s + 136 - 17);
    return xxh3_avalanche(acc);
}

/* ---- inputs over 240 bytes: eight accumulators over 64-byte stripes ---- */

static inline void accumulate_scalar(uint64_t acc[8], const uint8_t *stripe, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t value = rd64(stripe + 8 * i);
        uint64_t keyed = value ^ rd64(key + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

static inline void scramble_scalar(uint64_t acc[8]) {
    const uint8_t *key = XXH3_SECRET + XXH3_SECRET_BYTES - XXH3_STRIPE;
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(key + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* Stripes first .. first + count - 1 of the input, read from src; copied to dst too unless dst
 * is NULL. Portable: any CPU. */
static void stripes_scalar(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t first,
                           size_t count) {
    for (size_t n = 0; n < count; n++, src += XXH3_STRIPE) {
        size_t s = first + n;
        if (dst != NULL) {
            memcpy(dst, src, XXH3_STRIPE);
            dst += XXH3_STRIPE;
        }
        accumulate_scalar(acc, src, XXH3_SECRET + (s % XXH3_STRIPES_PER_BLOCK) * 8);
        if ((s + 1) % XXH3_STRIPES_PER_BLOCK == 0) {
            scramble_scalar(acc);
        }
    }
}

#if defined(__x86_64__)
/* The same with AVX2: four 64-bit lanes a register, two registers a stripe. Chosen at run time
 * (xxh3_have_avx2): the extension is built for any x86-64. */
__attribute__((target("avx2"))) static void stripes_avx2(uint64_t acc[8], uint8_t *dst,
                                                         const uint8_t *src, size_t first,
                                                         size_t count) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)acc);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const uint8_t *scramble_key = XXH3_SECRET + XXH3_SECRET_BYTES - XXH3_STRIPE;
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    for (size_t n = 0; n < count; n++, src += XXH3_STRIPE) {
        size_t s = first + n;
        const uint8_t *key = XXH3_SECRET + (s % XXH3_STRIPES_PER_BLOCK) * 8;
        __m256i d0 = _mm256_loadu_si256((const __m256i *)src);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        if (dst != NULL) {
            _mm256_storeu_si256((__m256i *)dst, d0);
            _mm256_storeu_si256((__m256i *)(dst + 32), d1);
            dst += XXH3_STRIPE;
        }
        __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)key));
        __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(key + 32)));
        /* low 32 bits of each keyed lane times its high 32 bits */
        __m256i p0 = _mm256_mul_epu32(k0, _mm256_shuffle_epi32(k0, _MM_SHUFFLE(0, 3, 0, 1)));
        __m256i p1 = _mm256_mul_epu32(k1, _mm256_shuffle_epi32(k1, _MM_SHUFFLE(0, 3, 0, 1)));
        /* acc[i ^ 1] += value: swap the 64-bit lanes of each pair */
        __m256i w0 = _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2));
        __m256i w1 = _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2));
        lo = _mm256_add_epi64(lo, _mm256_add_epi64(p0, w0));
        hi = _mm256_add_epi64(hi, _mm256_add_epi64(p1, w1));
        if ((s + 1) % XXH3_STRIPES_PER_BLOCK == 0) {
            __m256i regs[2] = {lo, hi};
            for (int r = 0; r < 2; r++) {
                __m256i a = regs[r];
                a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
                a = _mm256_xor_si256(
                    a, _mm256_loadu_si256((const __m256i *)(scramble_key + 32 * r)));
                /* 64-bit lane times a 32-bit prime, from two 32x32 products */
                __m256i low = _mm256_mul_epu32(a, prime);
                __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
                regs[r] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
            }
            lo = regs[0];
            hi = regs[1];
        }
    }
    _mm256_storeu_si256((__m256i *)acc, lo);
    _mm256_storeu_si256((__m256i *)(acc + 4), hi);
}

static int xxh3_have_avx2(void) {
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return have;
}
#endif

static void xxh3_stripes(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t first,
                         size_t count) {
#if defined(__x86_64__)
    if (xxh3_have_avx2()) {
        stripes_avx2(acc, dst, src, first, count);
        return;
    }
#endif
    stripes_scalar(acc, dst, src, first, count);
}

/* One input's hash being taken: the input, its length, and the stripes accumulated so far. */
typedef struct {
    const uint8_t *input;
    size_t len;
    size_t done;  /* stripes accumulated */
    size_t total; /* stripes accumulated before the last one: (len - 1) / 64 */
    uint64_t acc[8];
} xxh3_stream;

static void xxh3_begin(xxh3_stream *h, const uint8_t *input, size_t len) {
    static const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    h->input = input;
    h->len = len;
    h->done = 0;
    h->total = len > XXH3_MIDSIZE_MAX ? (len - 1) / XXH3_STRIPE : 0;
    memcpy(h->acc, init, sizeof init);
}

/* Bytes [0, seen) of the input are final: accumulate every stripe that lies within them. */
static void xxh3_seen(xxh3_stream *h, size_t seen) {
    size_t upto = seen / XXH3_STRIPE < h->total ? seen / XXH3_STRIPE : h->total;
    if (upto > h->done) {
        xxh3_stripes(h->acc, NULL, h->input + h->done * XXH3_STRIPE, h->done, upto - h->done);
        h->done = upto;
    }
}

/* Copy n bytes from src to dst, where they are bytes [offset, offset + n) of the input (the
 * input is dst for a gather, src for a scatter), hashing them in the same pass where they begin
 * at the next stripe to accumulate; otherwise (a block size that is not a multiple of 64 bytes)
 * copy, then hash them from the input while they are in cache. */
static void xxh3_copy(xxh3_stream *h, uint8_t *dst, const uint8_t *src, size_t offset, size_t n) {
    size_t fused = 0;
    if (offset == h->done * XXH3_STRIPE && h->done < h->total) {
        fused = n / XXH3_STRIPE < h->total - h->done ? n / XXH3_STRIPE : h->total - h->done;
        xxh3_stripes(h->acc, dst, src, h->done, fused);
        h->done += fused;
        fused *= XXH3_STRIPE;
    }
    memcpy(dst + fused, src + fused, n - fused);
    xxh3_seen(h, offset + n);
}

/* The hash, once every byte of the input is final. */
static uint64_t xxh3_end(xxh3_stream *h) {
    if (h->len <= XXH3_MIDSIZE_MAX) {
        return xxh3_short(h->input, h->len);
    }
    xxh3_seen(h, h->len);
    uint64_t acc[8];
    memcpy(acc, h->acc, sizeof acc);
    accumulate_scalar(acc, h->input + h->len - XXH3_STRIPE,
                      XXH3_SECRET + XXH3_SECRET_BYTES - XXH3_STRIPE - 7);
    uint64_t result = h->len * P64_1;
    for (int i = 0; i < 4; i++) {
        const uint8_t *key = XXH3_SECRET + 11 + 16 * i;
        result += mul128_fold64(acc[2 * i] ^ rd64(key), acc[2 * i + 1] ^ rd64(key + 8));
    }
    return xxh3_avalanche(result);
}

#endif
