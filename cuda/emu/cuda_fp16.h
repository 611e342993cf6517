// Emulator stand-in for CUDA's cuda_fp16.h: IEEE binary16 through GCC's _Float16 (round to nearest even).
#pragma once
struct __half { _Float16 v; };
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
