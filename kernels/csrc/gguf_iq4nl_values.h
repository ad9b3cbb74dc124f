// The 16 int8 values that IQ4_NL's and IQ4_XS's nibbles index (ggml's
// kvalues_iq4nl): one table for gguf_linear_cpu.cpp's 32-weight IQ4_NL blocks
// and the IQ4_XS super-blocks of gguf_kquant_cpu.cpp and gguf_kquant_integer_cpu.cpp.
#pragma once

#include <cstdint>

namespace fleet_gguf {

constexpr int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

}  // namespace fleet_gguf
