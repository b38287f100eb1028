// GGUF block matrices repacked at load (cpu_blocks.pack_rows()) into the layout their dot products read: a
// group of 16 output rows stores each unit of inputs (a K-quant's 256-input super-block, a 32-block) as one
// run of bytes, the codes of the same 4 inputs of all 16 rows side by side (4 bytes a row), and the scales as
// arrays over the rows. One vector load then holds a lane per row: the rows' codes meet an input row's 4
// activation codes, broadcast, in one int8 dot product per lane, with no unpacking of 16 separate streams and
// no horizontal sum (llama.cpp's "x8" repacked layouts are the same idea over 8 rows). A group is one
// contiguous stream, every group after the last. The layout is the same for every variant (only the vector
// width differs), and a group holds 16 rows of exactly the bytes of the file, bar Q4_K's and Q5_K's scales,
// unpacked from 6 to 8 bits (148 and 180 bytes a row and super-block in place of 144 and 176), and IQ4_XS's, from
// 6 bits to a signed byte (138 in place of 136). Q3_K's and Q2_K's scale bytes stay as the file packs them, decoded
// as the codes are read: widened, they would cost a 3-bit row 4 % more bytes, a 2-bit one 19 %. The lookup-table
// formats (blocks.h's LUT) keep their 4-bit indexes, which the kernels look up (Codes in packed_blocks.h), as the
// 4-bit codes of the others.
//
// A packed unit of 16 rows (r: row, b < 4: byte of a lane), codes as blocks.h decodes them (cpu_blocks.TYPES
// has each type's bytes a row and block, packed or not):
//   4- and 5-bit codes  codes[pairs][16][4]  pair p: low nibble = code of input 8p + b, high = input 8p + 4 + b
//   Q8_0                codes[8][16][4]      quad q: input 4q + b, as stored (signed)
//   Q5_0, Q5_1, Q5_K    top[subs][16][4]     per 32 inputs: bits 2p, 2p + 1 = the fifth bits of pair p's codes
//   Q3_K, Q2_K          codes[16][16][4]     sub-block g (16 inputs): bits 2k, 2k + 1 = code of 16g + 4k + b
//   Q3_K                top[8][16][4]        per 32 inputs (c): bit k = the third bit of the code of 32c + 4k + b
//   Q6_K                codes[16][3][16][4]  sub-block g (16 inputs), vector k < 3: bits 0-5 = code of 16g + 4k + b,
//                                            bits 6, 7 = bits 2k, 2k + 1 of the code of 16g + 12 + b
//   Q4_K  sc[8][16], mn[8][16] (uint8), d[16], dmin[16] (fp16), then the codes            2,368 bytes
//   Q5_K  as Q4_K, then the top bits, then the codes                                       2,880 bytes
//   Q6_K  sc[16][16] (int8), d[16] (fp16), then the codes                                  3,360 bytes
//   Q3_K  scales[12][16] (the file's bytes), d[16] (fp16), then the top bits, the codes    1,760 bytes
//   Q2_K  scales[16][16] (the file's bytes), d[16], dmin[16] (fp16), then the codes        1,344 bytes
//   32-blocks  the codes (and top bits), then d[16] (fp16), and for Q4_1, Q5_1 m[16]   16 times the file's block
//   MXFP4      the codes, then e[16] (E8M0 bytes)                                     16 times the file's block
//   IQ4_XS     sc[8][16] (int8, less 32), d[16] (fp16), then the codes                  2,208 bytes
//
// A K-quant unit's scales come before its codes, so that a row group's reads go one way through memory (with
// the scales after the codes, every group's first read jumped to the unit's end and back: slower rows).

#pragma once
#include "blocks.h"

#include <type_traits>

namespace packed {

constexpr int ROWS = 16;  // rows a group
using blocks::Format;

constexpr int32_t FLAG = 0x100;  // a Part's type: FLAG | the GGUF type its blocks were packed from

// Byte offsets in a packed unit (0 also where the format has no such field); BYTES: a row's share of a unit.
template <class F> struct Layout;
template <> struct Layout<Format<blocks::IQ4_NL>> { static constexpr int BYTES = 18, CODES = 0, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 0; };
template <> struct Layout<Format<blocks::IQ4_XS>> { static constexpr int BYTES = 138, CODES = 160, TOP = 0, SC = 0, MN = 0, D = 128, DMIN = 0; };
template <> struct Layout<Format<blocks::MXFP4>> { static constexpr int BYTES = 17, CODES = 0, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 0; };
template <> struct Layout<Format<blocks::Q4_K>> { static constexpr int BYTES = 148, CODES = 320, TOP = 0, SC = 0, MN = 128, D = 256, DMIN = 288; };
template <> struct Layout<Format<blocks::Q5_K>> { static constexpr int BYTES = 180, CODES = 832, TOP = 320, SC = 0, MN = 128, D = 256, DMIN = 288; };
template <> struct Layout<Format<blocks::Q6_K>> { static constexpr int BYTES = 210, CODES = 288, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 0; };
template <> struct Layout<Format<blocks::Q4_0>> { static constexpr int BYTES = 18, CODES = 0, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 0; };
template <> struct Layout<Format<blocks::Q4_1>> { static constexpr int BYTES = 20, CODES = 0, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 288; };
template <> struct Layout<Format<blocks::Q5_0>> { static constexpr int BYTES = 22, CODES = 0, TOP = 256, SC = 0, MN = 0, D = 320, DMIN = 0; };
template <> struct Layout<Format<blocks::Q5_1>> { static constexpr int BYTES = 24, CODES = 0, TOP = 256, SC = 0, MN = 0, D = 320, DMIN = 352; };
template <> struct Layout<Format<blocks::Q8_0>> { static constexpr int BYTES = 34, CODES = 0, TOP = 0, SC = 0, MN = 0, D = 512, DMIN = 0; };
template <> struct Layout<Format<blocks::Q3_K>> { static constexpr int BYTES = 110, CODES = 736, TOP = 224, SC = 0, MN = 0, D = 192, DMIN = 0; };
template <> struct Layout<Format<blocks::Q2_K>> { static constexpr int BYTES = 84, CODES = 320, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 288; };

// Calls fn(Format<T>{}) for a packed type (FLAG | T); false for any other.
template <typename Fn>
static bool with_format(int type, Fn fn) {
  using namespace blocks;
  switch (type) {
    case FLAG | IQ4_NL: fn(Format<IQ4_NL>{}); return true;
    case FLAG | IQ4_XS: fn(Format<IQ4_XS>{}); return true;
    case FLAG | MXFP4: fn(Format<MXFP4>{}); return true;
    case FLAG | Q4_0: fn(Format<Q4_0>{}); return true;
    case FLAG | Q4_1: fn(Format<Q4_1>{}); return true;
    case FLAG | Q5_0: fn(Format<Q5_0>{}); return true;
    case FLAG | Q5_1: fn(Format<Q5_1>{}); return true;
    case FLAG | Q8_0: fn(Format<Q8_0>{}); return true;
    case FLAG | Q4_K: fn(Format<Q4_K>{}); return true;
    case FLAG | Q5_K: fn(Format<Q5_K>{}); return true;
    case FLAG | Q6_K: fn(Format<Q6_K>{}); return true;
    case FLAG | Q3_K: fn(Format<Q3_K>{}); return true;
    case FLAG | Q2_K: fn(Format<Q2_K>{}); return true;
    default: return false;
  }
}

// Whether a packed matrix of `type` with rows of row_bytes bytes holds K inputs a row.
static inline bool serves(int type, int64_t K, int64_t row_bytes) {
  bool ok = false;
  with_format(type, [&](auto f) {
    using F = decltype(f);
    ok = K % F::QK == 0 && row_bytes == K / F::QK * Layout<F>::BYTES;
  });
  return ok;
}

// Unit u of the packed group holding row `row`, in a packed matrix w of row_bytes a row.
template <class F, typename T>
static inline T* block(T* w, int64_t row_bytes, int64_t row, int64_t u) {
  return w + row / ROWS * ROWS * row_bytes + u * ROWS * Layout<F>::BYTES;
}

template <class F> constexpr bool BYTE_CODES = std::is_same_v<F, Format<blocks::Q8_0>>;
template <class F> constexpr bool Q6K = std::is_same_v<F, Format<blocks::Q6_K>>;
template <class F>
constexpr bool FIFTH = std::is_same_v<F, Format<blocks::Q5_0>> || std::is_same_v<F, Format<blocks::Q5_1>>
                       || std::is_same_v<F, Format<blocks::Q5_K>>;
template <class F> constexpr bool Q3K = std::is_same_v<F, Format<blocks::Q3_K>>;
template <class F> constexpr bool Q2K = std::is_same_v<F, Format<blocks::Q2_K>>;
template <class F> constexpr bool TWO_BIT = Q3K<F> || Q2K<F>;

// Where Q3_K's and Q2_K's scale bytes and fp16 d lie in the file's block.
template <class F> constexpr int SCALES = Q3K<F> ? 12 : 16;
template <class F> constexpr int SCALES_AT = Q3K<F> ? 96 : 0;
template <class F> constexpr int D_AT = Q3K<F> ? 108 : 80;

// pack() for Q3_K and Q2_K.
template <class F>
static void pack_two_bit(const uint8_t* src, int64_t row_bytes, uint8_t* out) {
  using L = Layout<F>;
  for (int r = 0; r < ROWS; ++r) {
    const uint8_t* b = src + r * row_bytes;
    uint8_t q[256];
    float a[16], off[16];
    F::decode(b, q, a, off);
    for (int g = 0; g < 16; ++g)
      for (int i = 0; i < 4; ++i) {
        uint8_t c = 0;
        for (int k = 0; k < 4; ++k) c |= uint8_t((q[16 * g + 4 * k + i] & 3) << (2 * k));
        out[L::CODES + (g * ROWS + r) * 4 + i] = c;
      }
    for (int c = 0; c < 8 && Q3K<F>; ++c)
      for (int i = 0; i < 4; ++i) {
        uint8_t t = 0;
        for (int k = 0; k < 8; ++k) t |= uint8_t((q[32 * c + 4 * k + i] >> 2) << k);
        out[L::TOP + (c * ROWS + r) * 4 + i] = t;
      }
    for (int i = 0; i < SCALES<F>; ++i) out[L::SC + i * ROWS + r] = b[SCALES_AT<F> + i];
    std::memcpy(out + L::D + 2 * r, b + D_AT<F>, 2);
    if constexpr (F::MIN) std::memcpy(out + L::DMIN + 2 * r, b + D_AT<F> + 2, 2);
  }
}

// decode() for Q3_K and Q2_K: the codes, and the scales from the file's fields of the row, put back in a block.
template <class F>
static void decode_two_bit(const uint8_t* p, int r, uint8_t* q, float* a, float* b) {
  using L = Layout<F>;
  for (int g = 0; g < 16; ++g)
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 4; ++k) q[16 * g + 4 * k + i] = (p[L::CODES + (g * ROWS + r) * 4 + i] >> (2 * k)) & 3;
  for (int c = 0; c < 8 && Q3K<F>; ++c)
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 8; ++k) q[32 * c + 4 * k + i] |= ((p[L::TOP + (c * ROWS + r) * 4 + i] >> k) & 1) << 2;
  uint8_t block[F::BYTES] = {};
  for (int i = 0; i < SCALES<F>; ++i) block[SCALES_AT<F> + i] = p[L::SC + i * ROWS + r];
  std::memcpy(block + D_AT<F>, p + L::D + 2 * r, 2);
  if constexpr (F::MIN) std::memcpy(block + D_AT<F> + 2, p + L::DMIN + 2 * r, 2);
  F::scales(block, a, b);
}
template <class F> constexpr bool SIGNED_SCALES = Q6K<F> || std::is_same_v<F, Format<blocks::IQ4_XS>>;
template <class F> constexpr bool E8M0 = std::is_same_v<F, Format<blocks::MXFP4>>;  // d: one E8M0 byte a row

// 16 rows of unit blocks (row r's at src + r * row_bytes) -> one packed unit at out.
template <class F>
static void pack(const uint8_t* src, int64_t row_bytes, uint8_t* out) {
  if constexpr (TWO_BIT<F>) return pack_two_bit<F>(src, row_bytes, out);
  using L = Layout<F>;
  uint8_t* codes = out + L::CODES;
  for (int r = 0; r < ROWS; ++r) {
    const uint8_t* b = src + r * row_bytes;
    uint8_t q[F::QK];
    float a[F::QK / F::SUB], off[F::QK / F::SUB];
    if constexpr (blocks::LUT<F>) F::indexes(b, q);  // Codes looks them up
    else F::decode(b, q, a, off);
    if constexpr (FIFTH<F>)
      for (int g = 0; g < F::QK / 32; ++g) std::memset(out + L::TOP + (g * ROWS + r) * 4, 0, 4);
    if constexpr (Q6K<F>)
      for (int g = 0; g < 16; ++g)
        for (int k = 0; k < 3; ++k)
          for (int i = 0; i < 4; ++i)
            codes[((3 * g + k) * ROWS + r) * 4 + i] = uint8_t(q[16 * g + 4 * k + i] | ((q[16 * g + 12 + i] >> (2 * k)) & 3) << 6);
    for (int p = 0; p < F::QK / 8 && !Q6K<F>; ++p)
      for (int i = 0; i < 4; ++i) {
        const uint8_t lo = q[8 * p + i], hi = q[8 * p + 4 + i];
        if constexpr (BYTE_CODES<F>) codes[(2 * p * ROWS + r) * 4 + i] = lo, codes[((2 * p + 1) * ROWS + r) * 4 + i] = hi;
        else codes[(p * ROWS + r) * 4 + i] = uint8_t((lo & 15) | (hi & 15) << 4);
        if constexpr (FIFTH<F>)  // pair p is pair p % 4 of sub-block p / 4 (32 inputs)
          out[L::TOP + (p / 4 * ROWS + r) * 4 + i] |= uint8_t((lo >> 4) << (2 * (p % 4)) | (hi >> 4) << (2 * (p % 4) + 1));
      }
    if constexpr (F::QK == 256) {
      int32_t sc[16], mn[16];
      float d, dmin;
      F::ints(b, sc, mn, d, dmin);
      for (int g = 0; g < 256 / F::SUB; ++g) out[L::SC + g * ROWS + r] = uint8_t(sc[g]);
      if constexpr (Q6K<F>) {
        std::memcpy(out + L::D + 2 * r, b + 208, 2);
        continue;
      }
      if constexpr (F::MIN)
        for (int j = 0; j < 8; ++j) out[L::MN + j * ROWS + r] = uint8_t(mn[j]);
    }
    if constexpr (E8M0<F>) {
      out[L::D + r] = b[0];
      continue;
    }
    std::memcpy(out + L::D + 2 * r, b, 2);  // d, then dmin (K-quants) or m (Q4_1, Q5_1)
    if constexpr (F::MIN) std::memcpy(out + L::DMIN + 2 * r, b + 2, 2);
  }
}

// Row r of a packed unit p, as F::decode() gives it from the file's block: codes q, scales a, offsets b.
template <class F>
static void decode(const uint8_t* p, int r, uint8_t* q, float* a, float* b) {
  if constexpr (TWO_BIT<F>) return decode_two_bit<F>(p, r, q, a, b);
  using L = Layout<F>;
  const uint8_t* codes = p + L::CODES;
  if constexpr (Q6K<F>)
    for (int g = 0; g < 16; ++g)
      for (int i = 0; i < 4; ++i) {
        q[16 * g + 12 + i] = 0;
        for (int k = 0; k < 3; ++k) {
          const uint8_t c = codes[((3 * g + k) * ROWS + r) * 4 + i];
          q[16 * g + 4 * k + i] = c & 63, q[16 * g + 12 + i] |= uint8_t((c >> 6) << (2 * k));
        }
      }
  for (int j = 0; j < F::QK / 8 && !Q6K<F>; ++j)
    for (int i = 0; i < 4; ++i) {
      if constexpr (BYTE_CODES<F>) {
        q[8 * j + i] = codes[(2 * j * ROWS + r) * 4 + i], q[8 * j + 4 + i] = codes[((2 * j + 1) * ROWS + r) * 4 + i];
        continue;
      }
      const uint8_t c = codes[(j * ROWS + r) * 4 + i];
      q[8 * j + i] = c & 15, q[8 * j + 4 + i] = c >> 4;
      if constexpr (FIFTH<F>) {
        const uint8_t top = p[L::TOP + (j / 4 * ROWS + r) * 4 + i];
        q[8 * j + i] |= ((top >> (2 * (j % 4))) & 1) << 4, q[8 * j + 4 + i] |= ((top >> (2 * (j % 4) + 1)) & 1) << 4;
      }
    }
  if constexpr (blocks::LUT<F>) blocks::look_up(F::VALUES, q, F::QK);
  uint16_t h[2] = {};
  if constexpr (!E8M0<F>) std::memcpy(h, p + L::D + 2 * r, 2);
  const float d = E8M0<F> ? blocks::e8m0_half(p[L::D + r]) : half_to_float(h[0]);
  float dmin = 0.f;
  if constexpr (F::MIN) std::memcpy(h + 1, p + L::DMIN + 2 * r, 2), dmin = half_to_float(h[1]);
  if constexpr (F::QK == 32) {
    a[0] = d, b[0] = dmin;
  } else if constexpr (SIGNED_SCALES<F>) {
    for (int g = 0; g < F::QK / F::SUB; ++g) a[g] = d * float(int8_t(p[L::SC + g * ROWS + r]));
  } else {
    for (int j = 0; j < 8; ++j) a[j] = d * float(p[L::SC + j * ROWS + r]), b[j] = -(dmin * float(p[L::MN + j * ROWS + r]));
  }
}

}  // namespace packed
