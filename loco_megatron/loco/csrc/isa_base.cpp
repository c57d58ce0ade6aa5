// The baseline x86-64 copy of every hot loop (see isa_copy.h); its own unit so that
// ninja compiles the three copies in parallel.
#define LOCO_ISA_ATTR LOCO_BASE
#define LOCO_ISA_SUFFIX base
#include "isa_copy.h"
