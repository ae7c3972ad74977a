/* What the C test harnesses share: a deterministic RNG (the same numbers on every machine) and the hash
 * they print. */
#ifndef IZH_TEST_HARNESS_H
#define IZH_TEST_HARNESS_H

#include <stddef.h>
#include <stdint.h>

static uint64_t rng_state;

static inline uint64_t rng(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline float uniform(float lo, float hi) { /* 24 random bits: exact in float, same everywhere */
    return lo + (hi - lo) * ((float)(rng() >> 40) * (1.0f / 16777216.0f));
}

static inline uint64_t fnv1a(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}

#endif
