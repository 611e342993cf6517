// Emulator stand-in for CUDA's cuda_fp16.h: IEEE binary16 in software (round to nearest even),
// so it builds with any C++17 compiler (GCC < 12 has no _Float16 on x86).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

struct __half { uint16_t bits; };

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (mant << 13);  // inf / NaN
    } else if (exp == 0) {  // zero / subnormal: mant * 2^-24
        const float f = std::ldexp((float)mant, -24);
        std::memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __half __float2half_rn(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t mant = x & 0x7fffffu;
    const int exp = (int)((x >> 23) & 0xffu);
    if (exp == 0xff) return __half{(uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0u))};
    const int e = exp - 127 + 15;
    if (e >= 0x1f) return __half{(uint16_t)(sign | 0x7c00u)};  // overflow -> inf
    if (e <= 0) {                                                 // subnormal half (or zero)
        if (e < -10) return __half{sign};
        mant |= 0x800000u;
        const int shift = 14 - e;
        uint32_t m = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (m & 1u))) ++m;
        return __half{(uint16_t)(sign | m)};
    }
    uint32_t h = ((uint32_t)e << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry rounds up into the exponent
    return __half{(uint16_t)(sign | h)};
}
