/* A plain C library: no torch, no Python. */
#include <math.h>
#include <string.h>

double no_torch_entry(const char *s) { return sqrt((double)strlen(s)); }
