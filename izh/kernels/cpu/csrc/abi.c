#include "common.h"

/* Lets the loader check it got the library it built. */
int izh_cpu_abi_version(void) { return 10; }
