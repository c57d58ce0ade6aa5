// The AVX-512 copy of every hot loop (see isa_copy.h); its own unit so that
// ninja compiles the three copies in parallel.
#define LOCO_ISA_ATTR LOCO_AVX512
#define LOCO_ISA_SUFFIX avx512
#include "isa_copy.h"
