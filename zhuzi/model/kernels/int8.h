// The int8 dot products under the q8 kernels, one definition per variant (arch/x86/avx512, arch/x86/avx2,
// arch/arm/neon, arch/generic: int8.h in each), the same names everywhere:
//
//   I32                     the variant's vector of int32 lanes (LANES of them)
//   B8                      a vector of 4 * LANES bytes: 4 consecutive bytes per lane
//   load_b8(p)              B8 from 4 * LANES bytes at p
//   dot_u8s8(acc, u, s)     acc[l] += the 4 products of lane l's bytes, u unsigned, s signed
//   dot_s8s8(acc, a, b)     the same for two signed operands
//   dot_u8s8_at(acc, u, p)  dot_u8s8 with s the 4 signed bytes at p in every lane
//   to_float(I32)           the lanes as floats
//   EXACT_U8                whether dot_u8s8 is exact for any u8 operand (up to 255), not only <= 127
//   table16(t)              B8 holding the 16 bytes at t in every 16 (a lookup table)
//   look_up(table, idx)     byte i: table's byte idx_i (idx_i < 16), the 4-bit lookup-table formats' values
//
// Preconditions (what keeps AVX2's 16-bit maddubs exact): u <= 127 (4-bit codes, 8-bit codes' magnitudes),
// and no signed byte is -128 (quant.py's and q8.h's codes stay in -127..127).
#pragma once
#include "prelude.h"

#if ZHUZI_AVX512
#include "arch/x86/avx512/int8.h"
#elif ZHUZI_AVX2
#include "arch/x86/avx2/int8.h"
#elif ZHUZI_NEON
#include "arch/arm/neon/int8.h"
#else
#include "arch/generic/int8.h"
#endif
